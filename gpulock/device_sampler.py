"""``gpulock.device_sampler``, kept for code that imports it by this name: the module is
:mod:`gpulock.devices.sampler` (moved there with the other device readers)."""

from gpulock.devices.sampler import *  # noqa: F403
from gpulock.devices.sampler import __all__ as __all__
