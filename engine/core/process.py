"""Starting the engine-core process, and its entry point.

The launcher (the process `kvserve serve` started, or a test) calls start_engine_core(spec). The core is a
spawned process (a fork would copy the launcher's threads and CUDA state) titled `kvserve::engine-core`.
Two pipes tie the processes' lives together, read by poll, never written:
  - the launcher's lifeline: the core (and every front-end process) holds its read end and exits when it
    reads EOF, so a killed launcher leaves no orphan holding the GPU;
  - the core's lifeline: the front ends hold its read end and learn of the core's death at once (EOF), without
    waiting for a heartbeat to go missing.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import select
import signal
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Callable

import zmq

from engine.config import EngineConfig
from engine.core.messages import Codec, FromCore, LoadFailed, Loading, Ready, Shutdown, ToCore

logger = logging.getLogger("kvserve.engine_core")

PROCESS_TITLE = "kvserve::engine-core"


@dataclass
class CoreAddresses:
    """ZeroMQ ipc endpoints: one inbox for every front end, one outbox per front end."""
    inbox: str
    outboxes: list[str]

    @classmethod
    def new(cls, num_clients: int) -> "CoreAddresses":
        folder = tempfile.mkdtemp(prefix="kvserve-")  # short: ipc paths must stay under ~100 bytes
        return cls(f"ipc://{folder}/in", [f"ipc://{folder}/out-{i}" for i in range(num_clients)])


@dataclass
class EngineCoreSpec:
    """Everything the core process needs (pickled to it once, at spawn)."""
    engine_config: EngineConfig
    addresses: CoreAddresses
    log_level: str = "info"
    # engine_factory(config) -> engine; tests wrap the engine to inject faults. None: LLMEngine.
    engine_factory: Callable | None = None
    env: dict[str, str] = field(default_factory=dict)  # set in the core before anything is imported
    cpu_threads: int | None = None  # torch threads on the CPU (None: one fewer than the cores)


@dataclass
class EngineCoreHandle:
    """The launcher's side: the process, the pipe ends the front ends need, and a socket to ask it to stop."""
    process: mp.process.BaseProcess
    spec: EngineCoreSpec
    core_alive: object  # Connection: readable (EOF) once the core has exited
    launcher_alive: object  # Connection: the read end of the launcher's lifeline, for front-end processes
    _launcher_hold: object  # Connection: the write end; the launcher holds it until it exits

    def shutdown(self, timeout: float = 30.0) -> int | None:
        """Ask the core to stop (it aborts what is left), wait, kill it if it does not go. Its exit code.
        SIGTERM first: a core still loading the model dies of it at once (it reads no inbox until loaded; a
        stop during a long load waited for the load, then the timeout); a loaded core ignores it."""
        if self.process.is_alive():
            self.process.terminate()
            _send_once(self.spec.addresses.inbox, Codec(ToCore).encode(Shutdown()))
            self.process.join(timeout)
        if self.process.is_alive():
            logger.error("the engine core did not stop within %.0f s: killing it", timeout)
            self.process.kill()
            self.process.join(5)
        return self.process.exitcode


# What a forkserver imports once, so that each core it forks starts with them (start_engine_core).
FORKSERVER_PRELOAD = ["torch", "transformers", "transformers.models.llama.configuration_llama", "engine.engine",
                      "engine.core.loop"]


def start_engine_core(spec: EngineCoreSpec, start_method: str = "spawn") -> EngineCoreHandle:
    """The core process, spawned. start_method="forkserver" (the tests' in-process servers) forks it from a
    server process that imported torch, transformers and the engine once (FORKSERVER_PRELOAD): a core of the
    tiny test model was ready after ~1.2 s instead of ~6.5 s on a 2-core host (the first one pays the imports).
    `kvserve serve` spawns: a forkserver outlives the launcher's own process tree."""
    if start_method == "forkserver" and spec.env:
        raise ValueError("a forked core cannot set its environment before torch is imported: spawn it")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    launcher_read, launcher_write = ctx.Pipe(duplex=False)
    core_read, core_write = ctx.Pipe(duplex=False)
    process = ctx.Process(target=run_engine_core, args=(spec, launcher_read, core_write), name=PROCESS_TITLE,
                          daemon=True)
    process.start()
    core_write.close()  # the core holds the only write end: EOF here means it is gone
    return EngineCoreHandle(process, spec, core_read, launcher_read, launcher_write)


def _send_once(address: str, data: bytes) -> None:
    context = zmq.Context.instance()
    with context.socket(zmq.PUSH) as sock:
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(address)
        sock.send(data)


# ---- inside the core process --------------------------------------------------------------------------------
def run_engine_core(spec: EngineCoreSpec, launcher_alive, core_alive) -> None:
    """The process's main: load, say Ready (or LoadFailed), loop until Shutdown or the launcher's death."""
    os.environ.update(spec.env)
    _become_engine_core(spec.log_level)
    context = zmq.Context()
    inbox, outboxes = _bind(context, spec.addresses)
    codec = Codec(FromCore)
    loading = threading.Event()
    threading.Thread(target=_exit_if_launcher_dies, args=(launcher_alive.fileno(), loading), daemon=True,
                     name="kvserve-load-lifeline").start()
    try:
        engine = _load(spec, outboxes, codec, launcher_alive.fileno())
    finally:
        loading.set()
    if engine is None:
        raise SystemExit(1)
    from engine.core.loop import EngineCore

    EngineCore(engine, inbox, outboxes, launcher_alive.fileno()).run()
    del core_alive  # held until here: its closing tells the front ends the core is gone


