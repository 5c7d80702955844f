"""Shared fixtures and the ``--run-slow`` option. Every test that needs Redis talks to a real
server process started here on a free port (never the shared one on 6379, never a mock); the
pool factories bind pool objects to the per-test server and close them at teardown."""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import sys
import tempfile
import uuid

import pytest
import redis
import redis.asyncio as aioredis

from gpulock import AsyncPool, Pool
from support import tracing_guard
from support.servers import RedisProcess, server_kinds

# CPython 3.11 before 3.11.8 keeps the AST constructor's recursion counter per interpreter, not
# per thread (python/cpython#106905): once two threads have parsed at once, a later `ast.parse`
# can fail with "AST constructor recursion depth mismatch". schemathesis's pytest plugin
# imports its report writers at the end of the session, through pytest's assertion rewriting
# (an `ast.parse`), and that failed runs whose tests had all passed (test_lost_cancellation.py
# run alone). Import them now, while nothing else parses; one that cannot be imported (the
# Allure writer without allure installed) is marked so, and fails again without a parse.
if sys.version_info < (3, 11, 8):
    for _writer in (
        "schemathesis.reporting.allure",
        "schemathesis.reporting.html.writer",
        "schemathesis.reporting.junitxml",
    ):
        try:
            importlib.import_module(_writer)
        except ImportError:
            sys.modules[_writer] = None  # type: ignore[assignment]


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run long soaks and benchmarks")


def pytest_xdist_auto_num_workers(config):
    """How many processes ``-n auto`` (pyproject.toml's addopts) runs the tests in.

    Most tests wait on TTLs, heartbeats and subprocesses rather than on the CPU, so two workers
    a core (at least 4, at most 8; ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides). One process,
    no workers, when the run names a single test file (or node IDs in one): ``--dist loadfile``
    would give that file to one worker anyway, and a plain run keeps ``-s`` and ``--pdb``."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    files = {a.split("::")[0] for a in config.args}
    if len(files) == 1 and next(iter(files)).endswith(".py"):
        return 0
    return max(4, min(8, 2 * (os.cpu_count() or 1)))


#: The order files are handed to the workers in: the directories whose files run longest first,
#: so that no long file starts last and leaves the other workers idle (the unit tests, seconds
#: in all, fill the gaps at the end). Within a directory the order is the collection order.
_DIRECTORY_ORDER = ("integration", "faults", "e2e", "broker", "schemathesis", "unit")


def _directory_rank(item) -> int:
    parts = item.nodeid.split("/")
    top = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
    return _DIRECTORY_ORDER.index(top) if top in _DIRECTORY_ORDER else len(_DIRECTORY_ORDER)


def _given_rank(config):
    """With ``GPULOCK_TEST_FILE_ORDER=given`` (or ``reverse``): a file's rank in the order the
    command line names the files (or the reverse), for runs that show files sharing one
    process do not affect each other (the tracing files, ``-n 0``); else None."""
    order = os.environ.get("GPULOCK_TEST_FILE_ORDER")
    if order not in ("given", "reverse"):
        return None
    names = [a.split("::")[0] for a in config.args]
    names = names[::-1] if order == "reverse" else names
    return lambda item: next(
        (i for i, n in enumerate(names) if item.nodeid.startswith(n)), len(names)
    )


def pytest_collection_modifyitems(config, items):
    # stable: each file's tests stay together, in their order
    items.sort(key=_given_rank(config) or _directory_rank)
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


SERVER_KINDS = server_kinds()

# `gpulock serve` keeps its embedded server's data under $XDG_STATE_HOME (gpulock_service.datadir):
# each test gets a directory of its own there, never the user's, and never one an earlier test
# on the same port left behind. gunicorn (25.1 and later) puts its control socket at
# $XDG_RUNTIME_DIR/gunicorn.ctl, else at ~/.gunicorn/gunicorn.ctl, where each new gunicorn
# replaces the last one's (the user's too): every test, and every test process (for what its
# module- and session-scoped fixtures start), gets a runtime directory of its own as well.
_STATE_ROOT = tempfile.mkdtemp(prefix="gpulock-test-state-")
atexit.register(shutil.rmtree, _STATE_ROOT, True)
os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="run-", dir=_STATE_ROOT)


@pytest.fixture(autouse=True)
def _own_state_dir(monkeypatch):
    own = os.path.join(_STATE_ROOT, uuid.uuid4().hex)
    os.makedirs(os.path.join(own, "run"), mode=0o700)
    monkeypatch.setenv("XDG_STATE_HOME", own)
    monkeypatch.setenv("XDG_RUNTIME_DIR", os.path.join(own, "run"))


@pytest.fixture(scope="module", autouse=True)
def _no_tracer_provider_left():
    """Fail the file (an error at its last test's teardown) that leaves a recording
    OpenTelemetry tracer provider set for the files after it in this process
    (:mod:`support.tracing_guard`, which also puts the previous one back)."""
    before = tracing_guard.provider()
    yield
    problem = tracing_guard.leaked(before)
    if problem is not None:
        pytest.fail(problem, pytrace=False)


@pytest.fixture(
    scope="session", params=[k for k, _ in SERVER_KINDS], ids=[k for k, _ in SERVER_KINDS]
)
def server_binary(request):
    """Each Redis-compatible server this machine has: the system redis-server (Redis 7 here)
    and the embedded Valkey the README's first command uses."""
    return dict(SERVER_KINDS)[request.param]


@pytest.fixture(scope="session")
def default_binary():
    return SERVER_KINDS[0][1]


@pytest.fixture
def redis_proc(server_binary):
    """A fresh, empty server per test (parametrized over server kinds)."""
    with RedisProcess(server_binary) as p:
        yield p


@pytest.fixture
def redis_proc1(default_binary):
    """A fresh, empty server per test, of the first kind only (for slow fault tests)."""
    with RedisProcess(default_binary) as p:
        yield p


@pytest.fixture
def rclient(redis_proc):
    c = redis.Redis.from_url(redis_proc.url)
    yield c
    c.close()


@pytest.fixture
def pool_name():
    return f"t{os.getpid()}"


@pytest.fixture
async def make_apool(redis_proc, pool_name):
    made = []

    def make(name: str | None = None, **kw) -> AsyncPool:
        client = aioredis.Redis.from_url(redis_proc.url, socket_timeout=5, socket_connect_timeout=2)
        p = AsyncPool(client, name or pool_name, **kw)
        made.append((p, client))
        return p

    yield make
    for p, client in made:
        await p.aclose()
        await client.aclose()


@pytest.fixture
def make_pool(redis_proc, pool_name):
    made = []

    def make(name: str | None = None, **kw) -> Pool:
        client = redis.Redis.from_url(redis_proc.url, socket_timeout=5, socket_connect_timeout=2)
        p = Pool(client, name or pool_name, **kw)
        made.append((p, client))
        return p

    yield make
    for p, client in made:
        p.close()
        client.close()
