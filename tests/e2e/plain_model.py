"""A test model for fuzzing the service: the sleep model's sizes and token ids, without its
commands (``"sleep:N"``, ``"oom"``, ``"error"``, ...), so that no generated text makes it sleep
or fail: every input embeds at once. ``GPULOCK_MODEL=plain_model:factory`` with this folder on
``PYTHONPATH``."""

from __future__ import annotations

from gpulock_service.models import SleepModel


class PlainModel(SleepModel):
    name = "plain"

    def embed(self, texts: list[str]) -> list[list[float]]:
        return [[float(len(t))] * self.dimensions for t in texts]


def factory(settings):
    return PlainModel(0.0, settings.sleep_bytes)
