"""`pip install` of the built wheels (not the editable checkout) gives a working gpulock: the
Lua scripts ship inside the wheel, the gpulock-common wheel it depends on installs beside it,
and an acquire/release runs from a fresh venv."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPS = ("redis", "tenacity", "typer", "rich")
OPS = ("lib", "acquire", "release", "renew", "cancel", "reap", "status", "configure")


def _run(cmd, **kw):
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    assert r.returncode == 0, (
        f"{cmd} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    )
    return r


def _build_wheel(src: Path, dist: Path, pattern: str) -> Path:
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(src)], timeout=180)
    (wheel,) = dist.glob(pattern)
    return wheel


@pytest.mark.timeout(240)
def test_wheel_installs_and_works(tmp_path, redis_proc1):
    dist = tmp_path / "dist"
    wheel = _build_wheel(ROOT, dist, "gpulock-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for op in OPS:
        assert f"gpulock/lua/{op}.lua" in names, sorted(names)
    assert not any(n.startswith("tests/") for n in names)
    # the dashboard's page ships in the package (no CDN, no build step)
    for f in ("index.html", "dashboard.js", "dashboard.css"):
        assert f"gpulock/dashboard/static/{f}" in names, sorted(names)
    # gpulock depends on gpulock-common (clients/common), which is installed from its wheel too.
    common_wheel = _build_wheel(ROOT / "clients/common", dist, "gpulock_common-*.whl")
    common_names = set(zipfile.ZipFile(common_wheel).namelist())
    for mod in ("__init__", "errors", "lease", "units"):
        assert f"gpulock_common/{mod}.py" in common_names, sorted(common_names)
    # The lease broker is its own package in the wheel, next to the service (not inside it).
    for mod in ("__init__", "__main__", "api", "app", "auth", "core", "models"):
        assert f"gpulock_broker/{mod}.py" in names, sorted(names)
    assert not any(n.startswith("gpulock_service/broker/") for n in names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=120)  # no system site packages
    py = venv / "bin" / "python"
    _run(
        [str(py), "-m", "pip", "install", "-q", str(wheel), str(common_wheel), *DEPS],
        timeout=180,
    )

    script = textwrap.dedent(f"""
        import asyncio, pathlib, sys
        import gpulock, gpulock.errors, gpulock_common.errors
        from gpulock import Pool, AsyncPool
        from gpulock.transport.scripts import _lua_dir
        assert "site-packages" in gpulock.__file__, gpulock.__file__
        assert "site-packages" in gpulock_common.__file__, gpulock_common.__file__
        assert gpulock.errors.LeaseLost is gpulock_common.errors.LeaseLost
        assert "site-packages" in str(_lua_dir()), _lua_dir()
        from gpulock.dashboard.routes import static_text
        assert "dashboard/data" in static_text("dashboard.js")
        pool = Pool.from_url({redis_proc1.url!r}, "wheel", capacity="2GiB")
        with pool.lease("1GiB", ttl=5) as lease:
            assert pool.status().used == 1 << 30
            first = lease.token
        assert pool.status().used == 0
        pool.close()

        async def main():
            async with AsyncPool.from_url({redis_proc1.url!r}, "wheel", capacity="2GiB") as ap:
                async with ap.lease("2GiB", timeout=1) as l2:
                    assert l2.token > first
                assert (await ap.status()).used == 0
        asyncio.run(main())
        print("OK", gpulock.__version__)
    """)
    r = _run([str(py), "-c", script], cwd=str(tmp_path), timeout=60)
    assert "OK" in r.stdout
    # The console script is installed and starts; serve and broker, the gpulock.cli entry
    # points of the service and the broker, are its commands.
    _run([str(venv / "bin" / "gpulock"), "--help"], cwd=str(tmp_path), timeout=60)
    for command in ("serve", "broker"):
        r = _run([str(venv / "bin" / "gpulock"), command, "--help"], cwd=str(tmp_path), timeout=60)
        assert f"Usage: gpulock {command}" in r.stdout, r.stdout
