"""A test model for serve's start: the sleep model whose ``load`` lets the first worker through
and holds every other one until a file exists, so a test sees the service while one worker is
ready and another is still loading.

``GPULOCK_MODEL=gated_model:factory`` with this folder on ``PYTHONPATH``; ``GPULOCK_TEST_GATE``
names a folder: the first worker to load makes ``DIR/first`` (atomically) and goes on; the
others wait until ``DIR/open`` exists (at most 60 s)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from gpulock_service.models import SleepModel


class GatedModel(SleepModel):
    def load(self, device: str) -> None:
        super().load(device)
        gate = Path(os.environ["GPULOCK_TEST_GATE"])
        try:
            (gate / "first").mkdir()
        except FileExistsError:
            deadline = time.monotonic() + 60
            while not (gate / "open").exists() and time.monotonic() < deadline:
                time.sleep(0.02)


def factory(settings):
    return GatedModel(settings.sleep_seconds, settings.sleep_bytes)
