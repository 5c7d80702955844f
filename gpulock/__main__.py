"""``python -m gpulock`` is the ``gpulock`` command."""

import sys

from .cli import main

sys.exit(main())
