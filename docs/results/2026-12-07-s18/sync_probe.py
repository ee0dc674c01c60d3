"""Which host calls block while the device waits for grammar masks (engine/mask_gate.py): each case queues, on a
side stream, a wait for a flag the host has not raised, makes the main stream wait for it (as copy_when_filled
does), then times one host call. A thread raises the flag after HOLD_S, so a call that blocks returns after
~HOLD_S instead of hanging. A torch kernel launched for the first time is loaded then
(CUDA's lazy module loading), which can synchronize the context. Between GrammarLink.reserve and send no call may block: the host raises the flags
only by sending. Each case in a subprocess.
    PYTHONPATH=.:/tmp/site python3 docs/results/2026-12-07-s18/sync_probe.py [case ...]"""
import subprocess, sys

CASES = {
    "nothing": "pass",
    "pinned-alloc": "torch.empty(3_000_017, dtype=torch.uint8, pin_memory=True)",
    "pinned-alloc-small": "torch.tensor([1, 2, 3], dtype=torch.long, pin_memory=True)",
    "pinned-h2d": "torch.tensor([1, 2, 3], dtype=torch.long).pin_memory().to('cuda', non_blocking=True)",
    "pageable-h2d": "torch.tensor([1, 2, 3], dtype=torch.long).to('cuda', non_blocking=True)",
    "cuda-alloc": "torch.empty(1 << 30, dtype=torch.uint8, device='cuda')",
    "fresh-torch-kernel": "torch.arange(7, device='cuda', dtype=torch.float64).cumsum(0)",
    "loaded-torch-kernel": "warm.sum()",
    "event-record": "torch.cuda.Event().record()",
}
BODY = """
import threading, time, torch
from engine import mask_gate
from engine.grammar_link import _pin
import os, tempfile
f = tempfile.TemporaryFile(dir='/dev/shm'); os.ftruncate(f.fileno(), 8192)
flat = torch.from_file(f'/proc/self/fd/{f.fileno()}', shared=True, size=2048, dtype=torch.int32)
assert _pin(flat, 8192)
flags = flat[1024:].view(torch.int64)
how = "cuStreamWaitValue64"
try:
    gate = mask_gate.MaskGate(flat[:1024].view(1, 1, 1024), flags, 2, torch.device('cuda'), how)
except Exception:
    how = "triton"
    gate = mask_gate.MaskGate(flat[:1024].view(1, 1, 1024), flags, 2, torch.device('cuda'), how)
warm = torch.ones(4, device='cuda')
warm.sum().item()  # loaded before the wait
HOLD_S = 3.0
threading.Timer(HOLD_S, lambda: flags.fill_(2 ** 62)).start()
t = time.monotonic()
gate.copy_when_filled(0, 1, 5)  # waits on the side stream; the main stream waits for the copy
queued = time.monotonic() - t
t = time.monotonic()
{op}
took = time.monotonic() - t
torch.cuda.synchronize()
print('%s wait: queued in %.3f s; the call took %.3f s -> %s' % (how, queued, took,
      'BLOCKS' if took > HOLD_S / 2 else 'ok'), flush=True)
"""
for name, op in CASES.items():
    if sys.argv[1:] and name not in sys.argv[1:]:
        continue
    try:
        r = subprocess.run([sys.executable, "-c", BODY.replace("{op}", op)], capture_output=True, text=True,
                           timeout=30)
        print(f"{name:20s} -> {r.stdout.strip()} {r.stderr.strip()[-300:] if r.returncode else ''}", flush=True)
    except subprocess.TimeoutExpired:
        print(f"{name:20s} -> TIMEOUT", flush=True)
