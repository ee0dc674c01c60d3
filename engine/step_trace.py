"""One CSV line per engine step (`--step-trace FILE`): when it was launched and what it carried.

The counters (`kvserve_engine_steps_total`, tokens a step) give a load's averages. The same W-B load through the
server ran in 136 steps in one repetition and 255-265 in the next, and its decode took 2.4 to 6.0 ms a token
(docs/benchmarks.md, twenty-seventh session): averages cannot say which steps were small or slow. The trace
can: every step's rows, prefill rows, sampling rows, tokens, and the requests running and waiting behind it,
on the system-wide monotonic clock (so loads can be cut apart by their idle gaps). No torch. Off by default;
on, ~22 us a step at 256 rows on the 2-core development CPU (a loop over the rows and a line write), ~0.5% of
a 4 ms step.
"""
from __future__ import annotations

import time

HEADER = "t_s,rows,prefill_rows,sampling_rows,tokens,running,waiting"


class StepTrace:
    """Appends to `path` (line-buffered: a killed core keeps every step it wrote)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)
        self._file.write(HEADER + "\n")

    def record(self, sched_out, num_running: int, num_waiting: int) -> None:
        scheduled = sched_out.scheduled
        prefills = sampling = 0
        for sr in scheduled:
            prefills += sr.num_new_tokens > 1
            sampling += sr.samples
        self._file.write(f"{time.monotonic():.6f},{len(scheduled)},{prefills},{sampling},"
                         f"{sched_out.num_batched_tokens},{num_running},{num_waiting}\n")


def read_trace(path: str) -> list[dict[str, float]]:
    """The lines of a trace as dicts (a repeated header, from a second engine on the same file, is skipped)."""
    names, rows = HEADER.split(","), []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and line != HEADER:
                rows.append({name: float(v) for name, v in zip(names, line.split(","))})
    return rows
