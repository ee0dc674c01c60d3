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

import threading
import time

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

RELEASED = 2 ** 62  # a flag value past every step: nothing waits on it
COPY_BLOCK = 4096  # int32 words a program of `_copy`
MAX_READS = 1 << 24  # the Triton wait gives up after this many reads of host memory (~1 us each: seconds)


if triton is not None:
    @triton.jit(do_not_specialize=["seq"])  # one compile for every step number
    def _wait(flags_ptr, count, seq, max_reads):
        k, reads = 0, 0
        while (k < count) & (reads < max_reads):  # bounded: a flag never seen cannot hold the device for good
            if tl.load(flags_ptr + k, volatile=True) >= seq:
                k += 1
            reads += 1

    @triton.jit
    def _copy(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        """dst[:n] = src[:n], the source read by the SMs themselves (page-locked host memory, mapped): the copy
        that cannot be staged by the driver, for hosts where cudaMemcpyAsync behind the wait blocks the host."""
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=inside, volatile=True), mask=inside)


def available() -> bool:
    return triton is not None


def reached(flags: torch.Tensor, count: int, seq: int) -> bool:
    """The rule `_wait` waits for: every one of the first `count` flags is at least `seq`."""
    return bool((flags[:count] >= seq).all())


def copy_rows(out: torch.Tensor, rows: torch.Tensor) -> None:
    """Queue, on the current stream, out.copy_(rows) by `_copy`. Both contiguous int32."""
    n = rows.numel()
    _copy[(triton.cdiv(n, COPY_BLOCK),)](rows, out, n, BLOCK=COPY_BLOCK, num_warps=4)


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

    WAITS = ("cuStreamWaitValue64", "triton")
    COPIES = ("memcpy", "kernel")

    def __init__(self, masks: torch.Tensor, flags: torch.Tensor, shards: int, device: torch.device,
                 how: str = "triton", copy: str = "memcpy") -> None:
        """how: one of WAITS (cuStreamWaitValue64 needs NVIDIA's cuda-python: an ImportError if absent); copy: one
        of COPIES, cudaMemcpyAsync or the `_copy` kernel."""
        self.masks, self.flags, self.shards, self.device = masks, flags, shards, device
        self.device_masks = torch.empty(masks.shape, dtype=masks.dtype, device=device)
        self.stream = torch.cuda.Stream(device)
        self.freed = [None] * masks.shape[0]  # per buffer: an event after the last kernel that read its rows
        self.how, self.copy = how, copy
        self.stuck = False  # a failed check left work queued on the side stream that did not end
        self._driver = DriverWait(flags) if how == "cuStreamWaitValue64" else None
        if copy == "kernel":  # loaded now, not at its first launch behind an unmet wait (see _load_kernel)
            self._load_kernel()

    def _load_kernel(self) -> None:
        """Launch `_copy` once before any wait. CUDA loads a kernel at its first launch (lazy module loading), and
        a load can synchronize the context: queued behind an unmet wait, the host blocked until the check's
        watchdog raised the flags (5 s, an H100, twentieth session), so the check refused the kernel copy."""
        copy_rows(self.device_masks[0, :1], self.device_masks[1 % self.masks.shape[0], :1])
        torch.cuda.synchronize(self.device)

    def _wait(self, seq: int) -> None:
        """Queue, on the side stream (current), the wait for every flag to reach seq."""
        if self._driver is not None:
            self._driver(self.stream, self.shards, seq)
        else:
            wait(self.flags, self.shards, seq)

    def _copy_rows(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        if self.copy == "kernel":
            copy_rows(out, rows)
        else:
            out.copy_(rows, non_blocking=True)

    def copy_when_filled(self, buffer: int, rows: int, seq: int) -> torch.Tensor:
        """The buffer's first `rows` rows on the device, copied once every flag reached `seq`; the current stream
        waits for that copy. Queued only: the host does not wait."""
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            if self.freed[buffer] is not None:
                self.stream.wait_event(self.freed[buffer])
            self._wait(seq)
            out = self.device_masks[buffer, :rows]
            self._copy_rows(out, self.masks[buffer, :rows])
        main.wait_stream(self.stream)
        return out

    def check(self, timeout_s: float = 5.0) -> str | None:
        """None if the gate works here, else why not (the engine then waits for the masks on the host). It must:
        return for a wait already met (step 0: the flags start at 0, and steps are numbered from 1); queue the copy
        behind an unmet wait without blocking the host (a driver that stages the copy through pageable memory
        would wait for the wait, and the host, which raises the flags, with it); and end that wait once the host
        raises the flags. A watchdog thread raises them after `timeout_s` whatever happens, so the check itself
        cannot hang. On failure the flags are left RELEASED, so nothing queued stays waiting."""
        try:
            why = self._check_met(timeout_s) or self._check_unmet(timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported; the host waits instead
            self._release()
            why = f"{type(exc).__name__}: {exc}"[:300]
        if why is not None and not _finished(_recorded(self.stream), timeout_s):
            self.stuck = True  # its stream still waits, flags RELEASED: nothing else should reset them
        return why

    def _check_met(self, timeout_s: float) -> str | None:
        with torch.cuda.stream(self.stream):
            self._wait(0)
        if not _finished(_recorded(self.stream), timeout_s):
            self._release()
            return f"a met wait ({self.how}) did not end within {timeout_s} s"
        return None

    def _check_unmet(self, timeout_s: float) -> str | None:
        watchdog = threading.Timer(timeout_s, self._release)  # should the copy below block the host
        watchdog.start()
        try:
            why = self._queue_unmet_and_raise(timeout_s)
        finally:
            watchdog.cancel()
            watchdog.join()
        if why is None:
            self.flags[:self.shards] = 0  # only now: a watchdog firing after this would leave every wait met
        return why

    def _queue_unmet_and_raise(self, timeout_s: float) -> str | None:
        with torch.cuda.stream(self.stream):
            self._wait(RELEASED)
            queued = time.monotonic()
            self._copy_rows(self.device_masks[0, :1], self.masks[0, :1])  # as copy_when_filled queues it
            copy_s = time.monotonic() - queued
        done = _recorded(self.stream)
        if copy_s > timeout_s / 2:
            self._release()
            return f"the copy behind the wait ({self.how}) blocked the host for {copy_s:.2f} s"
        if _finished(done, 0.05):
            self._release()
            return "the wait did not wait"
        self._release()
        if not _finished(done, timeout_s):
            return f"the wait ({self.how}) did not end within {timeout_s} s of the flags' raise"
        return None

    def _release(self) -> None:
        self.flags[:self.shards] = RELEASED

    def used(self, buffer: int) -> None:
        """The current stream's kernels that read the buffer's device rows are queued: the next copy into it waits
        for them."""
        event = torch.cuda.Event()
        event.record()
        self.freed[buffer] = event


class HostRing:
    """Page-locked int64 rows for the gated steps' tokens, allocated once: allocating page-locked memory between
    the device's wait and the send of its masks could wait for the device (cudaHostAlloc), and so for good. A
    slot comes back SLOTS steps later; the engine reads a step's tokens at most two steps after its launch."""

    SLOTS = 8

    def __init__(self, width: int) -> None:
        self.width = width
        self._slots = torch.empty((self.SLOTS, width), dtype=torch.int64, pin_memory=True)
        self._next = 0

    def next(self, n: int) -> torch.Tensor:
        slot = self._slots[self._next, :n]
        self._next = (self._next + 1) % self.SLOTS
        return slot


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _finished(event: torch.cuda.Event, timeout_s: float) -> bool:
    """Whether the event happened within timeout_s (polled: a synchronize could wait forever)."""
    end = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > end:
            return False
        time.sleep(0.0005)
    return True
