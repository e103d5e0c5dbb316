"""`igserve prepare`: convert a packaged model into the safetensors cache ahead of serving."""

from __future__ import annotations

from server import models


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=models.DEFAULT_MODEL, help="packaged model name or HF directory")


def run(args) -> int:
    try:
        path = models.prepare(args.model)
    except models.ModelLoadError as exc:
        print(f"error: {exc}")
        return 1
    print(f"{args.model}: {path}")
    return 0
