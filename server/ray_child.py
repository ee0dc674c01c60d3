"""`python -m server.ray_child serve ...`: `kvserve serve` for a Ray Serve replica (server/ray_serve.py),
drained once its stdin closes. The replica holds the pipe's write end: when the replica goes, however it
goes (a SIGKILL included), the pipe closes, this process gets SIGTERM and drains and exits as on any
SIGTERM; its own children follow it through kvserve's lifeline. Kept free of Ray so the child starts fast.
"""
from __future__ import annotations

import os
import signal
import sys
import threading


def watch_stdin() -> None:
    """Raw reads (not sys.stdin's buffer, whose lock a daemon thread must not hold at interpreter exit)."""
    while os.read(0, 4096):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> int:
    threading.Thread(target=watch_stdin, name="kvserve-replica-lifeline", daemon=True).start()
    from server.cli import main as kvserve_main

    return kvserve_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
