"""The ``gpulock`` command line: configure pools, show their status, and run any command under
a lease (``flock(1)`` for GPU memory).

Every command reads the Redis URL from ``--redis-url`` or ``GPULOCK_REDIS_URL``, or goes through
an HTTP broker named by ``--broker-url``/``GPULOCK_BROKER_URL`` where it can (``status``,
``pool set``, ``pool list``, ``pool delete``, ``run``) and refuses with a usage error where it
cannot (``serve``, ``broker``, ``loadtest``); none falls back to a backend the user did not
name. gpulock's own messages go to stderr; stdout carries only data (``status``, ``pool ...``)
or, for ``gpulock run``, only CMD's output.

The commands live in ``cli.pool`` (status, pools), ``cli.top`` (top) and ``cli.run``
(run, with ``cli.child``: CMD's process under the lease); what they share
(exit codes, messages, the backend) in ``cli.common``. ``serve``, ``loadtest`` and ``broker``
belong to other packages (the demo service, the lease broker), which declare them as
``gpulock.cli`` entry points; :func:`main` adds them, importing this module does not.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Iterable, Optional

import typer

from gpulock import __version__
from gpulock.cli.common import (
    DEFAULT_REDIS_URL,
    EXIT_CAPACITY,
    EXIT_CODES_HELP,
    EXIT_ERROR,
    EXIT_LEASE_LOST,
    EXIT_NO_POOL,
    EXIT_NOPERM,
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    EXIT_OVERUSE,
    EXIT_TEMPFAIL,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    Target,
    check_broker_url,
    check_redis_url,
    fail,
)
from gpulock.cli.pool import pool_app, status
from gpulock.cli.run import RUN_HELP, run
from gpulock.cli.sample import sample
from gpulock.cli.top import top

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = [
    "app",
    "main",
    "EXIT_CAPACITY",
    "EXIT_ERROR",
    "EXIT_LEASE_LOST",
    "EXIT_NO_POOL",
    "EXIT_NOPERM",
    "EXIT_NOT_EXECUTABLE",
    "EXIT_NOT_FOUND",
    "EXIT_OVERUSE",
    "EXIT_TEMPFAIL",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
]

app = typer.Typer(
    name="gpulock",
    help="Share GPU memory between processes and hosts through leases kept in Redis.",
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,  # plain click help and errors: stable text for scripts and tests
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(pool_app, name="pool")
app.command("status")(status)
app.command("top")(top)
app.command("sample")(sample)
app.command(
    "run",
    help=RUN_HELP,
    context_settings={"allow_interspersed_args": False},
    no_args_is_help=True,
    options_metavar="[OPTIONS] --",
)(run)

# Commands that never use a broker: they refuse --broker-url given on the command line (one
# set only in the environment, for the clients of this host, is ignored by them, except by
# serve, which refuses it too unless --redis-url is on its command line: without one it would
# start its own embedded Valkey, a pool apart from the broker's).
_NOT_THROUGH_BROKER = {
    "serve": "serve runs the service on Redis (--redis-url, or its embedded Valkey)",
    "broker": "broker is the broker; it talks to Redis (--redis-url)",
    "loadtest": "loadtest takes the service's URL as its argument",
    "sample": "sample publishes device reports to Redis (--redis-url)",
}


def _version(value: bool) -> None:
    if value:
        print(f"gpulock {__version__}")
        raise typer.Exit(0)


def _given(ctx: typer.Context, param: str) -> bool:
    return getattr(ctx.get_parameter_source(param), "name", None) == "COMMANDLINE"


@app.callback(
    help="Share GPU memory between processes and hosts through leases kept in Redis.\n\n"
    + EXIT_CODES_HELP
)
def _main(
    ctx: typer.Context,
    redis_url: str = typer.Option(
        DEFAULT_REDIS_URL,
        "--redis-url",
        envvar="GPULOCK_REDIS_URL",
        show_default=True,
        help="Redis holding the pools (redis://, rediss://, unix://, redis+sentinel://HOST:PORT,.../SERVICE or redis+cluster://HOST:PORT,...).",
    ),
    broker_url: Optional[str] = typer.Option(
        None,
        "--broker-url",
        envvar="GPULOCK_BROKER_URL",
        help="Go through this HTTP broker instead of Redis (status, pool set/list/delete, run; bearer "
        "token from GPULOCK_TOKEN; needs the gpulock-client package). It wins over "
        "GPULOCK_REDIS_URL; --redis-url on the command line wins over GPULOCK_BROKER_URL; both "
        "options on one command line are an error.",
    ),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    redis_given, broker_given = _given(ctx, "redis_url"), _given(ctx, "broker_url")
    sub = ctx.invoked_subcommand or ""
    if redis_given and broker_given:
        fail(EXIT_USAGE, "give --redis-url or --broker-url, not both")
    if broker_given and sub in _NOT_THROUGH_BROKER:
        fail(
            EXIT_USAGE, f"--broker-url does not apply to gpulock {sub}: {_NOT_THROUGH_BROKER[sub]}"
        )
    if broker_url and not redis_given and sub not in _NOT_THROUGH_BROKER:
        t = Target("broker", broker_url)
    else:
        t = Target("redis", redis_url)
    ctx.obj = {
        "target": t,
        "redis_url": redis_url,
        "broker_url": broker_url if t.is_broker else None,
    }
    if redis_given:
        if sub == "broker":
            check_redis_url(redis_url)
        # `gpulock --redis-url URL serve|broker ...`: the subcommands read GPULOCK_REDIS_URL.
        os.environ["GPULOCK_REDIS_URL"] = redis_url
    if broker_given:
        check_broker_url(broker_url or "")


#: The entry-point group of the subcommands other packages add (``serve`` and ``loadtest`` from
#: gpulock_service, ``broker`` from gpulock_broker; see pyproject.toml): each entry point names
#: a function that takes :data:`app` and adds its commands.
ENTRY_POINT_GROUP = "gpulock.cli"

_extras_registered = False


def _extra_entry_points() -> Iterable[EntryPoint]:
    """The installed ``gpulock.cli`` entry points (from the packages' metadata; none when
    gpulock is used from a source tree that was never installed)."""
    from importlib.metadata import entry_points

    return entry_points(group=ENTRY_POINT_GROUP)


def _register_extras() -> None:
    """Add the subcommands of every ``gpulock.cli`` entry point to :data:`app`, in the order
    of the entry points' names. One whose module cannot be imported (its package or its
    dependencies missing) is left out: the other commands work without it."""
    for ep in sorted(_extra_entry_points(), key=lambda ep: ep.name):
        try:
            register = ep.load()
        except ImportError:
            continue
        register(app)


def main(argv: Optional[list[str]] = None) -> int:
    """Console-script entry point: adds the entry points' subcommands (once per process), then
    runs :data:`app` on ``argv`` (default: ``sys.argv[1:]``) and returns its exit status."""
    global _extras_registered
    if not _extras_registered:
        _extras_registered = True
        _register_extras()
    try:
        app(args=argv, prog_name="gpulock", standalone_mode=True)
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0
