"""``ready_workers`` reads the multiprocess directory while workers start: a file a worker has
created but not yet sized must read as "not ready yet", not raise (serve's ready thread polls it
and died on the raise, so serve never said ready)."""

from __future__ import annotations

import os
from pathlib import Path

from gpulock.fastapi._metrics import ready_workers


def test_an_empty_live_file_of_a_starting_worker_reads_as_none_ready(tmp_path: Path) -> None:
    (tmp_path / f"gauge_livesum_{os.getpid()}.db").write_bytes(b"")
    assert ready_workers(str(tmp_path)) == 0


def test_a_directory_that_is_not_there_reads_as_none_ready(tmp_path: Path) -> None:
    assert ready_workers(str(tmp_path / "absent")) == 0
