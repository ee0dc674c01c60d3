"""The engine's two clocks: the host's sections (engine/step_clock.py) and the device's parts
(engine/device_clock.py), the latter with stand-in events (CI has no CUDA)."""
from __future__ import annotations

import time

import pytest

from engine.device_clock import DeviceClock
from engine.step_clock import DEVICE_PARTS as PARTS
from engine.step_clock import SECTIONS, StepClock


class FakeEvent:
    """A CUDA event at time `ms` on the device's clock, happened or not yet."""

    def __init__(self, ms: float, happened: bool = True) -> None:
        self.ms, self.happened = ms, happened

    def query(self) -> bool:
        return self.happened

    def elapsed_time(self, later: "FakeEvent") -> float:
        assert self.happened and later.happened, "CUDA refuses the elapsed time of an event still pending"
        return later.ms - self.ms


def test_laps_cover_the_step_with_no_gaps():
    clock = StepClock()
    clock.start()
    begun = time.perf_counter()
    for section in ("schedule", "prepare", "forward"):
        time.sleep(0.002)
        clock.lap(section)
    elapsed = time.perf_counter() - begun
    assert sum(clock.totals()) == pytest.approx(elapsed, abs=0.001)
    assert all(clock.seconds[s] >= 0.002 for s in ("schedule", "prepare", "forward"))
    assert list(clock.seconds) == list(SECTIONS) and clock.seconds["collect"] == 0


def test_device_parts_add_up_to_the_wall_time_and_wait_for_pending_events():
    clock = DeviceClock(on_cuda=True)
    E = FakeEvent
    # step 1: unconstrained (sampled right behind its forward); step 2: samples nothing (a prompt chunk);
    # step 3: constrained, its sampling 1.5 ms after its logits; step 4: launched 0.5 ms late, still running.
    clock.launched([E(0.0), E(3.0), E(3.0), E(3.5)])
    clock.launched([E(3.5), E(10.0), None, None])
    clock.launched([E(10.0), E(13.0), E(14.5), E(15.0)])
    clock.settle()
    last = [E(15.5), E(18.0), E(18.0), E(18.4, happened=False)]
    clock.launched(last)
    clock.settle()
    assert clock.seconds == pytest.approx({"launch gap": 0.0, "forward": 0.0125, "masks gap": 0.0015,
                                           "sample": 0.001})
    assert sum(clock.totals()) == pytest.approx(0.015)  # the first three steps' wall time, gap for gap
    last[3].happened = True
    clock.settle()
    assert clock.seconds["launch gap"] == pytest.approx(0.0005) and sum(clock.totals()) == pytest.approx(0.0184)
    assert list(clock.seconds) == list(PARTS)
    clock.idle()  # then a step 1 s later: the device waited for requests, not for the host
    clock.launched([E(1018.4), E(1020.0), E(1020.0), E(1020.5)])
    clock.settle()
    assert clock.seconds["launch gap"] == pytest.approx(0.0005) and sum(clock.totals()) == pytest.approx(0.0205)


def test_off_cuda_the_device_clock_records_nothing():
    clock = DeviceClock(on_cuda=False)
    assert clock.mark() is None
    clock.launched([None, None, None, None])
    clock.settle()
    assert clock.totals() == [0.0] * len(PARTS)
