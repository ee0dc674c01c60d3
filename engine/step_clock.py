"""Where the engine thread's time goes, by section of its steps, summed since start (the server's
`kvserve_engine_section_seconds_total{section=...}`).

A lap clock: each lap() gives the time since the previous one (or since start()) to one section, so the
sections of a step add up to its busy time with no gaps. The engine core adds the time between two busy steps
(taking requests in, sending outputs) as "core loop". Through the real server this places a slowdown that
offline profiles miss: W-B at json 100% ran ~1.5x longer steps than json 0% through the server (tenth session)
while the offline structured_step.py steps took the same time. Cost: two perf_counter() calls and a dict
update per lap, ~10 laps a step (~2 us against steps of 3-8 ms).
"""
from __future__ import annotations

from time import perf_counter

# In a step's order. "admit": requests whose grammar compiled join the scheduler (with nothing else to run,
# the wait for a compile is counted here); "prepare": inputs and their staging; "forward": queueing the forward
# (the CUDA graph's uploads and replay; an eager forward runs here); "logits": queueing the logits; "mask wait":
# waiting for a constrained step's grammar masks (the structured_mask_wait_seconds counter); "sample": queueing
# the masks' application and the sampling; "collect": waiting for the device's tokens and reading them;
# "update": the scheduler's bookkeeping of them, the matchers' tokens, the next masks started; "outputs":
# detokenizing and building the step's outputs. The runner laps its own sections on the engine's clock.
SECTIONS = ("admit", "schedule", "prepare", "forward", "logits", "mask wait", "sample", "collect", "update",
            "outputs", "core loop")
# The device's parts of a step (engine/device_clock.py), named here, without torch, for the front ends' /metrics.
DEVICE_PARTS = ("launch gap", "forward", "masks gap", "sample")


class StepClock:
    """Seconds per section (SECTIONS' order in `seconds`)."""
    __slots__ = ("seconds", "_last")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(SECTIONS, 0.0)
        self._last = perf_counter()

    def start(self) -> None:
        """A step begins: laps count from now."""
        self._last = perf_counter()

    def lap(self, section: str) -> None:
        """The time since the last lap (or start) goes to `section`."""
        now = perf_counter()
        self.seconds[section] += now - self._last
        self._last = now

    def add(self, section: str, seconds: float) -> None:
        self.seconds[section] += seconds

    def totals(self) -> list[float]:
        """The sums in SECTIONS' order (CoreStats carries them so)."""
        return list(self.seconds.values())
