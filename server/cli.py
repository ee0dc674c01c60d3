"""`kvserve serve` and `kvserve bench serve|throughput`.

Options come from, lowest to highest precedence: defaults, a YAML config file (--config or KVSERVE_CONFIG),
KVSERVE_* environment variables, command-line flags. SIGTERM / SIGINT drain: new requests get 503 and /ready
turns 503, requests in flight get --shutdown-timeout seconds, the rest are aborted; the process exits 0.
A second signal aborts everything at once. The processes this starts: server/launcher.py.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys


from server.settings import ENV_PREFIX, Option, all_options, parse_text, resolve

logger = logging.getLogger("kvserve.server")

BENCH_COMMANDS = {"serve": ("bench.serve", "load-test a running OpenAI-compatible server"),
                  "throughput": ("bench.throughput", "offline throughput of the engine")}
_EPILOG = """\
Precedence: defaults < --config FILE (or KVSERVE_CONFIG) < KVSERVE_<OPTION> environment variables < flags.
YAML config files use the option names with underscores, e.g. `max_num_seqs: 64`.
"""


class _JoinLists(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [item for value in values for item in value])


def _flag(opt: Option) -> str:
    return "--" + opt.name.replace("_", "-")


def _add_option(group, opt: Option) -> None:
    env = ENV_PREFIX + opt.name.upper()
    default = "unset" if opt.default is None else opt.default
    help_text = f"{opt.help} (default: {default}; env {env})"
    if opt.kind == "list":  # comma- or space-separated, as vLLM's --served-model-name a b
        group.add_argument(_flag(opt), dest=opt.name, default=argparse.SUPPRESS, metavar="VALUE", nargs="+",
                           action=_JoinLists, type=lambda text, o=opt: parse_text(o, text), help=help_text)
    elif opt.kind == "bool":
        group.add_argument(_flag(opt), dest=opt.name, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=help_text)
    else:
        group.add_argument(_flag(opt), dest=opt.name, default=argparse.SUPPRESS, metavar=opt.kind.upper(),
                           type=lambda text, o=opt: parse_text(o, text), help=help_text)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE",
                        help="YAML file of options, e.g. configs/default.yaml (env KVSERVE_CONFIG)")
    groups = {"engine": parser.add_argument_group("engine options"),
              "server": parser.add_argument_group("server options")}
    for opt in all_options():
        _add_option(groups[opt.target], opt)


def _add_bench(bench_sub, name: str, argv: list[str]) -> None:
    module_name, summary = BENCH_COMMANDS[name]
    parser = bench_sub.add_parser(name, help=summary, description=summary)
    if argv[:2] != ["bench", name]:
        return  # its options are loaded only when this command runs: a bench module may be heavy
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        parser.description = f"{summary} (unavailable: {exc})"
        return
    module.add_arguments(parser)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: a paged-KV LLM inference server",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server", epilog=_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Start the OpenAI-compatible server (binds 127.0.0.1:8000 by default).")
    add_serve_arguments(serve)
    bench = sub.add_parser("bench", help="benchmarks: `kvserve bench serve|throughput --help`")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name in BENCH_COMMANDS:
        _add_bench(bench_sub, name, argv)
    parser.epilog = "`kvserve serve` options:\n\n" + serve.format_help()
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    if args.command == "bench":
        module_name = BENCH_COMMANDS[args.bench_command][0]
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            print(f"kvserve bench {args.bench_command} is not available: {exc}", file=sys.stderr)
            return 2
        return int(module.main(args) or 0)
    flags = {k: v for k, v in vars(args).items() if k != "command"}
    try:
        engine_config, settings = resolve(flags)
    except (ValueError, OSError) as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_server(engine_config, settings)


def run_server(engine_config, settings) -> int:
    from server.launcher import run_server as launch

    return launch(engine_config, settings)
