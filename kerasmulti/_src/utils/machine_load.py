"""How much CPU other processes took while something was timed (Linux only).

Throughput on a small machine is only as good as the machine is quiet. The
demo and the benchmarks read /proc/stat (all processes) before and after the
timed runs and subtract this process's own CPU time, and say how busy the
machine was beside the figures.
"""

from __future__ import annotations

import os
import time


class LoadMeter:
    """Started at construction; `others()` and `report()` cover the time since."""

    def __init__(self):
        self._start = (time.perf_counter(), self._machine_busy(), self._own())

    @staticmethod
    def _machine_busy() -> float | None:
        try:
            with open("/proc/stat") as stat:
                fields = [int(v) for v in stat.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        times = os.times()
        return times.user + times.system

    def _elapsed(self):
        wall0, busy0, own0 = self._start
        busy1 = self._machine_busy()
        if busy0 is None or busy1 is None:
            return None
        wall = time.perf_counter() - wall0
        own = self._own() - own0
        return wall, max(0.0, (busy1 - busy0) - own) / wall, own / wall

    def others(self) -> float | None:
        """Cores that other processes kept busy on average, or None where unknown."""
        elapsed = self._elapsed()
        return None if elapsed is None else elapsed[1]

    def report(self) -> str:
        elapsed = self._elapsed()
        if elapsed is None:
            return "  (CPU load of other processes: unknown on this platform)"
        wall, others, mine = elapsed
        return (
            f"  timed runs: {wall:.0f} s; this process used {mine:.2f} cores, "
            f"other processes {others:.2f} of {os.cpu_count()} cores"
        )
