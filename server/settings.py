"""Server settings and the one option table behind flags, KVSERVE_* variables and YAML config files.

Precedence: dataclass defaults < config file < KVSERVE_* environment variables < command-line flags.
Every EngineConfig field and every ServerSettings field is an option under the same name
(`max_num_seqs` is `--max-num-seqs`, `KVSERVE_MAX_NUM_SEQS` and `max_num_seqs:` in YAML).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import yaml

from engine.config import BACKENDS, DEVICES, DTYPES, EngineConfig, need, usable_cores
from server.dispatch import POLICIES as DISPATCH_POLICIES

logger = logging.getLogger("kvserve.server")

ENV_PREFIX = "KVSERVE_"
# KVSERVE_* variables that are not options: the config file's path, and the loader's cache directory.
NOT_OPTIONS = (ENV_PREFIX + "CONFIG", ENV_PREFIX + "CACHE_DIR")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
EVENT_LOOPS = ("auto", "asyncio", "uvloop")


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: list[str] = field(default_factory=list)
    max_body_bytes: int = 4 << 20
    max_prompt_tokens: int | None = None
    max_tokens_cap: int | None = None
    max_n: int = 64
    max_logprobs: int = 20
    max_stop_sequences: int = 16
    max_stop_length: int = 256
    max_stop_token_ids: int = 64
    max_logit_bias: int = 1024
    max_messages: int = 1024
    max_detokenize_tokens: int = 65536
    max_response_logprobs: int = 1 << 18
    max_connections: int = 2048
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    write_timeout: float = 30.0
    tokenizer_workers: int = 2
    chat_parse_special_tokens: bool = False
    max_waiting_requests: int = 512
    max_waiting_tokens: int = 1 << 20
    queue_timeout: float | None = 300.0
    request_timeout: float | None = 1800.0
    shutdown_timeout: float = 30.0
    watchdog_timeout: float = 60.0
    retry_after: int = 1
    cors_origins: list[str] = field(default_factory=list)
    log_requests: bool = False
    log_level: str = "info"
    loop: str = "auto"  # the front ends' event loop: uvicorn's choice (auto: uvloop when installed)
    api_server_count: int | None = None  # None: default_api_server_count()
    stream_interval: int = 1
    data_parallel_size: int = 1
    data_parallel_dispatch: str = "affinity"
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral | auto (server/tool_parsers.py)
    reasoning_parser: bool = False  # split <think>...</think> into reasoning_content
    chat_template: str | None = None  # a Jinja template, or the path of a file holding one
    trust_request_chat_template: bool = False  # let requests send their own chat_template (a Jinja program)

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):  # one name, or several comma-separated
            self.served_model_name = [n.strip() for n in self.served_model_name.split(",") if n.strip()]
        self.validate()

    def validate(self) -> None:
        need(0 < self.port < 65536, f"port must be in [1, 65535], got {self.port}")
        need(self.api_key is None or len(self.api_key) > 0, "api_key must not be empty")
        for name in ("max_body_bytes", "max_n", "max_stop_sequences", "max_stop_length", "max_waiting_requests",
                     "max_waiting_tokens", "max_logit_bias", "max_messages", "max_detokenize_tokens",
                     "max_response_logprobs", "max_connections", "tokenizer_workers"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1")
        for name in ("max_prompt_tokens", "max_tokens_cap"):
            need(getattr(self, name) is None or getattr(self, name) >= 1, f"{name} must be >= 1 or null")
        need(0 <= self.max_logprobs <= 20, "max_logprobs must be in [0, 20]")
        for name in ("queue_timeout", "request_timeout"):
            value = getattr(self, name)
            need(value is None or (math.isfinite(value) and value > 0), f"{name} must be > 0 or null")
        for name in ("shutdown_timeout", "watchdog_timeout"):
            need(math.isfinite(getattr(self, name)) and getattr(self, name) >= 0, f"{name} must be >= 0")
        need(self.max_stop_token_ids >= 0, "max_stop_token_ids must be >= 0")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "write_timeout"):
            need(math.isfinite(getattr(self, name)) and getattr(self, name) > 0, f"{name} must be > 0")
        need(all(self.served_model_name), "served_model_name: names must not be empty")
        need(self.retry_after >= 0, "retry_after must be >= 0")
        need(self.log_level in LOG_LEVELS, f"log_level must be one of {LOG_LEVELS}")
        need(self.loop in EVENT_LOOPS, f"loop must be one of {EVENT_LOOPS}")
        need(self.api_server_count is None or 1 <= self.api_server_count <= 64, "api_server_count must be in [1, 64]")
        need(self.stream_interval >= 1, "stream_interval must be >= 1")
        need(1 <= self.data_parallel_size <= 64, "data_parallel_size must be in [1, 64]")
        need(self.data_parallel_dispatch in DISPATCH_POLICIES,
             f"data_parallel_dispatch must be one of {DISPATCH_POLICIES}")
        need(self.tool_call_parser in (None, "hermes", "llama3_json", "mistral", "auto"),
             "tool_call_parser must be one of hermes, llama3_json, mistral, auto")

    @property
    def num_api_servers(self) -> int:
        return self.api_server_count or default_api_server_count()


def default_api_server_count(cores: int | None = None) -> int:
    """One front-end process per 4 usable cores (engine.config.usable_cores: a CPU quota counts), 1 to 4: the
    engine core needs a core of its own, and on the H200 host (16 cores) vLLM's server scaled up to 4 front
    ends (docs/benchmarks.md). 2 cores: 1."""
    cores = cores or usable_cores()
    return max(1, min(4, cores // 4))


ENGINE_HELP = {
    "model": "model directory, Hugging Face hub id (from the local cache) or .gguf file; "
             "default: the embedded SmolLM2-135M-Instruct",
    "tokenizer": "tokenizer directory (default: the model's)",
    "dtype": f"weights and activations dtype {DTYPES}; auto = bfloat16 on GPU, float32 on CPU",
    "device": f"device {DEVICES}; auto = cuda when available",
    "block_size": "tokens per KV-cache block (a power of two); default: the attention backend's, 16, or 128 "
                  "with flash-attn-4 on Hopper (its pages then load by TMA)",
    "num_kv_blocks": "KV-cache blocks; default: sized from kv_cache_memory_bytes (CPU) or gpu_memory_utilization",
    "kv_cache_memory_bytes": "bytes of KV cache on CPU when num_kv_blocks is not set",
    "gpu_memory_utilization": "fraction of GPU memory kvserve may use (weights + KV cache + activations)",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "most tokens in one step (prefill chunks + decodes); default: 8192 on a GPU, 2048 "
                              "on the CPU",
    "max_model_len": "longest prompt + output, tokens; default: the model's max_position_embeddings",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "attention_backend": f"attention backend {BACKENDS}; auto picks the fastest that supports the model",
    "enforce_eager": "no CUDA graphs",
    "cpu_packed_weights": "float32 CPU matmuls through oneDNN-packed weights (~2x faster than F.linear; "
                          "--no-cpu-packed-weights for F.linear)",
    "seed": "engine seed (unseeded requests draw from it)",
    "grammar_max_size": "structured outputs: most symbols in a request's grammar (beyond: 400 invalid_grammar)",
    "grammar_compile_fuel": "structured outputs: lexer fuel to build a grammar, ~50k units a millisecond "
                            "(beyond: 400 invalid_grammar)",
    "grammar_xgrammar_repeats": "structured outputs: a regex whose bounded repeat counts multiply past this along "
                                "one nesting chain is compiled by llguidance, not xgrammar (which unrolls them)",
    "grammar_xgrammar_nested_repeats": "structured outputs: the same for a chain of two or more nested bounded "
                                       "repeats of which one varies (`([a-z]{1,30}){1,30}`: 900)",
    "structured_outputs_backend": "structured outputs' masks: auto (xgrammar for JSON schemas and regexes when "
                                  "installed, llguidance otherwise and for Lark/GBNF grammars and choices), "
                                  "xgrammar (the same, xgrammar required), guidance (llguidance for all)",
    "structured_outputs_wait": "structured outputs: who waits for a step's grammar masks: device (the step is "
                               "queued whole and the GPU waits; needs the grammar process), pipeline (the host "
                               "samples it once the next step is scheduled and staged), step (the host samples it "
                               "at once), auto (device where it can, else pipeline); default pipeline",
    "structured_outputs_process": "structured outputs: keep the grammar matchers in a process of their own, off the "
                                  "engine's GIL (default: on with a GPU)",
    "structured_outputs_processes": "structured outputs: how many grammar processes share the matchers, each "
                                    "consuming and filling its own rows at once (default: one per 4 host cores, "
                                    "at most 4)",
    "structured_outputs_fill_threads": "structured outputs: xgrammar's mask-fill threads in each grammar process "
                                       "(default: half the host's cores shared among the processes)",
    "structured_outputs_spin_ms": "structured outputs: how long the engine polls for a step's grammar masks before "
                                  "it blocks, in ms (default: 3 on hosts of 8 or more cores, else 0)",
    "step_trace": "append a CSV line per engine step to this file (its rows, prefill rows, tokens, running and "
                  "waiting requests: engine/step_trace.py), for benchmarks",
}

SERVER_HELP = {
    "host": "address to bind (127.0.0.1: loopback only; 0.0.0.0: every interface)",
    "port": "port to bind",
    "api_key": "require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize",
    "served_model_name": "model name(s) clients may send, comma- or space-separated; the first is the one "
                         "responses and /v1/models report (default: from the model path, e.g. "
                         "SmolLM2-135M-Instruct)",
    "max_body_bytes": "largest request body, bytes (413 beyond it, checked while the body streams in)",
    "max_prompt_tokens": "longest prompt, tokens (default: max_model_len)",
    "max_tokens_cap": "largest max_tokens a request may ask for (default: no cap beyond max_model_len)",
    "max_n": "largest n (completions per prompt) times the number of prompts in one request",
    "max_logprobs": "largest logprobs / top_logprobs (<= 20)",
    "max_stop_sequences": "most stop strings in one request",
    "max_stop_length": "longest stop string, characters",
    "max_stop_token_ids": "most stop_token_ids in one request",
    "max_logit_bias": "most logit_bias entries in one request",
    "max_messages": "most chat messages in one request",
    "max_detokenize_tokens": "most token ids one /detokenize request may send",
    "max_response_logprobs": "most logprob entries one response may carry: n x max_tokens x (logprobs + 1), "
                             "max_tokens counted as max_model_len when omitted (~60 bytes of JSON each)",
    "max_connections": "most open HTTP connections per front-end process (lowered to fit the open-file limit); "
                       "beyond it a new connection gets 503 and is closed",
    "header_timeout": "seconds a connection may take to send a request's headers (from opening, or from the "
                      "previous response); then 408 and the connection closes",
    "body_timeout": "seconds a request's body may take to arrive after its headers; then the connection closes",
    "keep_alive_timeout": "seconds an idle keep-alive connection stays open between requests",
    "write_timeout": "seconds a response may wait for a client that reads nothing (its writes blocked); then "
                     "the connection is dropped and its request aborted",
    "tokenizer_workers": "threads per front end that tokenize prompts (off the event loop); queued work is "
                         "dropped when its client leaves",
    "chat_parse_special_tokens": "tokenize control tokens written inside chat message text as control tokens "
                                 "(trusted callers only); off: message text is always text, so a user cannot "
                                 "open a system turn",
    "max_waiting_requests": "most completions waiting for their first token; beyond it 429 overloaded",
    "max_waiting_tokens": "most prompt tokens waiting for their first token; beyond it 429 overloaded",
    "queue_timeout": "seconds a request may wait for its first token (queue + prefill); null: no limit",
    "request_timeout": "seconds a request may take in total (requests may ask for less with 'timeout'); "
                       "null: no limit",
    "shutdown_timeout": "on SIGTERM, seconds in-flight requests get to finish before they are aborted",
    "watchdog_timeout": "seconds without engine progress while work is pending before /health reports 503",
    "retry_after": "Retry-After seconds sent with 429 / 503",
    "cors_origins": "comma-separated origins allowed by CORS (default: CORS off)",
    "log_requests": "log prompts and outputs (off by default: they may be private)",
    "log_level": f"log level {LOG_LEVELS}",
    "loop": f"front ends' event loop {EVENT_LOOPS}; auto = uvloop when installed, else asyncio's own",
    "api_server_count": "HTTP front-end processes sharing the one engine core (each stream is served by one); "
                        "default: cores // 4, between 1 and 4",
    "data_parallel_size": "engine-core processes, each a whole copy of the model (one GPU each on CUDA); every "
                          "front end sends each request to one of them",
    "data_parallel_dispatch": "how requests are spread over the engine cores: affinity (the core that has the "
                              "prompt's prefix cached, unless it is much busier) or round_robin",
    "stream_interval": "tokens per SSE chunk of a completion (the last chunk may hold fewer); a stream that "
                       "falls behind gets every waiting token in one chunk whatever this is",
    "tool_call_parser": "how tool calls are read from replies: hermes (Qwen), llama3_json, mistral, or auto "
                        "(from the chat template); needed for tool_choice auto",
    "reasoning_parser": "split <think>...</think> (Qwen3, DeepSeek-R1) into reasoning_content",
    "chat_template": "a Jinja chat template (or a file holding one) used instead of the model's",
    "trust_request_chat_template": "let a chat request send its own chat_template (a Jinja program the server "
                                   "runs; off: such a request is a 400 unsupported, as in vLLM)",
}


@dataclass
class Option:
    name: str
    kind: str  # "str" | "int" | "float" | "bool" | "list"
    nullable: bool
    default: object
    help: str
    target: str  # "engine" | "server"


def _options_of(cls, helps: dict[str, str], target: str) -> list[Option]:
    out = []
    for f in fields(cls):
        ann = str(f.type)
        kind = "list" if ann.startswith("list") else next(k for k in ("bool", "int", "float", "str") if k in ann)
        default = f.default_factory() if f.default is MISSING else f.default
        out.append(Option(f.name, kind, "None" in ann, default, helps.get(f.name, f.name), target))
    return out


def all_options() -> list[Option]:
    return _options_of(EngineConfig, ENGINE_HELP, "engine") + _options_of(ServerSettings, SERVER_HELP, "server")


def parse_text(opt: Option, text: str):
    """A flag or environment value (always a string) -> the option's type."""
    if opt.nullable and text.strip().lower() in ("", "none", "null"):
        return None
    if opt.kind == "bool":
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{opt.name}: expected a boolean, got {text!r}")
    if opt.kind == "list":
        return [s.strip() for s in text.split(",") if s.strip()]
    try:
        return {"int": int, "float": float, "str": str}[opt.kind](text)
    except ValueError:
        raise ValueError(f"{opt.name}: expected {opt.kind}, got {text!r}") from None


