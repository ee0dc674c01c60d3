"""Which flag memory, and which wait, works on this device (and whether a copy queued behind the wait returns at
once, as MaskGate.copy_when_filled needs): the Triton spin kernel (engine/mask_gate.py) on device,
cudaHostAlloc'd and cudaHostRegister'd flags, and the driver's cuStreamWaitValue32/64 (cuda.bindings) on registered
flags. Each case in a subprocess with a timeout: first a wait already met, then one the host meets 0.3 s later."""
import subprocess, sys
REGISTERED = ("import os, tempfile\nfrom engine.grammar_link import _pin\nf = tempfile.TemporaryFile(dir='/dev/shm')\n"
              "os.ftruncate(f.fileno(), 4096)\nflat = torch.from_file(f'/proc/self/fd/{f.fileno()}', shared=True, "
              "size=1024, dtype=torch.int32)\nassert _pin(flat, 4096)\nflags = flat[512:].view(torch.int64)")
TRITON = "def queue(seq):\n    mask_gate.wait(flags, 2, seq)"
DRIVER = ("from cuda.bindings import driver\nerr, dptr = driver.cuMemHostGetDevicePointer(flags.data_ptr(), 0)\n"
          "print('devptr', err, hex(int(dptr)), flush=True)\n"
          "def queue(seq):\n    st = driver.CUstream(torch.cuda.current_stream().cuda_stream)\n"
          "    for k in range(2):\n        r = driver.{fn}(st, int(dptr) + k * 8, seq, int(driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ))\n"
          "        assert r[0] == driver.CUresult.CUDA_SUCCESS, r")
COPY = ("\ndef queue(seq, _wait=queue):\n    _wait(seq)\n    t = time.monotonic()\n"
        "    dst.copy_(flat[:256], non_blocking=True)  # what MaskGate.copy_when_filled does behind the wait\n"
        "    print('copy_ returned after %.3f s' % (time.monotonic() - t), flush=True)\n"
        "dst = torch.empty(256, dtype=torch.int32, device='cuda')")
CASES = {
 "triton-device": ("flags = torch.zeros(4, dtype=torch.int64, device='cuda')", TRITON),
 "triton-pinned": ("flags = torch.zeros(4, dtype=torch.int64).pin_memory()", TRITON),
 "triton-registered": (REGISTERED, TRITON),
 "driver64-registered": (REGISTERED, DRIVER.replace("{fn}", "cuStreamWaitValue64")),
 "driver64-registered-copy": (REGISTERED, DRIVER.replace("{fn}", "cuStreamWaitValue64") + COPY),
 "triton-registered-copy": (REGISTERED, TRITON + COPY),
}
BODY = """
import threading, time, torch
from engine import mask_gate
{setup}
{queue}
print('ptr', hex(flags.data_ptr()), flush=True)
s = torch.cuda.Stream()
def timed(seq, raise_after=None):
    t = time.monotonic()
    with torch.cuda.stream(s):
        queue(seq)
    ev = torch.cuda.Event(); ev.record(s)
    if raise_after is not None:
        def up():
            time.sleep(raise_after); flags[:2] = seq
        threading.Thread(target=up).start()
    while not ev.query():
        if time.monotonic() - t > 6:
            print('HANG at seq', seq, flush=True); flags[:] = 2 ** 62; return False
        time.sleep(0.001)
    print('seq %d done in %.3f s' % (seq, time.monotonic() - t), flush=True)
    return True
timed(0) and timed(5, 0.3)
"""
for name, (setup, queue) in CASES.items():  # argv: only the cases named
    if sys.argv[1:] and name not in sys.argv[1:]:
        continue
    try:
        r = subprocess.run([sys.executable, "-c", BODY.format(setup=setup, queue=queue)], capture_output=True,
                           text=True, timeout=25)
        print(name, "->", r.stdout.strip().replace("\n", " | "), r.stderr.strip()[-500:], flush=True)
    except subprocess.TimeoutExpired as e:
        print(name, "-> TIMEOUT", e.stdout, flush=True)
