"""`kvserve` command line and configuration: precedence, strict values, shipped configs, --help."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from server.cli import build_parser, main
from server.settings import ServerSettings, all_options, resolve

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def flags(*argv: str) -> dict:
    args = build_parser(["serve", *argv]).parse_args(["serve", *argv])
    return {k: v for k, v in vars(args).items() if k != "command"}


def test_precedence_defaults_file_env_flags(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_num_seqs: 8\nport: 9001\nblock_size: 32\nlog_requests: true\n")
    env = {"KVSERVE_PORT": "9002", "KVSERVE_BLOCK_SIZE": "64"}
    engine, server = resolve(flags("--config", str(cfg), "--block-size", "8"), env)
    assert engine.max_num_seqs == 8  # file over default
    assert server.port == 9002  # env over file
    assert engine.block_size == 8  # flag over env
    assert server.log_requests is True
    assert engine.max_num_batched_tokens is None  # untouched default: the engine's, by device
    assert server.host == "127.0.0.1"  # loopback unless asked


def test_config_path_from_env_and_nullable_values(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num_kv_blocks: 100\nrequest_timeout: null\ncors_origins: [http://a.example]\n")
    engine, server = resolve({}, {"KVSERVE_CONFIG": str(cfg), "KVSERVE_QUEUE_TIMEOUT": "none"})
    assert engine.num_kv_blocks == 100
    assert server.request_timeout is None and server.queue_timeout is None
    assert server.cors_origins == ["http://a.example"]
    _, server = resolve(flags("--cors-origins", "http://a.example,http://b.example", "--no-log-requests"), {})
    assert server.cors_origins == ["http://a.example", "http://b.example"] and server.log_requests is False


@pytest.mark.parametrize("text,message", [
    ("max_num_seqs: 8\nfrobnicate: 1\n", "unknown option 'frobnicate'"),
    ("max_num_seqs: 5.5\n", "max_num_seqs: expected int"),
    ("enable_prefix_caching: 1\n", "enable_prefix_caching: expected bool"),
    ("port: 70000\n", "port must be in"),
    ("dtype: float64\n", "dtype must be one of"),
    ("loop: trio\n", "loop must be one of"),
    ("structured_outputs_processes: 0\n", "structured_outputs_processes must be >= 1"),
    ("structured_outputs_fill_threads: 0\n", "structured_outputs_fill_threads must be >= 1"),
    ("structured_outputs_spin_ms: -1\n", r"structured_outputs_spin_ms must be in \[0, 100\]"),
    ("- a\n- b\n", "mapping"),
])
def test_bad_config_files_are_refused(tmp_path, text, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ValueError, match=message):
        resolve({"config": str(cfg)}, {})


def test_bad_env_values_are_refused():
    with pytest.raises(ValueError, match="max_n: expected int"):
        resolve({}, {"KVSERVE_MAX_N": "lots"})
    with pytest.raises(ValueError, match="expected a boolean"):
        resolve({}, {"KVSERVE_ENFORCE_EAGER": "maybe"})


def test_main_reports_config_errors_with_exit_2(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("no_such_option: 1\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "unknown option" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["default.yaml", "qwen2.5-0.5b-gpu.yaml"])
def test_shipped_configs_load(name):
    engine, server = resolve({"config": str(CONFIGS / name)}, {})
    assert isinstance(engine, EngineConfig) and isinstance(server, ServerSettings)
    assert server.host == "127.0.0.1"


def test_default_config_is_the_embedded_model_on_cpu():
    engine, _ = resolve({"config": str(CONFIGS / "default.yaml")}, {})
    assert engine.model is None and engine.device == "cpu"


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for opt in all_options():
        assert "--" + opt.name.replace("_", "-") in text, opt.name
    assert "--config" in text and "KVSERVE_" in text
    for field in EngineConfig.field_names():
        assert "--" + field.replace("_", "-") in text


def test_bench_subcommands_are_wired(capsys):
    for name in ("serve", "throughput"):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", name, "--help"])
        assert exit_info.value.code == 0
        assert f"kvserve bench {name}" in capsys.readouterr().out


def test_thread_and_process_defaults_follow_the_cpu_quota(monkeypatch):
    """Under a CPU limit (8 usable cores on a node of 96), the defaults count the 8: two front ends, seven
    torch threads for a CPU engine core, and with two data-parallel cores three threads each."""
    import os

    import server.launcher as launcher
    from engine import config as engine_config
    from engine.core import process
    from server.settings import default_api_server_count

    monkeypatch.setattr(os, "cpu_count", lambda: 96)
    monkeypatch.setattr(engine_config, "usable_cores", lambda: 8)
    monkeypatch.setattr("server.settings.usable_cores", lambda: 8)
    monkeypatch.setattr(launcher, "usable_cores", lambda: 8)
    assert default_api_server_count() == 2 and default_api_server_count(16) == 4
    assert process.cpu_threads(None) == 7 and process.cpu_threads(3) == 3
    specs = []
    monkeypatch.setattr(launcher, "start_engine_core", lambda spec: specs.append(spec) or spec)
    _, server = resolve(flags("--data-parallel-size", "2", "--device", "cpu"), {})
    launcher.start_engine_cores(EngineConfig(model="m", device="cpu"), server, 1)
    assert [spec.cpu_threads for spec in specs] == [3, 3]
