"""``gpulock.device_truth``, kept for code that imports it by this name: the module is
:mod:`gpulock.devices.truth` (moved there with the other device readers)."""

from gpulock.devices.truth import *  # noqa: F403
from gpulock.devices.truth import __all__ as __all__