def _exit_if_launcher_dies(lifeline_fd: int, loaded: threading.Event) -> None:
    """While the model loads: the launcher's death ends the core at once. The step loop watches the lifeline
    only after the load, and a load can take minutes (or hang on storage: a killed launcher left a core blocked
    on its weights for good, holding the GPU)."""
    poller = select.poll()
    poller.register(lifeline_fd, select.POLLIN)
    while not loaded.is_set():
        if poller.poll(200):
            logger.error("the launcher is gone while the model loads: the engine core exits")
            os._exit(1)


def _become_engine_core(log_level: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(PROCESS_TITLE)
    except ImportError:
        pass
    # Ctrl-C reaches the core too (the whole process group): the launcher decides. SIGTERM ends the core while
    # it loads (nothing to drain yet); _ignore_sigterm() turns it off before the core says Ready.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _ignore_sigterm() -> None:
    """A loaded core ignores SIGTERM: one sent to the whole process group (systemd's default KillMode,
    `kill -- -PGID`) reaches it too, and it must keep stepping while the front ends drain. The launcher stops
    it (Shutdown) after them; if the launcher is gone, its lifeline ends the core. (Seen on the H200: a group
    SIGTERM ended the core at once and every front end logged it as dead mid-drain.)"""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _bind(context: zmq.Context, addresses: CoreAddresses):
    inbox = context.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, 0)
    inbox.bind(addresses.inbox)
    outboxes = []
    for address in addresses.outboxes:
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow reader: it is our own front end
        sock.setsockopt(zmq.LINGER, 1000)
        sock.bind(address)
        outboxes.append(sock)
    return inbox, outboxes


def _load(spec: EngineCoreSpec, outboxes, codec: Codec, lifeline_fd: int):
    """The engine, or None after telling every front end why loading failed."""
    import time

    start, early = time.monotonic(), None
    try:
        early = _say_loading(spec, outboxes, codec, lifeline_fd)
        engine = _build(spec)
    except BaseException as exc:
        logger.exception("loading the model failed")
        _joined(early)
        _announce(outboxes, codec.encode(LoadFailed(f"{type(exc).__name__}: {exc}"[:2000])), lifeline_fd)
        return None
    _joined(early)
    from engine.core.loop import core_stats
    from engine.malloc import collect_young_less_often, freeze_startup_objects

    freeze_startup_objects()  # full collections would walk the startup objects mid-step (engine/malloc.py)
    collect_young_less_often()
    _ignore_sigterm()
    ready = Ready(str(engine.model_path), engine.tokenizer_path, engine.vocab_size, engine.max_model_len,
                  str(engine.device), engine.backend_name, engine.num_kv_blocks, core_stats(engine),
                  engine.block_size,
                  engine.config.grammar_max_size, engine.config.grammar_compile_fuel)
    if not _announce(outboxes, codec.encode(ready), lifeline_fd):
        raise SystemExit(1)
    logger.info("model loaded in %.1f s: the engine core is ready", time.monotonic() - start)
    return engine


def _say_loading(spec: EngineCoreSpec, outboxes, codec: Codec, lifeline_fd: int) -> threading.Thread | None:
    """Tell the front ends where the tokenizer is, from a thread (it waits for them to connect) while this one
    loads the model: a front end loaded its tokenizer (transformers' import, then the tokenizer) only after
    Ready; beside the core's own load, a tiny model's server was ready in ~7.1 s against ~8.3 s on the
    2-core CPU. (The engine resolves the model path again: free for a directory or the cached GGUF.)"""
    from engine.loader import resolve_model_path, tokenizer_path

    config = spec.engine_config
    if config.skip_tokenizer_init:  # no tokenizer to name (and no model path to resolve for it)
        return None
    path = tokenizer_path(config, resolve_model_path(config.model))
    data = codec.encode(Loading(path))  # the codec stays on this thread; the sockets pass to it at join()
    thread = threading.Thread(target=_announce, args=(outboxes, data, lifeline_fd), daemon=True,
                              name="kvserve-say-loading")
    thread.start()
    return thread


def _joined(thread: threading.Thread | None) -> None:
    """The Loading message sent (or given up), so the sockets are this thread's again."""
    if thread is not None:
        thread.join()


def _announce(outboxes, data: bytes, lifeline_fd: int) -> bool:
    """Send `data` to every front end, waiting for each to connect, unless the launcher dies first (False).
    A blocking send to a front end that never connects (one that failed to start) hung the core forever,
    outside the loop that watches the lifeline: it outlived its launcher (seen in the tests)."""
    poller = zmq.Poller()
    poller.register(lifeline_fd, zmq.POLLIN)
    for sock in outboxes:
        while True:
            try:
                sock.send(data, zmq.NOBLOCK)
                break
            except zmq.Again:
                if poller.poll(50):
                    logger.error("the launcher is gone before a front end connected: the engine core exits")
                    return False
    return True


def cpu_threads(requested: int | None) -> int:
    """A CPU engine's torch threads: as requested, else one fewer than the usable cores (a CPU quota counts:
    under a Kubernetes limit of 8 CPUs on a 96-core node, 96 threads would fight over 8 cores' time)."""
    from engine.config import usable_cores

    return requested or max(1, usable_cores() - 1)


def _build(spec: EngineCoreSpec):
    """The engine, with torch's intra-op threads one fewer than the cores when it runs on the CPU: they spin
    on every core between ops and starved the HTTP process's event loop (measured 10x slower tokens on 2
    cores). Set before the engine is built: its warm-up builds oneDNN primitives for the thread count it runs
    under, and under another count every one is built again while serving."""
    import torch

    from engine.engine import LLMEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_threads(spec.cpu_threads))
    engine = (spec.engine_factory or LLMEngine)(spec.engine_config)
    if engine.device.type != "cpu":  # a GPU engine keeps torch's default
        torch.set_num_threads(threads)
    return engine
