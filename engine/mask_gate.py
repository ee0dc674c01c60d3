"""The device waits for a step's grammar masks itself (structured_outputs_wait "device"), so the engine thread
queues a constrained step whole, sampling included, as it queues an unconstrained one.

Why: on the H200 the forward of a W-B step (2.5-3.6 ms) is shorter than the engine thread's own work on a
constrained step. With the host waiting for the masks before it queues the sampling, every section of the
step sat between one forward and the next, and the device waited 0.66-1.16 ms a step for the masks
(json 100% at 0.79x of json 0%; docs/benchmarks.md, sixteenth session).

How: each grammar process writes its rows of the shared, page-locked mask buffer, then its flag (an int64 in
the same mapping: the number of the last Step it filled). A side stream waits until every flag has reached the
step's number, then copies the rows to the device; the sampling, queued on the main stream behind the forward,
waits for that copy. The copy thus overlaps the forward when the masks come early. The wait is the driver's
cuStreamWaitValue64 (NVIDIA's cuda-python bindings, which hold no SM while waiting) where it passes `check`,
else `_wait`, one Triton program that reads the flags until they are reached (one warp of one SM, beside the
forward). `reached` is the rule both wait for.

A flag that is never written would stall the device: the link writes the flags itself for a grammar process
that is lost or not ready, for a step given up before its masks were asked for (GrammarLink.release), and at
shutdown.
"""
from __future__ import annotations

import time

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

RELEASED = 2 ** 62  # a flag value past every step: nothing waits on it
MAX_READS = 1 << 24  # the Triton wait gives up after this many reads of host memory (~1 us each: seconds)


if triton is not None:
    @triton.jit(do_not_specialize=["seq"])  # one compile for every step number
    def _wait(flags_ptr, count, seq, max_reads):
        k, reads = 0, 0
        while (k < count) & (reads < max_reads):  # bounded: a flag never seen cannot hold the device for good
            if tl.load(flags_ptr + k, volatile=True) >= seq:
                k += 1
            reads += 1


def available() -> bool:
    return triton is not None


def reached(flags: torch.Tensor, count: int, seq: int) -> bool:
    """The rule `_wait` waits for: every one of the first `count` flags is at least `seq`."""
    return bool((flags[:count] >= seq).all())


def wait(flags: torch.Tensor, count: int, seq: int) -> None:
    """Queue, on the current stream, a wait until reached(flags, count, seq). flags: int64, page-locked host
    memory (or device memory) the device can read."""
    _wait[(1,)](flags, count, seq, MAX_READS, num_warps=1)


class DriverWait:
    """cuStreamWaitValue64 on each flag (GEQ: a wrap-safe `*flag - seq >= 0`), through the flags' device address."""

    def __init__(self, flags: torch.Tensor) -> None:
        from cuda.bindings import driver  # NVIDIA's cuda-python; an ImportError leaves the Triton wait

        self.driver = driver
        err, address = driver.cuMemHostGetDevicePointer(flags.data_ptr(), 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemHostGetDevicePointer: {err}")
        self.address, self.geq = int(address), int(driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)

    def __call__(self, stream: torch.cuda.Stream, count: int, seq: int) -> None:
        handle = self.driver.CUstream(stream.cuda_stream)
        for k in range(count):
            err, = self.driver.cuStreamWaitValue64(handle, self.address + 8 * k, seq, self.geq)
            if err != self.driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuStreamWaitValue64: {err}")


class MaskGate:
    """The side stream and the device's mask buffers: `masks` (host, shared with the grammar processes, page-locked)
    is copied buffer by buffer into `device_masks` once its flags are reached."""

    def __init__(self, masks: torch.Tensor, flags: torch.Tensor, shards: int, device: torch.device) -> None:
        self.masks, self.flags, self.shards, self.device = masks, flags, shards, device
        self.device_masks = torch.empty(masks.shape, dtype=masks.dtype, device=device)
        self.stream = torch.cuda.Stream(device)
        self.freed = [None] * masks.shape[0]  # per buffer: an event after the last kernel that read its rows
        self.how = "triton"
        self._driver: DriverWait | None = None
        try:
            self._driver, self.how = DriverWait(flags), "cuStreamWaitValue64"
        except Exception:  # noqa: BLE001 - no cuda-python, or no device address for the flags: Triton's wait
            pass

    def _wait(self, seq: int) -> None:
        """Queue, on the side stream (current), the wait for every flag to reach seq."""
        if self._driver is not None:
            self._driver(self.stream, self.shards, seq)
        else:
            wait(self.flags, self.shards, seq)

    def copy_when_filled(self, buffer: int, rows: int, seq: int) -> torch.Tensor:
        """The buffer's first `rows` rows on the device, copied once every flag reached `seq`; the current stream
        waits for that copy. Queued only: the host does not wait."""
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            if self.freed[buffer] is not None:
                self.stream.wait_event(self.freed[buffer])
            self._wait(seq)
            out = self.device_masks[buffer, :rows]
            out.copy_(self.masks[buffer, :rows], non_blocking=True)
        main.wait_stream(self.stream)
        return out

    def check(self, timeout_s: float = 5.0) -> str | None:
        """None if the wait works here: one already met (step 0: the flags start at 0, and steps are numbered from
        1) returns, and one the host meets later (the flags raised to RELEASED) waits until then; with the shard
        count it will serve (Triton compiles a count of 1 apart). Else why not (the engine then waits for the
        masks on the host). On failure the flags are left RELEASED, so nothing queued stays waiting."""
        try:
            for seq, raise_flags in ((0, False), (RELEASED, True)):
                with torch.cuda.stream(self.stream):
                    self._wait(seq)
                done = torch.cuda.Event()
                done.record(self.stream)
                if raise_flags:
                    if _finished(done, 0.05):
                        return "the wait did not wait"
                    self.flags[:self.shards] = RELEASED
                if not _finished(done, timeout_s):
                    self.flags[:self.shards] = RELEASED
                    return f"the wait ({self.how}) did not end within {timeout_s} s"
            self.flags[:self.shards] = 0
        except Exception as exc:  # noqa: BLE001 - reported; the host waits instead
            self.flags[:self.shards] = RELEASED
            return f"{self.how}: {type(exc).__name__}: {exc}"[:300]
        return None

    def used(self, buffer: int) -> None:
        """The current stream's kernels that read the buffer's device rows are queued: the next copy into it waits
        for them."""
        event = torch.cuda.Event()
        event.record()
        self.freed[buffer] = event


def _finished(event: torch.cuda.Event, timeout_s: float) -> bool:
    """Whether the event happened within timeout_s (polled: a synchronize could wait forever)."""
    end = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > end:
            return False
        time.sleep(0.0005)
    return True
