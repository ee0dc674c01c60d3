"""`kvserve bench throughput`: the preset workloads are the published ones, random-weight models build from a
config, and a whole run on a tiny model measures kvserve and transformers on the same prompts."""
from __future__ import annotations

import json

import pytest
import torch

from bench import models, workloads
from bench import throughput as bt

TINY_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256,
               "bos_token_id": 0, "eos_token_id": 1}


def test_wa_is_nano_vllms_workload():
    w = workloads.workload_wa()
    assert len(w.prompts) == len(w.output_lens) == 256
    assert w.output_tokens == 133_966  # the total the GPU issue quotes for nano-vllm's benchmark
    assert all(100 <= len(p) <= 1024 for p in w.prompts) and all(100 <= n <= 1024 for n in w.output_lens)
    assert all(0 <= t <= 10000 for p in w.prompts for t in p)
    assert w.temperature == 0.6


def test_wb_is_torch_randint_under_seed_zero():
    w = workloads.workload_wb()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        expected = torch.randint(100, 150000, (256, 512))
    assert torch.equal(torch.tensor(w.prompts), expected)
    assert w.output_lens == [128] * 256 and w.temperature == 0.0


def test_cpu_smollm2_workload_shape():
    w = workloads.workload_cpu_smollm2(vocab_size=49152)
    assert [len(p) for p in w.prompts] == [128] * 32 and w.output_lens == [64] * 32
    assert w.temperature == 0.0 and all(0 <= t < 49152 for p in w.prompts for t in p)


def test_wl_is_the_long_prompt_command_of_issue_19():
    """--preset wl: the workload of `--dataset random --random-input-len 8192 --random-output-len 256
    --num-prompts 64` on the model's vocabulary, with the engine limits long prompts need, prefix caching off."""
    args = bt.build_parser().parse_args(["--preset", "wl"])
    bt.apply_preset(args)
    assert (args.max_model_len, args.max_num_batched_tokens, args.model_config) == (16384, 16384, "qwen2.5-0.5b")
    assert bt.engine_options(args, None)["enable_prefix_caching"] is False
    w = workloads.workload_wl(vocab_size=151936)
    assert w.name == "W-L" and [len(p) for p in w.prompts] == [8192] * 64 and w.output_lens == [256] * 64
    same = bt.build_parser().parse_args(["--dataset", "random", "--random-input-len", "8192", "--random-output-len",
                                         "256", "--num-prompts", "64"])
    assert workloads.workload_from_dataset(same, None, 151936).prompts == w.prompts
    long = bt.build_parser().parse_args(["--preset", "wl-32k", "--max-num-batched-tokens", "8192"])
    bt.apply_preset(long)
    assert (long.max_model_len, long.max_num_batched_tokens) == (40960, 8192)  # a user's choice stays
    assert models.parse_model_config(long.model_config)["max_position_embeddings"] == 40960  # 32,768 + 256 fit
    assert [len(p) for p in workloads.workload_wl(151936, "wl-32k").prompts] == [32768] * 64


def test_wl_decode_presets_keep_w_ls_prompts_and_generate_1024_tokens():
    """Issue 19's decode over long contexts: the same prompts as wl / wl-32k, 1,024 output tokens, the same
    limits; vLLM's side (benchmarks/vllm_wl.py) reads the same table."""
    for decode, prefill in (("wl-decode", "wl"), ("wl-32k-decode", "wl-32k")):
        args, base = (bt.build_parser().parse_args(["--preset", name]) for name in (decode, prefill))
        bt.apply_preset(args)
        bt.apply_preset(base)
        assert (args.max_model_len, args.max_num_batched_tokens, args.model_config) == \
            (base.max_model_len, base.max_num_batched_tokens, base.model_config)
        w, b = workloads.workload_wl(151936, decode), workloads.workload_wl(151936, prefill)
        assert w.prompts == b.prompts and w.output_lens == [1024] * 64 and w.name == b.name + " decode"
        assert len(w.prompts[0]) + 1024 <= args.max_model_len


def test_qwen_shape_has_qwen2_5_0_5bs_parameter_count():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(models.parse_model_config("qwen2.5-0.5b"))
    assert config.pop("dtype") == "bfloat16"
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 494_032_768  # the published size, embeddings tied


def test_model_config_parsing(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(TINY_CONFIG))
    assert models.parse_model_config(str(path)) == TINY_CONFIG
    assert models.parse_model_config(json.dumps(TINY_CONFIG)) == TINY_CONFIG
    for bad in ("qwen9-1t", '{"hidden_size": 8}', "[1, 2]"):
        with pytest.raises(ValueError):
            models.parse_model_config(bad)


