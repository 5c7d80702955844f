"""The HTTP lease API ("the broker"): lets hosts that should not talk to Redis, programs
outside the service and other languages lease GPU memory from gpulock pools over HTTP.

* :data:`router` — the FastAPI router (``/v1``); mount it with ``app.include_router(router)``
  and put a started :class:`Broker` in ``app.state.gpulock_broker`` (see :mod:`.api`).
* :func:`create_broker_app` — a stand-alone app (what ``gpulock broker`` serves).
* :func:`register_broker` — adds the ``broker`` command to a Typer app.

The Python client is the separate ``gpulock-client`` distribution (``clients/python``).
"""

from .app import create_broker_app, register_broker, run_broker
from .auth import Principal, TokenConfigError, load_tokens, parse_tokens


def __getattr__(name: str):
    # FastAPI and redis load only when the router or the engine is asked for, so that
    # `gpulock --help` and `gpulock run` stay quick and work without the service extras.
    if name == "router":
        from .api import router

        return router
    if name == "Broker":
        from .core import Broker

        return Broker
    raise AttributeError(name)


__all__ = [
    "Broker",
    "Principal",
    "TokenConfigError",
    "create_broker_app",
    "load_tokens",
    "parse_tokens",
    "register_broker",
    "router",
    "run_broker",
]
