"""Dispatcher: which engine core (of `--data-parallel-size N`) gets a new request.

Cache-aware, as SGLang's router and llm-d's endpoint picker are: a core that already holds a prompt's
prefix in its KV cache skips that prefill, so a request goes to the core it last sent the longest shared
prefix to, unless that core is loaded well beyond the least loaded one; without a known prefix it goes to
the least loaded core. Prefixes are remembered as the chained hashes of full KV blocks (block i's hash
covers blocks 0..i, as the prefix cache keys them), at most MAX_BLOCKS a prompt and MAX_ENTRIES in all
(least recently used forgotten first). `round_robin` is the baseline the shared-prefix benchmark compares.

Load is what each core last reported (running + waiting completions) plus what this front end sent it
since; the numbers are per front end, so N front ends each balance on their own view.
"""
from __future__ import annotations

from collections import OrderedDict

POLICIES = ("affinity", "round_robin")
MAX_BLOCKS = 64  # prefix blocks hashed per prompt: 1,024 tokens at block size 16
MAX_ENTRIES = 200_000  # remembered block hashes (a few tens of MB at most)
BALANCE_ABS = 16  # a prefix match is dropped when its core has this many more requests than the least loaded
BALANCE_REL = 1.5  # ... and more than this times as many


def block_hashes(prompt: list[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks (at most MAX_BLOCKS)."""
    hashes, h = [], 0
    for i in range(min(len(prompt) // block_size, MAX_BLOCKS)):
        h = hash((h, tuple(prompt[i * block_size:(i + 1) * block_size])))
        hashes.append(h)
    return hashes


class Dispatcher:
    def __init__(self, num_cores: int, policy: str = "affinity", block_size: int = 16) -> None:
        if policy not in POLICIES:
            raise ValueError(f"dispatch policy must be one of {POLICIES}, got {policy!r}")
        self.num_cores = num_cores
        self.policy = policy
        self.block_size = block_size
        self._owner: OrderedDict[int, int] = OrderedDict()  # block hash -> the core it was sent to
        self._next = 0

    def choose(self, prompt: list[int], loads: list[float], alive: list[bool]) -> int:
        """The core for `prompt`, among the alive ones (at least one is)."""
        live = [i for i in range(self.num_cores) if alive[i]]
        if self.policy == "round_robin":
            return self._round_robin(live)
        hashes = block_hashes(prompt, self.block_size)
        least = min(live, key=lambda i: (loads[i], (i - self._next) % self.num_cores))
        core = self._longest_match(hashes, alive)
        if core is None or self._imbalanced(loads[core], loads[least]):
            core = least
            self._next = (least + 1) % self.num_cores  # ties rotate
        self._remember(hashes, core)
        return core

    def _round_robin(self, live: list[int]) -> int:
        core = next((i for i in live if i >= self._next), live[0])
        self._next = (core + 1) % self.num_cores
        return core

    def _longest_match(self, hashes: list[int], alive: list[bool]) -> int | None:
        for h in reversed(hashes):
            core = self._owner.get(h)
            if core is not None and alive[core]:
                return core
        return None

    @staticmethod
    def _imbalanced(load: float, least: float) -> bool:
        return load - least > BALANCE_ABS and load > BALANCE_REL * least

    def _remember(self, hashes: list[int], core: int) -> None:
        owner = self._owner
        for h in hashes:
            owner[h] = core
            owner.move_to_end(h)
        while len(owner) > MAX_ENTRIES:
            owner.popitem(last=False)
