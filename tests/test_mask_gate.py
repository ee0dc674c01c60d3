"""The device's wait for grammar masks (engine/mask_gate.py) against its rule (`reached`): through Triton's
interpreter on the CPU, compiled on CUDA with flags in page-locked host memory raised by the host later."""
from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch

from engine import mask_gate
from interpreted import run_interpreted

INTERPRETED = """
import threading, time, torch
from engine import mask_gate
flags = torch.tensor([4, 9, 2, 4], dtype=torch.int64)
assert mask_gate.reached(flags, 4, 2) and not mask_gate.reached(flags, 4, 4) and mask_gate.reached(flags, 2, 4)
start = time.monotonic()
mask_gate.wait(flags, 2, 4)  # the first two flags are there: no wait
assert time.monotonic() - start < 5
def later():
    time.sleep(0.5)
    flags[2] = 7
threading.Thread(target=later).start()
start = time.monotonic()
mask_gate.wait(flags, 4, 4)  # waits for the third flag, raised by another thread
waited = time.monotonic() - start
assert waited >= 0.45 and mask_gate.reached(flags, 4, 4), waited
rows = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 5000), dtype=torch.int32)
out = torch.zeros(3, 5000, dtype=torch.int32)
mask_gate.copy_rows(out[:2], rows[:2])  # 10,000 words: three programs, the last one partly masked
assert torch.equal(out[:2], rows[:2]) and not out[2].any()
print("waited")
"""


@pytest.mark.skipif(not mask_gate.available(), reason="triton is not installed")
def test_the_wait_returns_once_every_flag_reached_the_step_and_the_copy_kernel_copies_through_tritons_interpreter():
    done = run_interpreted(INTERPRETED, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "waited", done.stderr[-2000:]


def page_locked_flags_and_masks(rows: int, words: int):
    """The grammar link's layout: masks then flags in one shared file, page-locked as GrammarLink does."""
    from engine.grammar_link import _pin
    from engine.grammar_worker import mask_buffers, mask_file_words

    f = tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    nbytes = mask_file_words(rows, words) * 4
    os.ftruncate(f.fileno(), nbytes)
    masks, flags = mask_buffers(f.fileno(), rows, words)
    assert _pin(masks, nbytes)
    return f, masks, flags


def finished_within(event: torch.cuda.Event, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if event.query():
            return True
        time.sleep(0.001)
    return False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("how,copy", [(h, c) for h in mask_gate.MaskGate.WAITS for c in mask_gate.MaskGate.COPIES])
def test_on_cuda_the_copy_waits_for_the_flags_the_host_raises(how, copy):
    """The side stream waits while a flag is below the step's number (the main stream's sampling with it), and
    copies the rows the host wrote once the last flag is raised; the device's rows then equal the host's. For
    each wait and each copy: the check passes (it cannot hang: a watchdog raises the flags)."""
    if how == "cuStreamWaitValue64":
        pytest.importorskip("cuda.bindings")
    f, masks, flags = page_locked_flags_and_masks(8, 4099)
    device = torch.device("cuda")
    # Loaded now: a kernel's first launch (lazy module loading) behind the unmet wait would wait for it, and so
    # would the host, which raises the flags (this test hung so on an H100: engine/runner.py _load_gated_kernels).
    torch.ones(5, 4099, dtype=torch.int32, device=device).sum(dtype=torch.int64).item()
    gate = mask_gate.MaskGate(masks, flags, 2, device, how, copy)
    try:
        why = gate.check()
        assert why is None, why
        masks[1, :5] = torch.randint(-2 ** 31, 2 ** 31 - 1, (5, 4099), dtype=torch.int32)
        flags[0] = 3
        out = gate.copy_when_filled(1, 5, 3)
        total = out.sum(dtype=torch.int64)  # queued behind the copy on the main stream
        done = torch.cuda.Event()
        done.record()
        assert not finished_within(done, 0.2)  # the second flag is still 0
        flags[1] = 3
        assert finished_within(done, 5.0)
        assert torch.equal(out.cpu(), masks[1, :5]) and int(total) == int(masks[1, :5].sum(dtype=torch.int64))
        gate.used(1)
        flags[:2] = 4  # raised before the wait is queued: no wait at all
        again = gate.copy_when_filled(0, 2, 4)
        torch.cuda.synchronize()
        assert torch.equal(again.cpu(), masks[0, :2])
    finally:
        flags.fill_(mask_gate.RELEASED)  # a failed check must not leave the device waiting
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(masks.data_ptr())
        f.close()
