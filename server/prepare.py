"""`igserve prepare`: convert a packaged model into the safetensors cache and build igserve's CPU
kernels, ahead of serving (so start-up pays neither)."""

from __future__ import annotations

from server import cpu_kernels, models


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=models.DEFAULT_MODEL, help="packaged model name or HF directory")


def run(args) -> int:
    try:
        path = models.prepare(args.model)
    except models.ModelLoadError as exc:
        print(f"error: {exc}")
        return 1
    print(f"{args.model}: {path}")
    print(f"native CPU kernels: {'ready' if cpu_kernels.available() else 'not available (torch kernels serve)'}")
    return 0
