"""Where the device's time goes, step by step, from CUDA events (the server's
`kvserve_engine_device_seconds_total{part=...}`).

Each launched step records an event before its forward, after its logits, before its sampling and after it
(`marks`, in stream order). Once they have happened the gaps between them say what the device did:

- "launch gap": idle after the previous step's last event until this forward began (the host was late to
  queue it: with async scheduling, near 0 when the device is the bottleneck); not counted after the engine
  went idle;
- "forward": the forward and the logits;
- "masks gap": idle after the logits until the sampling began: a constrained step waits there for its grammar
  masks (0 for unconstrained steps, whose sampling is queued with the forward);
- "sample": the masks' copy and application, the sampling, the tokens' copy to the host.

Their sum is the device's wall time over the load; through the server it tells whether the device or the host
sets the pace, which the host's own sections (engine/step_clock.py) cannot. Read in collect(), after the
step's tokens were waited for, so reading never waits. Cost: 3 or 4 events a step, ~10 us of host time.
"""
from __future__ import annotations

from collections import deque

import torch

from engine.step_clock import DEVICE_PARTS


class DeviceClock:
    """Seconds per DEVICE_PARTS, summed over the steps whose events have happened. Off (every call a no-op) without
    CUDA."""

    def __init__(self, on_cuda: bool) -> None:
        self.on_cuda = on_cuda
        self.seconds = dict.fromkeys(DEVICE_PARTS, 0.0)
        self._steps: deque[list] = deque()  # marks of steps launched, not yet counted, in launch order
        self._last_end: torch.cuda.Event | None = None

    def mark(self) -> torch.cuda.Event | None:
        """An event recorded now on the current stream (None off CUDA)."""
        if not self.on_cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def launched(self, marks: list) -> None:
        """A step's marks, all queued: [before forward, after logits, before sampling, after sampling], the last
        two None for a step that samples nothing. Steps come in stream order: a constrained step is given once
        sampled, and the next step is queued only after that."""
        if self.on_cuda:
            self._steps.append(marks)

    def settle(self) -> None:
        """Count every step, oldest first, whose last event has happened."""
        while self._steps:
            start, forward_end, sample_start, end = self._steps[0]
            if not (end or forward_end).query():
                return
            self._steps.popleft()
            self._count(start, forward_end, sample_start, end)

    def idle(self) -> None:
        """The engine has nothing left to run: the next step's launch gap is not counted (the device waited for
        requests, not for the host)."""
        self.settle()
        self._last_end = None

    def _count(self, start, forward_end, sample_start, end) -> None:
        seconds = self.seconds
        if self._last_end is not None:
            seconds["launch gap"] += self._last_end.elapsed_time(start) / 1e3
        seconds["forward"] += start.elapsed_time(forward_end) / 1e3
        if sample_start is not None:
            seconds["masks gap"] += forward_end.elapsed_time(sample_start) / 1e3
            seconds["sample"] += sample_start.elapsed_time(end) / 1e3
        self._last_end = end if end is not None else forward_end

    def totals(self) -> list[float]:
        return list(self.seconds.values())
