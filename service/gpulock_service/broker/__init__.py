"""The HTTP lease API ("the broker"): lets hosts that should not talk to Redis, programs
outside the service and other languages lease GPU memory from gpulock pools over HTTP.

* :data:`router` — the FastAPI router (``/v1``); mount it with ``app.include_router(router)``
  and put a started :class:`Broker` in ``app.state.gpulock_broker`` (see :mod:`.api`).
* :func:`create_broker_app` — a stand-alone app (what ``gpulock broker`` serves).
* :func:`register_broker` — adds the ``broker`` command to a Typer app.

The Python client is the separate ``gpulock-client`` distribution (``clients/python``).
"""

from .api import router
from .app import create_broker_app, register_broker, run_broker
from .auth import Principal, TokenConfigError, load_tokens, parse_tokens
from .core import Broker

__all__ = ["Broker", "Principal", "TokenConfigError", "create_broker_app", "load_tokens", "parse_tokens",
           "register_broker", "router", "run_broker"]
