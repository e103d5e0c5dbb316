"""`python -m masks.batching`: how much of the budget a mixed decode batch can still skip.

A batch runs every block that any of its rows keeps, so what a batch of routed requests saves is
the blocks all their masks skip. For each bank, method and budget this routes the benchmark
prompts (``load/prompts.jsonl``) and reports, over seeded batches of ``--batch`` prompts, the
blocks every mask of the batch skips as a fraction of the budget's skipped blocks (1.0: the batch
saves the full budget; the ideal-speedup ratio follows from it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from masks.bank import MaskBank
from masks.pool import shared_skips


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--banks", type=Path, nargs="+", required=True)
    parser.add_argument("--prompts", type=Path, default=Path("load/prompts.jsonl"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=200, help="seeded random batches")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)


def union_skip(masks: list[torch.Tensor], batch: int, rounds: int, seed: int) -> dict:
    """Shared skipped blocks / skipped blocks per mask, for the first ``batch`` masks and seeded batches."""
    per_mask = int((~masks[0]).sum())
    rng = random.Random(seed)
    draws = [shared_skips(rng.sample(masks, min(batch, len(masks)))) for _ in range(rounds)]
    return {"skipped_per_mask": per_mask, "first_batch_shared": shared_skips(masks[:batch]),
            "first_batch_fraction": shared_skips(masks[:batch]) / per_mask,
            "mean_shared": sum(draws) / rounds, "mean_fraction": sum(draws) / rounds / per_mask,
            "distinct_masks": len({tuple(m.tolist()) for m in masks})}


def measure(bank: MaskBank, texts: list[str], batch: int, rounds: int, seed: int, lm=None) -> dict:
    """``lm``: the LM's token table (router.lm_features), for a learned router that reads it."""
    from router.predictor import KINDS
    from router.router import Router

    routers = {"centroid": Router(bank, method="centroid", ood=False)}
    if bank.router.get("kind") in KINDS:
        routers["learned"] = Router(bank, lm=lm)
    out = {}
    for name, router in routers.items():
        for s in bank.budget_list():
            ids = [r.mask_id for r in router.route(texts, budgets=[s] * len(texts))]
            out[f"{name}@{s:g}"] = {**union_skip([bank.mask(i) for i in ids], batch, rounds, seed),
                                    "masks_used": {m: ids.count(m) for m in sorted(set(ids))}}
    return out


def _token_table(bank: MaskBank):
    """The bank's LM's token table where its learned router reads it (router.lm_features), else None."""
    if "lm_features" not in bank.router:
        return None
    from router.lm_features import TokenTable
    from server import models

    lm = models.load(bank.model["name"])
    bank.check_model(lm.fingerprint, len(bank.blocks))
    return TokenTable.of(lm)


def run(args: argparse.Namespace) -> int:
    from server.weights import cpu_flags

    texts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    report = {"command": args.invocation, "prompts": str(args.prompts),
              "n_prompts": len(texts), "batch": args.batch, "rounds": args.rounds, "cpu_flags": cpu_flags(),
              "banks": {str(p): measure(bank, texts, args.batch, args.rounds, args.seed, _token_table(bank))
                        for p, bank in ((p, MaskBank.load(p)) for p in args.banks)}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    for bank, rows in report["banks"].items():
        for name, r in rows.items():
            print(f"{Path(bank).name:40s} {name:16s} shared {r['mean_shared']:5.2f}/{r['skipped_per_mask']} "
                  f"({r['mean_fraction']:.2f}), first batch {r['first_batch_shared']}")
    return 0


if __name__ == "__main__":
    from server.cli import run_module

    raise SystemExit(run_module(sys.modules[__name__], sys.argv[1:]))
