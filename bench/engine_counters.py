"""What a load did inside kvserve's engine core, from two scrapes of the server's /metrics around it: steps,
tokens a step, the engine's busy time a step and its share of the load, the wait for grammar masks per masked
step, the engine thread's milliseconds a step by section (engine/step_clock.py) and the device's by part
(engine/device_clock.py, on CUDA). Through the real server (several front ends) that places a slowdown: the
engine's steps got longer, or more of them ran with fewer rows, or the engine waited for masks, or the device
for the host. Other servers give no kvserve_* series: then nothing.
"""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

COUNTERS = ("engine_steps", "generation_tokens", "engine_busy_seconds", "structured_steps",
            "structured_mask_wait_seconds")
LABELED = {"engine_section_seconds": "section", "engine_device_seconds": "part"}  # read as "LABEL:NAME"


def scrape(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """kvserve's engine counters (summed over its cores) by short name; {} when the server has none."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    wanted = {f"kvserve_{name}": name for name in COUNTERS}
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name in wanted:
            found[wanted[family.name]] = sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif family.name.removeprefix("kvserve_") in LABELED:
            label = LABELED[family.name.removeprefix("kvserve_")]
            found.update((f"{label}:{s.labels[label]}", s.value) for s in family.samples if s.name.endswith("_total"))
    return found


def between(before: dict[str, float], after: dict[str, float], duration_s: float) -> dict[str, float]:
    """The load's engine figures from two scrapes `duration_s` of load apart ({} without kvserve's series)."""
    if not before or not after:
        return {}
    d = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in COUNTERS}
    steps = max(d["engine_steps"], 1)
    masked = d["structured_steps"]
    wait_ms = d["structured_mask_wait_seconds"] * 1e3 / masked if masked else 0.0
    return {"steps": int(d["engine_steps"]), "tokens_per_step": round(d["generation_tokens"] / steps, 1),
            "busy_ms_per_step": round(d["engine_busy_seconds"] * 1e3 / steps, 3),
            "busy_share": round(d["engine_busy_seconds"] / duration_s, 3),
            "masked_steps": int(masked), "mask_wait_ms_per_masked_step": round(wait_ms, 3),
            "section_ms_per_step": _per_step(before, after, "section", steps),
            "device_ms_per_step": _per_step(before, after, "part", steps)}


def _per_step(before: dict[str, float], after: dict[str, float], label: str, steps: float) -> dict[str, float]:
    """A labeled family's milliseconds a step over the load, by label value."""
    return {name[len(label) + 1:]: round((after[name] - before.get(name, 0.0)) * 1e3 / steps, 3)
            for name in after if name.startswith(label + ":")}
