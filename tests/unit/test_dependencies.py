"""Which way the imports point: the core (``gpulock``) imports neither the demo service
(``gpulock_service``), the lease broker (``gpulock_broker``) nor the SDK (``gpulock_client``);
the broker does not import the service, nor the service the broker; and gpulock's own modules
import each other without a cycle.

The import checks run in a fresh interpreter (``sys.modules`` of the test process already holds
everything). The cycle check is static: an ``ast`` walk of each module's top-level imports
(those run when the module is imported; imports inside functions run later, when every module
is complete, and ``if TYPE_CHECKING:`` blocks never run), so a cycle is found whatever order
the modules happen to be imported in.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import gpulock

PACKAGE_DIR = Path(gpulock.__file__).parent

# The core without its HTTP layer (gpulock.fastapi and the modules behind it): what a process
# that leases from Redis, or runs the `gpulock` CLI, loads.
CORE = [
    "gpulock",
    "gpulock.cli",
    "gpulock.cli.common",
    "gpulock.cli.pool",
    "gpulock.cli.run",
    "gpulock.cli.child",
    "gpulock.cli.broker",
    "gpulock.runtime.runtime",
    "gpulock._sync",
    "gpulock._async",
    "gpulock.protocol.request",
    "gpulock.protocol.args",
    "gpulock.protocol.replies",
    "gpulock.transport.translate",
    "gpulock.protocol.retry",
    "gpulock.protocol.lease",
    "gpulock.transport.connect",
    "gpulock.admin.pools",
    "gpulock.transport.batch",
    "gpulock.protocol.keys",
    "gpulock.transport.scripts",
    "gpulock.runtime.failure_log",
    "gpulock.errors",
    "gpulock.units",
    "gpulock.cuda",
    "gpulock.embedded",
]
OTHERS = ["gpulock_service", "gpulock_broker", "gpulock_client"]


def _loaded_after(modules: list[str], code: str = "") -> set[str]:
    """The top-level names in ``sys.modules`` of a fresh interpreter after importing
    ``modules`` (and running ``code``)."""
    script = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        f"{code}\n"
        "print(json.dumps(sorted({k.split('.')[0] for k in sys.modules})))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.splitlines()[-1]))


def _all_modules() -> list[str]:
    """Every module of the package, subpackages (gpulock.fastapi) and their modules included."""
    return ["gpulock"] + [
        m.name
        for m in pkgutil.walk_packages([str(PACKAGE_DIR)], prefix="gpulock.")
        if m.name != "gpulock.__main__"  # runs the CLI
    ]


def _path(module: str) -> Path:
    """The source file of a module of the package (a package's is its __init__.py)."""
    rel = PACKAGE_DIR.joinpath(*module.split(".")[1:])
    return rel / "__init__.py" if rel.is_dir() else rel.with_suffix(".py")


def test_core_imports_no_service_broker_sdk_or_fastapi():
    """Importing the core, building the CLI's app and rendering its help loads none of the
    service, the broker, the SDK or FastAPI."""
    loaded = _loaded_after(CORE, "import gpulock.cli as c; c.app.registered_commands")
    assert not loaded & {*OTHERS, "fastapi", "starlette"}, sorted(loaded & {*OTHERS, "fastapi"})


def test_no_gpulock_module_imports_the_service_broker_or_sdk():
    """Every module of the package, its HTTP layer (gpulock.fastapi) included."""
    loaded = _loaded_after(_all_modules())
    assert not loaded & set(OTHERS), sorted(loaded & set(OTHERS))


def test_broker_and_service_do_not_import_each_other():
    broker = [
        "gpulock_broker",
        "gpulock_broker.app",
        "gpulock_broker.api",
        "gpulock_broker.core",
        "gpulock_broker.auth",
        "gpulock_broker.models",
    ]
    loaded = _loaded_after(broker)
    assert "gpulock_service" not in loaded and "gpulock_client" not in loaded
    service = [
        "gpulock_service",
        "gpulock_service.app",
        "gpulock_service.cli",
        "gpulock_service.settings",
        "gpulock_service.gunicorn_conf",
    ]
    loaded = _loaded_after(service)
    assert "gpulock_broker" not in loaded and "gpulock_client" not in loaded


def _top_level_imports(module: str, path: Path) -> set[str]:
    """The gpulock modules ``module`` imports when it is imported: its module-level import
    statements, also inside top-level ``try``/``if`` (not ``if TYPE_CHECKING:``)."""
    is_package = path.name == "__init__.py"
    base = module if is_package else module.rpartition(".")[0]
    known = set(_all_modules())
    out: set[str] = set()

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = base.split(".")
        parts = parts[: len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    def visit(body: list[ast.stmt]) -> None:
        for st in body:
            if isinstance(st, ast.Import):
                out.update(a.name for a in st.names)
            elif isinstance(st, ast.ImportFrom):
                target = resolve(st)
                subs = {f"{target}.{a.name}" for a in st.names} & known
                out.update(subs)  # `from . import errors`: the submodule itself
                if len(subs) < len(st.names):  # a name of the module or package
                    out.add(target)
            elif isinstance(st, ast.If):
                test = ast.unparse(st.test)
                if "TYPE_CHECKING" not in test:
                    visit(st.body)
                visit(st.orelse)
            elif isinstance(st, ast.Try):
                visit(st.body)
                for h in st.handlers:
                    visit(h.body)
                visit(st.orelse)
                visit(st.finalbody)

    visit(ast.parse(path.read_text(), str(path)).body)
    edges = {m for m in out if m in known and m != module}
    # `from gpulock import X` where X is a name of the package (not a submodule) needs the
    # package's __init__ to have run: an edge to "gpulock" (kept above); a submodule's import of
    # its own parent package is otherwise implied by Python and is not an edge.
    return edges


def _graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for m in _all_modules():
        g[m] = _top_level_imports(m, _path(m))
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return found


def test_the_import_graph_is_read():
    """The checker sees the edges it should (else the cycle test below proves nothing)."""
    g = _graph()
    assert "gpulock.cli.common" in g["gpulock.cli"]
    assert "gpulock.errors" in g["gpulock.cli.broker"]  # `from . import errors as E`
    assert "gpulock._async" in g["gpulock"]
    assert "gpulock.fastapi._limiter" in g["gpulock.fastapi"]  # a subpackage is read too
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_among_gpulock_modules():
    assert _cycles(_graph()) == []
