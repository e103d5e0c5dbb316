"""`igserve eval zeroshot`: zero-shot multiple-choice accuracy of dense, static and input-guided masks.

The seven tasks of the depth-pruning papers come from the packaged oe-eval `rc_0shot` requests
(masks.mc_tasks). Every choice is scored by the summed log-likelihood of its continuation given its
context through the block-masked runner, once per distinct mask (dense, the bank's static
baselines and its N cluster masks, deduplicated by mask bits): the context is prefilled once per
mask into a KV slot, copied to the slots of the other choices, and each continuation is appended
to its slot; logits are taken at the continuation's positions only, in the model's dtype
(``--dtype``; bfloat16 on CPUs with AMX is ~5x the fp32 throughput), and log-softmaxed in
float32. The per-mask scores then give each method:

* dense and the static baselines (static_l0, shortgpt, greedy): one mask for every example;
* ig: the bank's router on the context (the choices' shared context for partial scoring), as the
  server routes a prompt: nearest centroid for a one-budget bank, the learned router for a
  format-2 bank (``--budget`` picks which of its budgets);
* ig_centroid (format-2 banks): the nearest centroid's cluster mask, the paper's router;
* ig_ood: nearest centroid, except that a context farther from its centroid than a threshold gets
  the global greedy mask. A format-2 bank holds the threshold (what ``--router centroid`` serves);
  for a one-budget bank ``--ood-quantile q`` sets it from the calibration documents' distances
  (an experiment, not what the server does);
* random: a seeded, uniformly random cluster mask per example (a control for routing);
* oracle: the cluster mask that ranks the gold choice highest above the best wrong one, per
  metric (a bound: it peeks at the labels; correct whenever any cluster mask is).

Only the (example, mask) pairs some method uses are scored, so a run without the oracle scores a
few masks per example rather than all of them.

acc picks the choice with the highest summed log-likelihood; acc_norm divides it by the number of
characters of the continuation (oe-eval's acc_per_char, lm-eval's acc_norm). Intervals are
normal-approximation 95% half-widths, per task and for the unweighted mean over tasks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from dataclasses import dataclass
from os.path import commonprefix
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from masks.bank import DENSE, MaskBank
from masks.corpus import ZEROSHOT_TASKS
from masks.evaluate import save_figure, write_report
from masks.labels import mask_key
from masks.mc_tasks import MCExample, encode_pair, load_task, select

BATCH_TOKENS = 2048  # rows x padded length per runner call (bounds the [rows, T, vocab] logits)
KV_POSITIONS = 32768  # cache slots x context length per task (about 1.5 GB for SmolLM2-135M)
METRICS = ("acc", "acc_norm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from server import models

    parser.add_argument("--model", default=models.DEFAULT_MODEL, help="packaged model name or HF directory")
    parser.add_argument("--bank", type=Path, required=True, help="mask bank JSON")
    parser.add_argument("--budget", type=float, help="budget of a format-2 bank to evaluate (default: its sparsity)")
    parser.add_argument("--methods", help="comma-separated methods to report (default: all the bank supports); "
                                          "leaving out oracle and random scores far fewer masks")
    parser.add_argument("--tasks", default=",".join(ZEROSHOT_TASKS), help="comma-separated oe-eval task names")
    parser.add_argument("--limit", type=int, help="seeded random sample of at most N documents per task")
    parser.add_argument("--json", type=Path, required=True, help="report to write")
    parser.add_argument("--plot", type=Path, help="PNG of the report")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --limit sample and of random routing")
    parser.add_argument("--batch-tokens", type=int, default=BATCH_TOKENS, help="rows x tokens per runner call")
    parser.add_argument("--cache", type=Path, help="folder of per-(document, mask) scores to reuse and extend")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--ood-quantile", type=float,
                        help="one-budget banks: also report ig_ood, IG with the global greedy mask for contexts "
                             "farther from their centroid than this quantile of the calibration documents' distances "
                             "(needs the bank's calibration corpus); format-2 banks hold their own threshold")
    parser.add_argument("--dtype", default="auto", choices=models.DTYPES,
                        help="weights and scoring (auto: bfloat16 on CUDA and on CPUs with AMX, else float32)")


# ----------------------------------------------------------------------------- scoring


def _batches(items: list, length, budget: int) -> list[list]:
    """Split items (sorted by length) into runs whose count x longest length stays within budget."""
    out, current, longest = [], [], 0
    for item in items:
        n = length(item)
        if current and (len(current) + 1) * max(longest, n) > budget:
            out.append(current)
            current, longest = [], 0
        current.append(item)
        longest = max(longest, n)
    return out + [current] if current else out


@torch.inference_mode()
def loglikelihoods(model, tokenizer, examples: list[MCExample], masks: torch.Tensor,
                   batch_tokens: int = BATCH_TOKENS, desc: str = "score") -> tuple[np.ndarray, int]:
    """Summed log-likelihood of every choice's continuation under every mask: [E, U, K] (-inf where
    an example has fewer than K choices), and the number of token positions the runner computed.

    Each runner call holds one mask, so every block runs on all rows or on none. Per example and
    mask, the longest token prefix that all choices share (ending before the first scored position)
    is prefilled once and copied to the other choices' slots, then each continuation is appended."""
    from server.runner import BlockRunner

    enc = _Encoded.of(tokenizer, examples)
    max_len = max(len(s) for ss in enc.seqs for s in ss)
    k_max = max(len(ss) for ss in enc.seqs)
    runner = BlockRunner(model, max_batch=max(k_max, KV_POSITIONS // max_len), max_len=max_len)
    out = np.full((len(examples), len(masks), k_max), -np.inf)
    computed = 0
    with tqdm(total=len(examples), desc=desc, unit="ex", leave=False) as bar:
        for group in _slot_groups(enc, runner.cache.max_batch):
            rows, slot, heads = _layout(enc, group)
            for u, mask in enumerate(masks):
                computed += _score_mask(runner, enc, rows, slot, heads, mask, batch_tokens, out[:, u])
            bar.update(len(group))
    return out, computed


@dataclass
class _Encoded:
    """Per example and choice: context + continuation token ids, where the continuation starts,
    and per example the prefix that all its choices share (ending before the first scored token)."""

    seqs: list[list[list[int]]]
    starts: list[list[int]]
    prefix: list[int]

    @classmethod
    def of(cls, tokenizer, examples: list[MCExample]) -> "_Encoded":
        seqs, starts, prefix = [], [], []
        for e in examples:
            pairs = [encode_pair(tokenizer, c, x) for c, x in zip(e.contexts, e.continuations)]
            seqs.append([c + x for c, x in pairs])
            starts.append([len(c) for c, _ in pairs])
            prefix.append(min(len(commonprefix(seqs[-1])), min(starts[-1]) - 1))
        return cls(seqs, starts, prefix)


def _slot_groups(enc: _Encoded, slots: int) -> list[list[int]]:
    """Examples whose choices fill the cache slots together, longest shared prefix first."""
    groups, group = [], []
    for i in sorted(range(len(enc.seqs)), key=lambda i: -enc.prefix[i]):
        if group and sum(len(enc.seqs[j]) for j in group) + len(enc.seqs[i]) > slots:
            groups.append(group)
            group = []
        group.append(i)
    return groups + [group] if group else groups


def _layout(enc: _Encoded, group: list[int]) -> tuple[list[tuple[int, int]], dict[tuple[int, int], int], list[int]]:
    """A group's (example, choice) rows by continuation length, their slots (so extend batches
    read contiguous slots), and the examples with a shared prefix to prefill."""
    rows = sorted(((i, k) for i in group for k in range(len(enc.seqs[i]))),
                  key=lambda r: len(enc.seqs[r[0]][r[1]]) - enc.prefix[r[0]])
    return rows, {r: n for n, r in enumerate(rows)}, [i for i in group if enc.prefix[i] > 0]


def _score_mask(runner, enc: _Encoded, rows: list[tuple[int, int]], slot: dict[tuple[int, int], int],
                heads: list[int], mask: torch.Tensor, batch_tokens: int, out: np.ndarray) -> int:
    """One group under one mask: prefill each shared prefix once, copy it to the other choices'
    slots, append every continuation; writes out [E, K] and returns the positions computed."""
    seqs, prefix = enc.seqs, enc.prefix
    computed = 0
    for batch in _batches(heads, lambda i: prefix[i], batch_tokens):
        runner.prefill([seqs[i][0][: prefix[i]] for i in batch], mask.expand(len(batch), -1),
                       [slot[(i, 0)] for i in batch])
        computed += sum(prefix[i] for i in batch)
    for i in heads:
        runner.copy_slot(slot[(i, 0)], [slot[(i, k)] for k in range(1, len(seqs[i]))], prefix[i])
    for batch in _batches(rows, lambda r: len(seqs[r[0]][r[1]]) - prefix[r[0]], batch_tokens):
        chunks = [seqs[i][k][prefix[i]:] for i, k in batch]
        hidden = runner.extend_hidden(chunks, [prefix[i] for i, _ in batch], mask.expand(len(batch), -1),
                                      [slot[r] for r in batch])
        computed += sum(map(len, chunks))
        firsts = [enc.starts[i][k] - prefix[i] for i, k in batch]
        for (i, k), total in zip(batch, _continuation_totals(runner, hidden, chunks, firsts)):
            out[i, k] = total
    return computed


def _continuation_totals(runner, hidden: torch.Tensor, chunks: list[list[int]], firsts: list[int]) -> list[float]:
    """Summed log-likelihood of each chunk's tokens from position ``first`` on. The token at chunk
    position t is predicted at t - 1: logits at the continuation's positions only (in the model's
    dtype), log-softmax in float32."""
    row, col, target = [], [], []
    for n, (chunk, first) in enumerate(zip(chunks, firsts)):
        row += [n] * (len(chunk) - first)
        col += range(first - 1, len(chunk) - 1)
        target += chunk[first:]
    row_t = torch.tensor(row)
    logits = runner.lm_head(hidden[row_t, torch.tensor(col)]).float()
    logp = logits.gather(1, torch.tensor(target)[:, None]).squeeze(1) - logits.logsumexp(1)
    return torch.zeros(len(chunks), dtype=torch.float64).index_add_(0, row_t, logp.double()).tolist()


def cached_loglikelihoods(lm, examples: list[MCExample], masks: torch.Tensor, cache: Path | None,
                          batch_tokens: int = BATCH_TOKENS, desc: str = "score",
                          needed: list[set[int]] | None = None) -> tuple[np.ndarray, int]:
    """``loglikelihoods`` of one task's examples, reading and appending per-(doc_id, mask) results in
    ``cache/<model fingerprint>/<dtype>/<task>.jsonl``, so other banks (dense, shared masks) and reruns
    with a larger --limit score only what is new. ``needed[i]``: the mask rows example i is scored
    under (default: all); the others are NaN. Returns the [E, U, K] scores and positions computed."""
    dtype = str(next(lm.model.parameters()).dtype).removeprefix("torch.")
    path = cache / lm.fingerprint.replace(":", "-") / dtype / f"{examples[0].task}.jsonl" if cache else None
    known = {}
    if path and path.is_file():
        with path.open() as f:
            known = {(row["doc_id"], row["mask"]): row["ll"] for row in map(json.loads, f)}
    keys = [mask_key(m) for m in masks]
    out = np.full((len(examples), len(masks), max(len(e.contexts) for e in examples)), -np.inf)
    missing: dict[int, list[int]] = {}  # mask row -> the examples that lack it
    for i, e in enumerate(examples):
        rows = set(range(len(masks))) if needed is None else needed[i]
        for u, key in enumerate(keys):
            if u not in rows:
                out[i, u] = np.nan
            elif (e.doc_id, key) in known:
                out[i, u, : len(e.contexts)] = known[(e.doc_id, key)]
            else:
                missing.setdefault(u, []).append(i)
    batches: dict[tuple[int, ...], list[int]] = {}  # examples -> the mask rows they all lack: one call each
    for u, idx in sorted(missing.items()):
        batches.setdefault(tuple(idx), []).append(u)
    computed = 0
    for n_done, (idx, rows) in enumerate(batches.items()):
        scores, n = loglikelihoods(lm.model, lm.tokenizer, [examples[i] for i in idx], masks[rows], batch_tokens,
                                   f"{desc} {n_done + 1}/{len(batches)}")
        out[np.ix_(idx, rows, range(scores.shape[2]))] = scores
        computed += n
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                for i in idx:
                    for u in rows:
                        ll = out[i, u, : len(examples[i].contexts)].tolist()
                        f.write(json.dumps({"doc_id": examples[i].doc_id, "mask": keys[u], "ll": ll}) + "\n")
    return out, computed


# ----------------------------------------------------------------------------- methods and metrics


def unique_masks(bank: MaskBank, ids: list[str]) -> tuple[torch.Tensor, dict[str, int]]:
    """Distinct masks [U, B] of dense and the given mask ids (deduplicated by bits); id -> row."""
    rows: dict[tuple, int] = {}
    index = {}
    for name in (DENSE, *ids):
        bits = tuple(bank.mask(name).tolist())
        index[name] = rows.setdefault(bits, len(rows))
    return torch.tensor(list(rows), dtype=torch.bool), index


def routes(bank: MaskBank, texts: list[str], sparsity: float, ood_distance: float | None = None,
           lm=None) -> dict[str, list[str]]:
    """Mask id per routing text of every routing method: ig as the server routes; for a format-2
    bank also ig_centroid and ig_ood (its centroid router with the bank's threshold); for a
    one-budget bank ig_ood at ``ood_distance`` when given. ``lm``: the LM's token table
    (router.lm_features), for a router that reads it."""
    from masks.evaluate import route_methods
    from router.router import Router

    x = Router(bank, lm=lm).inputs(texts)
    emb = x["encoder"]
    n = len(texts)
    by_method = route_methods(bank, x, sparsity)
    out = {"ig": by_method["ig"]}
    if bank.budgets:
        out["ig_centroid"] = by_method["ig_centroid"]
        if bank.ood.get("distance") is not None and bank.global_id(sparsity) is not None:
            centroid = Router(bank, method="centroid").route_embedded(emb, [sparsity] * n, [None] * n)
            out["ig_ood"] = [r.mask_id for r in centroid]
    elif ood_distance is not None and "greedy" in bank.baselines:
        nearest = Router(bank, method="centroid", ood=False).route_embedded(emb, [sparsity] * n, [None] * n)
        out["ig_ood"] = ["greedy" if r.distance > ood_distance else r.mask_id for r in nearest]
    return out


def predictions(ll: np.ndarray, examples: list[MCExample]) -> dict[str, np.ndarray]:
    """Per metric, [E, U] margin of the gold choice over the best wrong choice (> 0: correct)."""
    chars = np.ones(ll.shape[::2])
    gold = np.array([e.gold for e in examples])
    for n, e in enumerate(examples):
        chars[n, : len(e.continuations)] = [len(c) for c in e.continuations]
    out = {}
    for metric, score in (("acc", ll), ("acc_norm", ll / chars[:, None, :])):
        gold_score = np.take_along_axis(score, gold[:, None, None], 2)[..., 0]
        wrong = score.copy()
        np.put_along_axis(wrong, gold[:, None, None], -np.inf, 2)
        out[metric] = gold_score - wrong.max(2)
    return out


def picks(methods: list[str], bank: MaskBank, sparsity: float, routed: dict[str, list[str]], n: int,
          generator: torch.Generator) -> dict[str, list[str]]:
    """Per method but the oracle, the mask id used for each of n examples (``routed``: ``routes``)."""
    clusters = bank.cluster_ids(sparsity)
    rand = [clusters[i] for i in torch.randint(len(clusters), (n,), generator=generator).tolist()]
    table = {DENSE: [DENSE] * n, **{name: [m] * n for name, m in bank.static_ids(sparsity).items()}, **routed,
             "random": rand}
    return {m: table[m] for m in methods if m != "oracle"}


def oracle_picks(clusters: list[str], index: dict[str, int], margins: dict[str, np.ndarray]) -> dict[str, list[str]]:
    """Per metric, the cluster mask with the largest gold margin for each example."""
    rows = [index[m] for m in clusters]
    return {metric: [clusters[i] for i in margins[metric][:, rows].argmax(1)] for metric in METRICS}


def ci95(p: float, n: int) -> float:
    return 1.96 * math.sqrt(p * (1 - p) / n) if n else float("nan")


def _mean_ci(ps: list[float], ns: list[int]) -> float:
    return 1.96 * math.sqrt(sum(p * (1 - p) / n for p, n in zip(ps, ns))) / len(ps)


def _paired(diffs: list[np.ndarray]) -> dict:
    """Mean over tasks of per-task mean differences, with its 95% half-width."""
    means = [float(d.mean()) for d in diffs]
    var = sum(float(d.var(ddof=1)) / len(d) if len(d) > 1 else 0.0 for d in diffs)
    return {"diff": sum(means) / len(means), "ci95": 1.96 * math.sqrt(var) / len(diffs)}


def method_names(bank: MaskBank, sparsity: float, routed: dict[str, list[str]]) -> list[str]:
    """Every method a run can report for this bank and budget, in report order."""
    routing = [m for m in ("ig_centroid", "ig_ood") if m in routed]
    return [DENSE, "ig", *routing, *bank.static_ids(sparsity), "oracle", "random"]


def evaluate(lm, bank: MaskBank, examples: dict[str, list[MCExample]], sparsity: float | None = None,
             methods: list[str] | None = None, seed: int = 0, batch_tokens: int = BATCH_TOKENS,
             cache: Path | None = None, ood_distance: float | None = None) -> dict:
    """Route every task's contexts, score each example under the masks its methods use, then
    aggregate each method (JSON-ready). ``methods``: a subset of ``method_names`` (default: all)."""
    from router.lm_features import TokenTable
    from server.cost import CostModel

    s = bank.sparsity if sparsity is None else sparsity
    static = bank.static_ids(s)
    clusters = bank.cluster_ids(s)
    generator = torch.Generator().manual_seed(seed)
    cost = CostModel.from_model(lm.model)
    outcomes: dict[str, dict[str, _Outcome]] = {}  # task -> method -> outcome
    timing, distinct = {}, set()
    table = TokenTable.of(lm)
    for task, exs in examples.items():
        start = time.perf_counter()
        routed = routes(bank, [e.routing_text for e in exs], s, ood_distance, table)
        available = method_names(bank, s, routed)
        chosen_methods = available if methods is None else [m for m in available if m in methods]
        chosen = picks(chosen_methods, bank, s, routed, len(exs), generator)
        ids = sorted({m for p in chosen.values() for m in p} | (set(clusters) if "oracle" in chosen_methods else set()))
        masks, index = unique_masks(bank, ids)
        needed = [{index[p[i]] for p in chosen.values()} | ({index[c] for c in clusters} if "oracle" in chosen_methods
                                                            else set()) for i in range(len(exs))]
        ll, computed = cached_loglikelihoods(lm, exs, masks, cache, batch_tokens, desc=task, needed=needed)
        margins = predictions(ll, exs)
        by_metric = {m: {metric: p for metric in METRICS} for m, p in chosen.items()}
        if "oracle" in chosen_methods:
            by_metric["oracle"] = oracle_picks(clusters, index, margins)
        saved = np.array([cost.compute_saved(m) for m in masks])
        outcomes[task] = {m: _Outcome.of(by_metric[m], margins, index, saved) for m in chosen_methods}
        distinct |= {mask_key(m) for m in masks}
        wall = time.perf_counter() - start
        timing[task] = {"wall_s": round(wall, 1), "positions_computed": computed,
                        "positions_per_s": round(computed / wall) if computed else None}

    tasks = list(examples)
    reported = list(outcomes[tasks[0]])
    report_methods = {m: _method_report({t: outcomes[t][m] for t in tasks}) for m in reported}
    paired = {m: {metric: _paired([outcomes[t]["ig"].correct[metric].astype(float) - outcomes[t][m].correct[metric]
                                   for t in tasks])
                  for metric in METRICS}
              for m in reported if m != "ig"}
    used = sorted({i for r in report_methods.values() for per_task in r["masks_used"].values() for i in per_task})
    return {
        "sparsity": s,
        "metrics": {"acc": "argmax of the summed log-likelihood of the continuation",
                    "acc_norm": "argmax of log-likelihood / characters of the continuation (oe-eval acc_per_char)",
                    "ci95": "normal-approximation 95% half-width of acc_norm (ci95_acc: of acc)"},
        "methods": report_methods,
        "ig_minus": paired,
        "masks": {m: {"skip_ratio": bank.skip_ratio(m), "compute_saved": cost.compute_saved(bank.mask(m))}
                  for m in [DENSE, *(i for i in used if i != DENSE)]},
        "distinct_masks": len(distinct),
        "summary": _summary(report_methods, [m for m in static if m in report_methods], paired),
        "timing": timing,
    }


@dataclass
class _Outcome:
    """One method on one task: per metric whether each example is right, how often each mask was
    used (acc_norm's picks) and the mean compute saved."""

    correct: dict[str, np.ndarray]
    used: dict[str, int]
    saved: float

    @classmethod
    def of(cls, picks: dict[str, list[str]], margins: dict[str, np.ndarray], index: dict[str, int],
           saved: np.ndarray) -> "_Outcome":
        correct = {}
        for metric in METRICS:
            rows = np.array([index[i] for i in picks[metric]])
            margin = margins[metric][np.arange(len(rows)), rows]
            assert not np.isnan(margin).any(), "a method picked a mask its example was not scored under"
            correct[metric] = margin > 0
        ids = picks["acc_norm"]
        return cls(correct, {i: ids.count(i) for i in sorted(set(ids))},
                   float(np.mean([saved[index[i]] for i in ids])))


def _method_report(outcomes: dict[str, _Outcome]) -> dict:
    """One method's accuracies per task (task -> outcome) and their unweighted means with intervals."""
    per_task = {}
    for t, o in outcomes.items():
        n = len(o.correct["acc"])
        acc, norm = float(o.correct["acc"].mean()), float(o.correct["acc_norm"].mean())
        per_task[t] = {"acc": acc, "acc_norm": norm, "n": n, "ci95": ci95(norm, n), "ci95_acc": ci95(acc, n),
                       "compute_saved": o.saved}
    tasks = list(per_task)
    means = {metric: sum(per_task[t][metric] for t in tasks) / len(tasks) for metric in METRICS}
    ns = [per_task[t]["n"] for t in tasks]
    return {
        "mean_acc": means["acc"], "mean_acc_norm": means["acc_norm"],
        "mean_ci95": _mean_ci([per_task[t]["acc_norm"] for t in tasks], ns),
        "mean_ci95_acc": _mean_ci([per_task[t]["acc"] for t in tasks], ns),
        "tasks": per_task, "masks_used": {t: o.used for t, o in outcomes.items()},
    }


def _summary(report_methods: dict[str, dict], static: list[str], paired: dict) -> dict:
    """The best static baseline, IG's margin over it (points of mean acc_norm, paired 95% CI), and
    whether IG (and ig_ood) is at or above every static baseline."""
    def above(method: str, key: str) -> bool:
        return all(report_methods[method][key] >= report_methods[m][key] for m in static)

    if not static:
        return {"best_static": None}
    best = max(static, key=lambda m: report_methods[m]["mean_acc_norm"])
    out = {"best_static": best,
           "ig_minus_best_static_points": 100 * paired[best]["acc_norm"]["diff"],
           "ig_minus_best_static_ci95_points": 100 * paired[best]["acc_norm"]["ci95"],
           "ig_at_or_above_every_static": above("ig", "mean_acc_norm"),
           "ig_at_or_above_every_static_acc": above("ig", "mean_acc")}
    for method in ("ig_centroid", "ig_ood"):
        if method in report_methods:
            out[f"{method}_at_or_above_every_static"] = above(method, "mean_acc_norm")
    return out


def ood_distance(bank: MaskBank, router, quantile: float) -> float:
    """The ``quantile`` of the bank's calibration documents' cosine distances to their nearest
    centroid (the corpus named in the bank's training record)."""
    from masks.corpus import load_domain_dir

    texts = [t for domain in load_domain_dir(Path(bank.training["data"])).values() for t in domain]
    if len(texts) != len(bank.calibration_docs):
        raise ValueError(f"{bank.training['data']} holds {len(texts)} documents, the bank was built on "
                         f"{len(bank.calibration_docs)}")
    return float(np.quantile([r.distance for r in router.route(texts)], quantile))


# ----------------------------------------------------------------------------- output


def markdown_table(report: dict, metric: str = "acc_norm") -> str:
    """Papers' layout: one row per method, one column per task and the average (percent ± 95% CI)."""
    ci = "ci95" if metric == "acc_norm" else "ci95_acc"
    tasks = list(report["methods"][DENSE]["tasks"])
    lines = ["| method | " + " | ".join(tasks) + " | average |", "|---" * (len(tasks) + 2) + "|"]
    for name, m in report["methods"].items():
        cells = [f"{100 * m['tasks'][t][metric]:.1f} ± {100 * m['tasks'][t][ci]:.1f}" for t in tasks]
        mean_ci = m["mean_ci95"] if metric == "acc_norm" else m["mean_ci95_acc"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {100 * m['mean_' + metric]:.1f} ± {100 * mean_ci:.1f} |")
    lines.append("| n | " + " | ".join(str(report["methods"][DENSE]["tasks"][t]["n"]) for t in tasks) + " | |")
    return "\n".join(lines)


def plot_report(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(report["methods"])
    tasks = list(report["methods"][DENSE]["tasks"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(16, 5), gridspec_kw={"width_ratios": [2.5, 1]})
    width = 0.8 / len(methods)
    for k, m in enumerate(methods):
        r = report["methods"][m]
        values = [r["tasks"][t]["acc_norm"] for t in tasks] + [r["mean_acc_norm"]]
        errors = [r["tasks"][t]["ci95"] for t in tasks] + [r["mean_ci95"]]
        left.bar([i + k * width for i in range(len(tasks) + 1)], values, width, yerr=errors, capsize=1.5, label=m,
                 color="C7" if m == DENSE else f"C{k}")
    left.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks) + 1)], tasks + ["average"], rotation=20)
    left.set_ylabel("acc_norm (per-character), 95% CI")
    left.set_title(f"zero-shot accuracy, block sparsity {report['sparsity']}")
    left.legend(ncol=4, fontsize=8)
    used = report["methods"]["ig"]["masks_used"]
    ids = sorted({i for t in tasks for i in used[t]})
    bottom = np.zeros(len(tasks))
    for i in ids:
        share = np.array([used[t].get(i, 0) / max(sum(used[t].values()), 1) for t in tasks])
        right.bar(tasks, share, bottom=bottom, label=i)
        bottom += share
    right.set_title("IG routing: mask chosen per task")
    right.set_ylabel("share of examples")
    right.tick_params(axis="x", rotation=30)
    right.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    from router.router import Router
    from server import models
    from server.weights import cpu_flags

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    dtype = models.resolve_dtype(args.dtype)
    lm = models.load(args.model, dtype=dtype)
    bank = MaskBank.load(args.bank)
    bank.check_model(lm.fingerprint, 2 * lm.model.config.num_hidden_layers)
    s = bank.sparsity if args.budget is None else args.budget
    if not any(abs(s - b) < 1e-9 for b in bank.budget_list()):
        raise SystemExit(f"budget {s} is not in {args.bank}; it holds {', '.join(map(str, bank.budget_list()))}")
    if bank.budgets and args.ood_quantile is not None:
        raise SystemExit(f"{args.bank} is a format-2 bank: it holds its own OOD threshold (ig_ood), drop --ood-quantile")
    methods = None
    if args.methods:
        methods = args.methods.split(",")
        known = {DENSE, "ig", "ig_centroid", "ig_ood", "oracle", "random", *bank.static_ids(s)}
        if unknown := [m for m in methods if m not in known]:
            raise SystemExit(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}")
        methods = ["ig", *(m for m in methods if m != "ig")]  # every comparison is against ig
    exclude = set(bank.calibration_docs)
    examples, data = {}, {}
    for task in args.tasks.split(","):
        docs = load_task(task)
        examples[task] = select(docs, exclude, args.limit, args.seed)
        data[task] = {"documents": len(docs), "excluded_calibration_docs": sum(e.doc_key in exclude for e in docs),
                      "evaluated": len(examples[task]), "doc_ids": [e.doc_id for e in examples[task]]}
    report = {"bank": args.bank.stem, "bank_file": str(args.bank),
              "bank_sha256": hashlib.sha256(args.bank.read_bytes()).hexdigest(), "model": lm.name,
              "fingerprint": lm.fingerprint, "dtype": str(dtype).removeprefix("torch."), "threads": args.threads,
              "command": args.invocation, "cpu_flags": cpu_flags(),
              "router": bank.router.get("kind", "centroid"), "limit": args.limit, "seed": args.seed, "data": data}
    ood = None
    if args.ood_quantile is not None:
        ood = ood_distance(bank, Router(bank), args.ood_quantile)
        report["ood"] = {"quantile": args.ood_quantile, "distance": ood}
    elif bank.budgets and bank.ood.get("distance") is not None:
        report["ood"] = {"quantile": bank.ood.get("quantile"), "distance": bank.ood["distance"], "from": "bank"}
    report.update(evaluate(lm, bank, examples, s, methods, args.seed, args.batch_tokens, args.cache, ood))
    report["wall_s"] = round(time.perf_counter() - start, 1)
    write_report(report, args.json, args.plot, plot_report)
    print(markdown_table(report))
    summary = report["summary"]
    if summary["best_static"]:
        print(f"best static: {summary['best_static']}; IG minus it: {summary['ig_minus_best_static_points']:+.1f} ± "
              f"{summary['ig_minus_best_static_ci95_points']:.1f} points mean acc_norm")
    print(f"wrote {args.json}{' and ' + str(args.plot) if args.plot else ''} in {report['wall_s']:.0f} s")
    return 0
