"""A test model for the disconnect tests: the sleep model plus two commands, so a test can see
whether a request's work ran and hold it running for as long as it needs:

* ``"flag:PATH"`` creates PATH when the work starts (the work ran);
* ``"wait:PATH"`` blocks until PATH exists (at most 60 s), then returns.

``GPULOCK_MODEL=flag_model:factory`` with this folder on ``PYTHONPATH``."""

from __future__ import annotations

import os
import time

from gpulock_service.models import SleepModel


class FlagModel(SleepModel):
    def embed(self, texts: list[str]) -> list[list[float]]:
        for t in texts:
            if t.startswith("flag:"):
                with open(t[5:], "w"):
                    pass
        for t in texts:
            if t.startswith("wait:"):
                deadline = time.monotonic() + 60
                while not os.path.exists(t[5:]) and time.monotonic() < deadline:
                    time.sleep(0.01)
        return [[float(len(t))] * self.dimensions for t in texts]


def factory(settings):
    return FlagModel(settings.sleep_seconds, settings.sleep_bytes)
