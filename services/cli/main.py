"""``tokenmill``: one command line for the whole project.

    tokenmill up                         start the four services (and the gateway) with the default model, stream a demo
    tokenmill gateway --config FILE      the gateway alone: OpenAI-compatible HTTP + routed gRPC over engines
    tokenmill generate "PROMPT"          stream a completion from a running stack (or --in-process)
    tokenmill serve SERVICE              run one service (tokenizer, scheduler, executor, drafter, gateway)
    tokenmill convert llama2c ...        convert a llama2.c checkpoint to a Hugging Face-style directory
    tokenmill quantize DIR --weights int8|int4 --out DIR2   weight-only quantization of a model directory
    tokenmill random-model ...           write a deterministic random-weight model (benchmarks)
    tokenmill profile                    print the live latency profile of a running stack
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, help). Modules are imported lazily so `tokenmill --help` is instant
# and a subcommand never pays for another's imports (torch, grpc, triton).
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("services.cli.up", "start the services and the gateway locally, stream a demo, serve until Ctrl-C"),
    "gateway": ("services.gateway.main", "run the gateway alone: OpenAI-compatible HTTP and routed gRPC over "
                                         "engines (--config FILE)"),
    "generate": ("services.cli.generate", "stream a completion (from a running stack, or --in-process)"),
    "serve": ("services.cli.serve", "run one service: tokenizer, scheduler, executor or drafter"),
    "convert": ("services.cli.convert", "convert a checkpoint into tokenmill's model directory format"),
    "quantize": ("services.tools.quantize", "quantize a safetensors model's weights to int8 or int4"),
    "random-model": ("services.tools.random_model", "write a deterministic random-weight model"),
    "profile": ("services.cli.profile", "print the live latency profile of a running stack"),
}


MOVED = {
    "bench": "the benchmarks are not part of the installed package: in a checkout of the repository, "
             "run `python -m benchmarks serving --preset headline` (make bench; `python -m benchmarks` lists every run)",
}
"""Commands that left the CLI, and where they went."""


def usage() -> str:
    lines = ["usage: tokenmill COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<14} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `tokenmill COMMAND --help` for a command's flags and environment variables."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command in MOVED:
        print(f"tokenmill {command}: {MOVED[command]}", file=sys.stderr)
        return 2
    if command not in COMMANDS:
        print(f"tokenmill: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
