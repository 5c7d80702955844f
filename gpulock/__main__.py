"""``python -m gpulock`` is the ``gpulock`` command."""

import sys

from gpulock.cli import main

sys.exit(main())
