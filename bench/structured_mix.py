"""A share of a serving benchmark's requests constrained by a JSON schema (issue 15's W-B at 0/20/100%).

    kvserve bench serve ... --structured-fraction 0.2 [--structured-form guided_json]
    (bench/serve.py calls constrain(payloads, fraction, seed, form) on the bodies before sending them)

Exactly round(fraction * len(payloads)) payloads, chosen by a seeded
shuffle, get `structured_outputs: {"json": SCHEMA}` (vLLM >= 0.10.2 and kvserve read it; `--form guided_json`
for older vLLM, `response_format` for the OpenAI form). The schema is a realistic extraction record (nested
object, enum, bounded array, string pattern) whose grammar compiles once (both servers cache it), so the
measurement is the per-step mask cost, not compilation. With ignore_eos (fixed output lengths) the JSON comes
first and the rest of the tokens are unconstrained, on kvserve as on vLLM.
"""
from __future__ import annotations

import copy
import random

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "title": {"type": "string", "maxLength": 80},
        "status": {"enum": ["open", "closed", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8},
        "owner": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40},
            "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"}},
            "required": ["name", "email"]},
        "score": {"type": "number"},
    },
    "required": ["id", "title", "status", "tags", "owner"],
}
FORMS = {
    "structured_outputs": lambda s: {"structured_outputs": {"json": s}},
    "guided_json": lambda s: {"guided_json": s},
    "response_format": lambda s: {"response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "record", "schema": s}}},
}


def constrain(payloads: list[dict], fraction: float, seed: int = 0, form: str = "structured_outputs") -> list[dict]:
    """Copies of `payloads`, round(fraction * n) of them (a seeded choice) carrying the schema."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError("fraction must be in [0, 1]")
    chosen = set(random.Random(seed).sample(range(len(payloads)), round(fraction * len(payloads))))
    extra = FORMS[form](SCHEMA)
    return [{**copy.deepcopy(p), **extra} if i in chosen else p for i, p in enumerate(payloads)]