def check_yaml_value(opt: Option, value):
    """A YAML value (already typed) -> the option's type, strictly (no 'true' for 1, no 5.5 for an int)."""
    if value is None and opt.nullable:
        return None
    if isinstance(value, str) and opt.kind not in ("str", "list"):
        return parse_text(opt, value)
    ok = {"bool": lambda v: isinstance(v, bool),
          "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "str": lambda v: isinstance(v, str),
          "list": lambda v: isinstance(v, (list, str))}[opt.kind]
    if not ok(value):
        raise ValueError(f"{opt.name}: expected {opt.kind}, got {value!r}")
    if opt.kind == "list" and isinstance(value, str):
        return parse_text(opt, value)
    return float(value) if opt.kind == "float" else value


def read_config_file(path: str | os.PathLike, options: dict[str, Option]) -> dict:
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file is a mapping of option names to values")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in options:
            raise ValueError(f"{path}: unknown option {key!r}; known: {', '.join(sorted(options))}")
        out[name] = check_yaml_value(options[name], value)
    return out


def read_env(env: dict[str, str], options: dict[str, Option]) -> dict:
    out = {}
    for key, text in env.items():
        if not key.startswith(ENV_PREFIX) or key in NOT_OPTIONS:
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name in options:
            out[name] = parse_text(options[name], text)
        else:
            logger.warning("ignoring %s: no option %r", key, name)
    return out


def resolve(flags: dict, env: dict[str, str] | None = None) -> tuple[EngineConfig, ServerSettings]:
    """flags: the options given on the command line (plus 'config'). Returns the validated configs."""
    env = dict(os.environ) if env is None else env
    options = {o.name: o for o in all_options()}
    values = {name: opt.default for name, opt in options.items()}
    config_path = flags.get("config") or env.get(ENV_PREFIX + "CONFIG")
    if config_path:
        values.update(read_config_file(config_path, options))
    values.update(read_env(env, options))
    values.update({k: v for k, v in flags.items() if k in options})
    engine = EngineConfig(**{k: v for k, v in values.items() if options[k].target == "engine"})
    server = ServerSettings(**{k: v for k, v in values.items() if options[k].target == "server"})
    return engine, server
