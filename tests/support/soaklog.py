"""The event logs the soak worker (tests/faults/clients/_soak_worker.py) writes, read back: one
line per event (its docstring lists them)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable


@dataclass
class SoakLog:
    """What the logs say, across files: ``uses[token]`` the server times (µs) at which the
    token's lease surely held ``amounts[token]`` bytes; ``grants`` the tokens granted; counts
    of leases lost, BackendUnavailable tolerated, faults injected by kind; ``quits``
    (pending, closed) per crowd that closed; ``errors`` (file name, line)."""

    uses: dict[int, list[int]] = field(default_factory=lambda: collections.defaultdict(list))
    amounts: dict[int, int] = field(default_factory=dict)
    grants: list[int] = field(default_factory=list)
    lost: int = 0
    backend: int = 0
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    quits: list[tuple[int, int]] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)

    def intervals(self) -> list[tuple[int, int, int]]:
        """(first use, last use + 1 µs, amount) per token: the input of
        :func:`support.history.max_concurrent`."""
        return [(min(ts), max(ts) + 1, self.amounts[t]) for t, ts in self.uses.items()]


def read_logs(files: Iterable[Path]) -> SoakLog:
    out = SoakLog()
    for f in files:
        for line in f.read_text().splitlines():
            p = line.split(" ", 3)
            if p[0] == "G":
                out.grants.append(int(p[1]))
                out.amounts[int(p[1])] = int(p[2])
            elif p[0] == "U":
                out.uses[int(p[1])].append(int(p[3]))
                out.amounts[int(p[1])] = int(p[2])
            elif p[0] == "L":
                out.lost += 1
            elif p[0] == "B":
                out.backend += 1
            elif p[0] == "F":
                out.faults[p[1]] += 1
            elif p[0] == "Q":
                out.quits.append((int(p[1]), int(p[2])))
            elif p[0] == "E":
                out.errors.append((f.name, line))
    return out
