"""A bounded schemathesis run against a live server, as a shell runs it: the ``schemathesis``
command line (this interpreter's), every check (``--checks all``), every phase (examples,
coverage, fuzzing, stateful), positive and negative data, one worker, a fixed seed and no
example database (the same cases each run). Only the ``too_slow`` health check (how fast data
is generated, not what the server answers) is suppressed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[1] / "schemathesis"
PHASES = ("Examples", "Coverage", "Fuzzing", "Stateful")


@dataclass
class Run:
    returncode: int
    output: str

    @property
    def generated(self) -> int:
        """Test cases generated (``N generated`` of the summary), 0 if there is none."""
        m = re.search(r"(\d+) generated", self.output)
        return int(m.group(1)) if m else 0

    @property
    def links_covered(self) -> int:
        """OpenAPI links the stateful phase followed (``API Links: N covered``), 0 if none."""
        m = re.search(r"API Links:\s+(\d+) covered", self.output)
        return int(m.group(1)) if m else 0

    def phases_passed(self) -> list[str]:
        """The phases the summary marks as passed."""
        summary = self.output.rsplit("Test Phases:", 1)[-1]
        return [p for p in PHASES if re.search(rf"✅ {p}\b", summary)]


def run_schemathesis(
    schema_url: str,
    config: str,
    *,
    headers: dict[str, str] | None = None,
    max_examples: int = 30,
    seed: int = 14,
    timeout: float = 240,
) -> Run:
    """Run ``schemathesis --config-file tests/schemathesis/CONFIG.toml run SCHEMA_URL`` (with
    ``SCHEMATHESIS_HOOKS=tests/schemathesis/CONFIG_hooks.py`` where there is one); the
    output is returned whole (it names each failure with a curl command to reproduce it). It
    runs in a temporary folder: schemathesis writes a cache (``.schemathesis/``) where it runs.

    Raises subprocess.TimeoutExpired after ``timeout`` seconds."""
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(CONFIG_DIR / f"{config}.toml"),
        "run",
        schema_url,
        "--checks",
        "all",
        "--phases",
        "examples,coverage,fuzzing,stateful",
        "--mode",
        "all",
        "--max-examples",
        str(max_examples),
        "--seed",
        str(seed),
        "--generation-database",
        "none",
        "--workers",
        "1",
        "--suppress-health-check",
        "too_slow",
        "--request-timeout",
        "60",
        "--no-color",
    ]
    for k, v in (headers or {}).items():
        cmd += ["-H", f"{k}: {v}"]
    env = dict(os.environ)
    hooks = CONFIG_DIR / f"{config}_hooks.py"
    if hooks.exists():  # the surface's own checks, beside schemathesis' (run with them)
        env["SCHEMATHESIS_HOOKS"] = str(hooks)
    with tempfile.TemporaryDirectory() as cwd:  # where schemathesis writes its cache
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    return Run(p.returncode, p.stdout + p.stderr)
