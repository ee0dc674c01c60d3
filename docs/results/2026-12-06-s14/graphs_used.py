"""Fourteenth session: whether MaskedArgmaxGraphs replays at all under W-B json 100% offline (the server A/B showed
no host saving). The engine on the Qwen2.5-0.5B shape, grammar process on, 256 constrained greedy requests of
128 tokens, three times: out tok/s, and with graphs the captures and replays. One setting a process:
    python3 docs/results/2026-12-06-s14/graphs_used.py 0; python3 docs/results/2026-12-06-s14/graphs_used.py 1
Runs at 49cb94a: the argmax graphs were reverted in d368efd."""
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, ".")
from bench.models import build_random_model, parse_model_config  # noqa: E402
from benchmarks.structured_step import requests  # noqa: E402
from engine.llm import LLM  # noqa: E402

with tempfile.TemporaryDirectory() as tmp:
    model_dir = build_random_model(parse_model_config("qwen2.5-0.5b"), Path(tmp), tokenizer="bpe")
    for graphs in (sys.argv[1] == "1",):
        llm = LLM(str(model_dir), max_model_len=2048, max_num_batched_tokens=16384, max_num_seqs=256,
                  enable_prefix_caching=False, structured_outputs_process=True,
                  structured_outputs_argmax_graphs=graphs)
        prompts, params = requests(llm, 256, 1.0)
        for rep in range(3):
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            secs = time.perf_counter() - start
            masking = llm.engine.structured._masking
            ag = masking.argmax_graphs
            print(json.dumps({"graphs": graphs, "rep": rep, "out_tok_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / secs),
                              "captured": None if ag is None else len(ag.graphs),
                              "replays": None if ag is None else ag.replays,
                              "keys_seen": None if ag is None else len(ag._seen)}), flush=True)
