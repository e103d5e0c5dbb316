"""`igserve` command line: dispatches each subcommand to the module that owns it.

Each module named here exposes ``add_arguments(parser)`` and ``run(args) -> int | None``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys

# (words, module, help); the longest matching words win, so "eval zeroshot" beats "eval".
COMMANDS = [
    (("prepare",), "server.prepare", "convert the packaged model into the local safetensors cache"),
    (("serve",), "server.api", "start the OpenAI-compatible server"),
    (("bench", "decode"), "bench.decode", "decode/prefill throughput per weight format: HF generate vs the runner"),
    (("bench", "serve"), "bench.serve", "concurrent streaming clients against a running server"),
    (("bench", "compare"), "bench.compare", "igserve against llama.cpp's llama-server, same clients and prompts"),
    (("bench", "kernels"), "bench.kernels", "ms per decode step of each linear family, per weight format and rows"),
    (("bench", "itl"), "bench.itl", "inter-token latency of running streams while long prompts arrive"),
    (("bench", "reliability"), "bench.reliability", "/health latency and memory while a huge body is refused"),
    (("bench", "quality"), "bench.quality", "held-out perplexity and greedy agreement per weight format"),
    (("bench", "report"), "bench.report", "render bench/REPORT.md and plots from bench/results/"),
    (("masks", "build"), "masks.build", "cluster a calibration corpus and learn one block mask per cluster"),
    (("eval", "zeroshot"), "masks.zeroshot", "zero-shot multiple-choice accuracy of dense, IG and static masks"),
    (("eval",), "masks.evaluate", "perplexity and KL-to-dense per domain of dense, IG and static masks"),
]


def _usage() -> str:
    lines = ["usage: igserve <command> [options]", "", "commands:"]
    lines += [f"  {' '.join(words):<15} {text}" for words, _, text in COMMANDS]
    return "\n".join(lines)


def run_module(module, argv: list[str], prog: str | None = None, description: str | None = None) -> int:
    """Parse ``argv`` with the module's ``add_arguments`` and call its ``run``; also what
    ``python -m`` runs for the modules that are no ``igserve`` subcommand. ``args.invocation`` is
    the command line as typed, for the ``command`` field of the reports."""
    prog = prog or f"python -m {getattr(module.__spec__, 'name', module.__name__)}"
    parser = argparse.ArgumentParser(prog=prog, description=description or module.__doc__.splitlines()[0])
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    args.invocation = " ".join([prog, *map(shlex.quote, argv)])
    return module.run(args) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for words, module_name, text in sorted(COMMANDS, key=lambda c: -len(c[0])):
        if tuple(argv[: len(words)]) == words:
            module = importlib.import_module(module_name)
            return run_module(module, argv[len(words):], "igserve " + " ".join(words), text)
    print(_usage(), file=sys.stderr)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main())
