"""What a process that uses the core loads: importing the core and building the CLI loads
neither the demo service (``gpulock_service``), the lease broker (``gpulock_broker``), the SDK
(``gpulock_client``) nor FastAPI.

The static rules (the layers, no cycles, the service, broker and SDK apart) are import-linter's
contracts in pyproject.toml, checked by ``lint-imports`` in ``.ci/run``. This test checks what
they cannot: modules loaded at run time, lazy imports included, in a fresh interpreter
(``sys.modules`` of the test process already holds everything).
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import gpulock

PACKAGE_DIR = Path(gpulock.__file__).parent

# The HTTP layer: gpulock.fastapi and the pieces it shares with the broker and the dashboard.
HTTP_LAYER = ("gpulock.fastapi", "gpulock.http", "gpulock.dashboard")
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


def _core_modules() -> list[str]:
    """Every module of the package outside its HTTP layer, the CLI's included: what a process
    that leases from Redis, or runs the `gpulock` CLI, may load."""
    return ["gpulock"] + [
        m.name
        for m in pkgutil.walk_packages([str(PACKAGE_DIR)], prefix="gpulock.")
        if m.name != "gpulock.__main__"  # runs the CLI
        and not m.name.startswith(HTTP_LAYER)
    ]


def test_core_imports_no_service_broker_sdk_or_fastapi():
    """Importing the core, building the CLI's app and rendering its help loads none of the
    service, the broker, the SDK or FastAPI."""
    loaded = _loaded_after(_core_modules(), "import gpulock.cli as c; c.app.registered_commands")
    assert not loaded & {*OTHERS, "fastapi", "starlette"}, sorted(loaded & {*OTHERS, "fastapi"})