def test_random_model_builds_with_a_tokenizer_for_every_id(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    models.build_random_model(TINY_CONFIG, tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).num_hidden_layers == 2
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.decode([5, 299, 17, 1]) == "<5> <299> <17> <1>"
    assert tok.encode("<5> <299> <17> <1>", add_special_tokens=False) == [5, 299, 17, 1]
    assert tok.eos_token_id == 1


def _run(tmp_path, *argv: str) -> dict:
    out = tmp_path / "tp.json"
    args = bt.build_parser().parse_args([*argv, "--out", str(out)])
    assert bt.main(args) == 0
    return json.loads(out.read_text())


def test_tiny_random_model_against_transformers(tmp_path, capsys):
    result = _run(tmp_path, "--model-config", json.dumps(TINY_CONFIG), "--num-prompts", "6",
                  "--random-input-len", "12", "--random-output-len", "6", "--random-range-ratio", "0.5",
                  "--compare-hf", "--hf-batch-size", "4", "--repeat", "2")
    w = result["workload"]
    assert w["num_requests"] == 6 and 6 * 6 <= w["input_tokens"] <= 6 * 18 and w["ignore_eos"]
    kv, hf = result["results"]
    assert kv["name"].startswith("kvserve (torch") and hf["name"].startswith("transformers generate")
    for r in (kv, hf):
        assert r["output_tokens"] == w["output_tokens"] and r["input_tokens"] == w["input_tokens"]
        assert len(r["runs_s"]) == 2 and r["elapsed_time"] > 0 and not r["notes"]
        assert r["output_tokens_per_second"] == pytest.approx(w["output_tokens"] / r["elapsed_time"])
        assert r["tokens_per_second"] == pytest.approx(r["total_num_tokens"] / r["elapsed_time"])
        assert r["requests_per_second"] == pytest.approx(6 / r["elapsed_time"])
    (name, ratio), = result["ratios"].items()
    assert ratio == pytest.approx(kv["output_tokens_per_second"] / hf["output_tokens_per_second"])
    table = capsys.readouterr().out
    assert "kvserve (torch" in table and "transformers generate (static batches of 4)" in table


def test_generate_batch_with_per_request_output_lengths(tmp_path):
    """W-A's shape (output lengths differ): transformers' continuous batching produces exactly the tokens
    asked of each request, through the manager that generate_batch wraps."""
    result = _run(tmp_path, "--model-config", json.dumps(TINY_CONFIG), "--num-prompts", "3",
                  "--random-input-len", "10", "--random-output-len", "4", "--random-range-ratio", "0.5",
                  "--compare-hf", "generate_batch", "--repeat", "1", "--no-warmup")
    w = result["workload"]
    kv, hf = result["results"]
    assert hf["name"] == "transformers generate_batch (its manager, per-request lengths)"
    assert hf["output_tokens"] == w["output_tokens"] == kv["output_tokens"] and not hf["notes"]
    assert w["output_tokens"] != 3 * 4  # the lengths really differ


def test_interleaved_rounds_alternate_the_systems(tmp_path, monkeypatch, capsys):
    """--interleave: every system loaded first, then rounds of one run each in turn; paired ratios are the
    median of the per-round ratios."""
    order = []
    real = bt.time_contenders

    def spy(contenders, w, repeat):
        for c in contenders:
            c.run_once = (lambda f, name: lambda: order.append(name) or f())(c.run_once, c.name)
        return real(contenders, w, repeat)

    monkeypatch.setattr(bt, "time_contenders", spy)
    result = _run(tmp_path, "--model-config", json.dumps(TINY_CONFIG), "--num-prompts", "3",
                  "--random-input-len", "8", "--random-output-len", "4", "--compare-hf", "--hf-batch-size", "4",
                  "--repeat", "3", "--interleave")
    kv, hf = result["results"]
    assert order == [kv["name"], hf["name"]] * 3
    assert result["interleave"] is True
    (pair, paired), = result["paired_ratios"].items()
    per_round = sorted(h / k for k, h in zip(kv["runs_s"], hf["runs_s"]))
    assert paired == pytest.approx(per_round[1])
    assert "median of per-round ratios" in capsys.readouterr().out


def test_text_dataset_on_a_model_directory(tmp_path, tiny_model_dir):
    jsonl = tmp_path / "w.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"Tell me about the number {i}.", "output_len": 3 + i}) + "\n"
                             for i in range(4)))
    result = _run(tmp_path, "--model", str(tiny_model_dir("qwen2")), "--dataset", str(jsonl), "--no-warmup")
    assert result["workload"]["output_tokens"] == 3 + 4 + 5 + 6
    (kv,) = result["results"]
    assert kv["output_tokens"] == 18 and not kv["notes"]


def test_bad_arguments_fail_cleanly(capsys):
    for argv in (["--compare-hf", "vllm"], ["--repeat", "0"],
                 ["--model", "/nonexistent/model"], ["--model", "x", "--model-config", "qwen2.5-0.5b"]):
        assert bt.main(bt.build_parser().parse_args(argv)) == 1
    assert "bench throughput:" in capsys.readouterr().err


def test_a_failing_backend_keeps_the_others_figures(tmp_path, capsys):
    """On this CPU `triton` cannot start: its failure is reported and torch's figures still come out."""
    result = _run(tmp_path, "--model-config", json.dumps(TINY_CONFIG), "--num-prompts", "3",
                  "--random-input-len", "8", "--random-output-len", "4", "--attention-backend", "triton,torch",
                  "--no-warmup")
    (kv,) = result["results"]
    assert kv["name"].startswith("kvserve (torch") and kv["output_tokens"] == result["workload"]["output_tokens"]
    err = capsys.readouterr().err
    assert "kvserve with triton failed" in err and "ValueError" in err


def test_prefix_caching_is_off_unless_asked():
    """Repetitions resend the same prompts: with the cache on they would time cache hits, not prefill."""
    parse = bt.build_parser().parse_args
    assert bt.engine_options(parse([]), "torch")["enable_prefix_caching"] is False
    assert "enable_prefix_caching" not in bt.engine_options(parse(["--prefix-caching"]), "torch")
    assert bt.engine_options(parse(["--no-prefix-caching"]), "torch")["enable_prefix_caching"] is False
