"""`python -m masks.learn_router`: a multi-budget bank with a learned router, from a built bank.

Steps: candidate pool at every budget (``masks.pool``: prefixes of the built bank's greedy orders,
static masks, optional shared-core masks, the cluster masks of banks built at other k) -> labels:
each sampled training document's loss under every candidate (``masks.labels``, cached) -> a
per-candidate loss predictor over the routing inputs (the encoder's embedding and the LM's
token-table features: ``router.predictor``, ``router.lm_features``), chosen by cross-validation on
the training labels only -> OOD threshold from the calibration documents' centroid distances -> a
format-2 bank (``masks.bank``; format 3 where the predictor reads the LM's features).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from masks.bank import MaskBank
from masks.corpus import load_texts
from masks.labels import score_documents
from masks.pool import candidate_pool, more_cluster_masks

DEFAULT_CACHE = Path("data/labels-cache")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from server.models import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--bank", type=Path, required=True, help="built bank whose greedy orders give the pool")
    parser.add_argument("--budgets", default="0.125,0.25", help="comma-separated sparsities the new bank holds")
    parser.add_argument("--default-budget", type=float, help="budget of requests that ask for none (default: the bank's)")
    parser.add_argument("--cores", default="", help="shared-core candidates, budget:blocks,... (e.g. 0.25:10)")
    parser.add_argument("--more-clusters", type=Path, nargs="*", default=[],
                        help="banks built from the same data at other cluster counts: their cluster masks join the pool")
    parser.add_argument("--data", type=Path, default=Path("data/corpus/train"), help="training documents (labels)")
    parser.add_argument("--docs-per-domain", type=int, default=20, help="seeded sample of each domain for labels")
    parser.add_argument("--max-len", type=int, default=64, help="tokens scored per label document")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--ood-quantile", type=float, default=0.95,
                        help="calibration distance quantile beyond which a request falls back to the global mask")
    parser.add_argument("--predictor", help="a predictor spec (e.g. knn=20, knn=20+lm:ridge=1: router.predictor) "
                        "instead of the cross-validated choice")
    parser.add_argument("--no-lm-features", action="store_true",
                        help="route on the encoder's embedding only (no LM token-table input: a format-2 bank)")
    parser.add_argument("--out", type=Path, help="format-2 bank to write (without it: labels only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights", default="fp32", help="weight format the labels are scored in (fp32, bf16, ...)")
    parser.add_argument("--dtype", default="auto", help="activations (auto: as the server picks for the format; "
                        "the shipped routed banks' bf16 labels were scored with bfloat16)")
    parser.add_argument("--threads", type=int, default=2)


def label_documents(data: Path, per_domain: int, seed: int) -> list[dict]:
    """A seeded sample of ``per_domain`` documents of every domain file (id, domain, text)."""
    docs = []
    for p in sorted(data.glob("*.jsonl")):
        rows = load_texts(p)
        docs += [{**d, "domain": p.stem} for d in random.Random(f"{seed}-{p.stem}").sample(rows, min(per_domain, len(rows)))]
    return docs


def make_labels(lm, runner, docs: list[dict], pool: dict[str, dict], max_len: int, batch_size: int,
                cache: Path) -> dict:
    """Scores of every label document under dense and every candidate (see ``masks.labels``)."""
    masks = {"dense": torch.ones(runner.num_blocks, dtype=torch.bool), **{k: v["mask"] for k, v in pool.items()}}
    return score_documents(runner, lm.tokenizer, lm.fingerprint, [d["text"] for d in docs], masks, max_len,
                           batch_size, cache, kl=False, weights=lm.weights)


def parse_cores(text: str) -> dict[float, int]:
    return {float(s): int(n) for s, n in (kv.split(":") for kv in text.split(",") if kv)}


def run(args: argparse.Namespace) -> int:
    from server import models
    from server.runner import BlockRunner

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    lm = models.load(args.model, dtype=models.resolve_weights(args.weights, args.dtype)[1], weights=args.weights)
    source = MaskBank.load(args.bank)
    runner = BlockRunner(lm.model, max_batch=1, max_len=args.max_len)
    source.check_model(lm.fingerprint, runner.num_blocks)
    budgets = [float(s) for s in args.budgets.split(",")]
    pool = candidate_pool(source, budgets, parse_cores(args.cores))
    others = [MaskBank.load(p) for p in args.more_clusters]
    for path, other in zip(args.more_clusters, others):
        other.check_model(lm.fingerprint, runner.num_blocks)
        if other.training.get("data") != source.training.get("data"):
            raise SystemExit(f"error: {path}: not built from the same data as {args.bank}")
    added = more_cluster_masks(pool, others, budgets)
    docs = label_documents(args.data, args.docs_per_domain, args.seed)
    labels = make_labels(lm, runner, docs, pool, args.max_len, args.batch_size, args.cache)
    label_seconds = round(time.perf_counter() - start, 1)
    print(f"labels: {len(docs)} documents x {len(pool) + 1} masks, {labels['scored']} pairs scored, "
          f"{label_seconds:.0f} s")
    if args.out is None:
        return 0
    from masks.router_bank import build_routed_bank

    saved = {"dense": 0.0, **{k: runner.cost.compute_saved(torch.as_tensor(p["mask"])) for k, p in pool.items()}}
    feats = spec = None
    if not args.no_lm_features:
        from router import lm_features

        # the float32 table the server looks up (a bf16 model's table is rounded)
        table = lm_features.TokenTable.of(lm if lm.model.get_input_embeddings().weight.dtype == torch.float32
                                          else models.load(args.model))
        texts = [d["text"] for d in docs]
        spec = lm_features.fit_spec(table, texts, args.max_len)
        feats = lm_features.features(table, texts, spec)
    bank = build_routed_bank(source, pool, docs, labels, budgets, saved, args, feats, spec)
    if others:
        bank.training["more_clusters"] = {"banks": [str(p) for p in args.more_clusters], "candidates": added}
    bank.training["labels"] = {"documents": len(docs), "docs_per_domain": args.docs_per_domain, "max_len": args.max_len,
                               "weights": lm.weights, "activations": str(runner.dtype).removeprefix("torch."),
                               "masks": len(pool) + 1, "pairs_scored": labels["scored"],
                               "seconds": label_seconds}  # this run's: pairs found in the cache cost nothing
    bank.save(args.out)
    print(f"wrote {args.out}: {len(pool)} candidates over budgets {budgets}, router {bank.router['kind']}")
    print(json.dumps(bank.router.get("selection", {}), indent=1))
    return 0


if __name__ == "__main__":
    from server.cli import run_module

    raise SystemExit(run_module(sys.modules[__name__], sys.argv[1:]))
