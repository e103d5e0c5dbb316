"""`igserve eval`: held-out perplexity and KL-to-dense per domain for IG routing, static masks and bounds.

Every document is scored under dense, every cluster mask of the bank and every static baseline in
one pass; the per-document results then give each method:

* dense, static_l0, shortgpt, greedy: one mask for every document;
* ig: the mask of the document's nearest centroid (routing text = the document, cut to the
  encoder's window, as the server does);
* oracle: the cluster mask with the lowest loss on that document (a bound: it peeks at the labels);
* random: a seeded, uniformly random cluster mask per document (a control for routing).

Perplexity is exp(total NLL / total predicted tokens) and KL is the mean per predicted token of
KL(dense || masked) over the full vocabulary, per domain and over all domains pooled. IG's margin
over the best static mask and over random routing comes with a paired bootstrap interval over
documents; the per-document scores are in the report too.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from masks.bank import DENSE, MaskBank
from masks.corpus import load_domain_dir
from masks.labels import score_documents

STATIC = ("static_l0", "shortgpt", "greedy")
ROUTED = ("ig", "ig_centroid", "ig_no_ood", "ig_learned_clusters", "ig_learned_clusters_static", "ig_max_loss")
METHODS = (DENSE, "ig", *STATIC, "oracle", "random")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from server.models import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL, help="packaged model name or HF directory")
    parser.add_argument("--bank", type=Path, required=True, help="mask bank JSON")
    parser.add_argument("--budget", type=float, help="budget to evaluate (default: the bank's default budget)")
    parser.add_argument("--data", type=Path, required=True, help="folder of <domain>.jsonl|.txt held-out documents")
    parser.add_argument("--json", type=Path, required=True, help="report to write")
    parser.add_argument("--plot", type=Path, help="PNG of the report")
    parser.add_argument("--docs-per-domain", type=int, default=16, help="first N documents of each domain file")
    parser.add_argument("--max-len", type=int, default=128, help="tokens scored per document (its beginning)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random-routing control")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--cache", type=Path, help="per-document score cache (e.g. data/eval-cache)")
    parser.add_argument("--seed-from", type=Path, nargs="*", default=[],
                        help="earlier reports whose per-document scores (of their bank's masks) fill the cache")
    parser.add_argument("--weights", default="fp32", help="weight format (fp32, bf16, int8, int4)")
    parser.add_argument("--dtype", default="auto", help="activations (auto: as the server picks for the format; "
                        "the shipped routed banks' bf16 labels were scored with bfloat16)")


@torch.no_grad()
def score_batch(runner, ids: torch.Tensor, valid: torch.Tensor, masks: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Per mask id: {"nll": [b] summed NLL, "kl": [b] summed KL(dense || masked)} over predicted tokens."""
    targets = ids[:, 1:]
    scored = (valid[:, 1:] & valid[:, :-1]).float()
    dense = runner.forward(ids, torch.ones(runner.num_blocks, dtype=torch.bool), valid)[:, :-1].float().log_softmax(-1)
    p_dense = dense.exp()
    out = {}
    for mask_id, mask in masks.items():
        logp = dense if mask_id == DENSE else runner.forward(ids, mask, valid)[:, :-1].float().log_softmax(-1)
        nll = -logp.gather(-1, targets[..., None]).squeeze(-1)
        kl = (p_dense * (dense - logp)).sum(-1)
        out[mask_id] = {"nll": (nll * scored).sum(1), "kl": (kl * scored).sum(1)}
    return out


def route_methods(bank: MaskBank, x: dict[str, torch.Tensor], sparsity: float) -> dict[str, list[str]]:
    """Mask id per document for every routing method the bank supports, at one budget; ``x``: the
    documents' routing inputs (``Router.inputs``)."""
    from router.predictor import KINDS
    from router.router import Router

    n = len(x["encoder"])
    budgets = [sparsity] * n
    centroid = Router(bank, method="centroid", ood=False)
    out = {"ig_centroid": [r.mask_id for r in centroid.route_embedded(x, budgets, [None] * n)]}
    if bank.router.get("kind") not in KINDS:
        return {"ig": out["ig_centroid"], **out}
    learned = Router(bank)
    out["ig"] = [r.mask_id for r in learned.route_embedded(x, budgets, [None] * n)]
    out["ig_no_ood"] = [r.mask_id for r in Router(bank, ood=False).route_embedded(x, budgets, [None] * n)]
    pred = dict(zip(learned.predictor.candidates, learned.predictor.predict(x).T))
    static = list(bank.static_ids(sparsity).values())
    for name, ids in (("ig_learned_clusters", bank.cluster_ids(sparsity)),
                      ("ig_learned_clusters_static", bank.cluster_ids(sparsity) + static)):
        table = torch.stack([pred[m] for m in ids], 1)
        out[name] = [ids[j] for j in table.argmin(1).tolist()]
    max_loss = bank.router.get("max_loss_for_budget", {}).get(f"{sparsity:g}")
    if max_loss is not None:
        out["ig_max_loss"] = [r.mask_id for r in learned.route_embedded(x, [None] * n, [max_loss] * n)]
    return out


def _choose(bank: MaskBank, sparsity: float, results: list[dict], routes: dict[str, list[str]],
            seed: int) -> dict[str, list[str]]:
    """Mask id used for each document by each method."""
    gen = torch.Generator().manual_seed(seed)
    clusters, pool = bank.cluster_ids(sparsity), bank.candidate_ids(sparsity)
    random_pick = torch.randint(len(clusters), (len(results),), generator=gen).tolist()
    chosen = {DENSE: [DENSE] * len(results),
              **{name: [m] * len(results) for name, m in bank.static_ids(sparsity).items()},
              **routes,
              "oracle": [min(clusters, key=lambda m: r["nll"][m]) for r in results],
              "random": [clusters[i] for i in random_pick]}
    if pool != clusters:
        chosen["oracle_pool"] = [min(pool, key=lambda m: r["nll"][m]) for r in results]
    return chosen


def _paired_bootstrap(results: list[dict], a: list[str], b: list[str], seed: int, rounds: int = 2000) -> list[float]:
    """95% interval of 100 * (ppl_a / ppl_b - 1) over documents resampled with replacement (paired)."""
    nll_a = torch.tensor([r["nll"][m] for r, m in zip(results, a)], dtype=torch.float64)
    nll_b = torch.tensor([r["nll"][m] for r, m in zip(results, b)], dtype=torch.float64)
    tokens = torch.tensor([r["tokens"] for r in results], dtype=torch.float64)
    idx = torch.randint(len(results), (rounds, len(results)), generator=torch.Generator().manual_seed(seed))
    pct = 100.0 * (torch.exp((nll_a[idx].sum(1) - nll_b[idx].sum(1)) / tokens[idx].sum(1)) - 1.0)
    return [float(pct.quantile(0.025)), float(pct.quantile(0.975))]


def _totals(rows: list[tuple[dict, str]]) -> dict:
    nll = sum(r["nll"][m] for r, m in rows)
    kl = sum(r["kl"][m] for r, m in rows)
    tokens = sum(r["tokens"] for r, _ in rows)
    return {"ppl": math.exp(nll / tokens), "kl": kl / tokens, "tokens": tokens}


def _counts(ids: list[str]) -> dict[str, int]:
    return {m: ids.count(m) for m in sorted(set(ids))}


def _per_document(scores: dict) -> list[dict]:
    return [{"tokens": n, "nll": {m: v[i] for m, v in scores["nll"].items()},
             "kl": {m: v[i] for m, v in scores["kl"].items()}} for i, n in enumerate(scores["tokens"])]


def _method_rows(chosen: dict[str, list[str]], results: list[dict], doc_domain: list[str], domains,
                 saved: dict[str, float]) -> dict:
    methods = {}
    for method, picks in chosen.items():
        rows = list(zip(results, picks))
        overall = _totals(rows)
        tokens = overall["tokens"]
        methods[method] = {
            "overall_ppl": overall["ppl"], "overall_kl": overall["kl"],
            "per_domain": {d: {k: v for k, v in _totals([row for row, dd in zip(rows, doc_domain) if dd == d]).items()
                               if k != "tokens"} for d in domains},
            "compute_saved": sum(saved[m] * r["tokens"] for r, m in rows) / tokens,
            "masks_used": _counts(picks),
        }
    return methods


def _summary(methods: dict, chosen: dict, results: list[dict], static: dict[str, str], seed: int) -> dict:
    best_static = min(static, key=lambda m: methods[m]["overall_ppl"])
    ppl = {m: v["overall_ppl"] for m, v in methods.items()}
    ig, best, centroid, oracle = ppl["ig"], ppl[best_static], ppl.get("ig_centroid", ppl["ig"]), ppl["oracle"]
    out = {"best_static": best_static, "ig_ppl": ig, "best_static_ppl": best,
           "ig_vs_best_static_ppl_pct": 100.0 * (ig - best) / best, "ig_over_best_static": ig / best,
           "ig_vs_best_static_ppl_pct_ci95": _paired_bootstrap(results, chosen["ig"], chosen[best_static], seed),
           "ig_vs_random_ppl_pct": 100.0 * (ig / ppl["random"] - 1.0),
           "ig_vs_random_ppl_pct_ci95": _paired_bootstrap(results, chosen["ig"], chosen["random"], seed),
           "ig_beats_best_static": ig < best, "random_worse_than_ig": ppl["random"] > ig,
           "oracle_bounds_ig": oracle <= ig,
           "centroid_to_oracle_gap_closed": (centroid - ig) / (centroid - oracle) if centroid > oracle else None}
    if "oracle_pool" in ppl:
        out["centroid_to_oracle_pool_gap_closed"] = (centroid - ig) / (centroid - ppl["oracle_pool"])
    if "ig_centroid" in chosen and chosen["ig_centroid"] != chosen["ig"]:
        out["ig_vs_centroid_ppl_pct_ci95"] = _paired_bootstrap(results, chosen["ig"], chosen["ig_centroid"], seed)
    if "ig_max_loss" in ppl:
        out["ig_max_loss_over_best_static"] = ppl["ig_max_loss"] / best
    return out


def evaluate_bank(runner, tokenizer, bank: MaskBank, domains: dict[str, list[str]], routes: dict[str, list[str]],
                  max_len: int = 128, batch_size: int = 8, seed: int = 0, sparsity: float | None = None,
                  cache: Path | None = None, fingerprint: str = "", weights: str = "fp32") -> dict:
    """Score every document under every mask used at one budget, then aggregate each method per domain and overall."""
    s = bank.sparsity if sparsity is None else sparsity
    all_masks = bank.mask_tensors()
    needed = {DENSE, *bank.cluster_ids(s), *bank.candidate_ids(s), *bank.static_ids(s).values(),
              *(m for picks in routes.values() for m in picks)}
    masks = {m: t for m, t in all_masks.items() if m in needed}
    saved = {m: runner.cost.compute_saved(mask) for m, mask in masks.items()}
    texts = [t for d in domains for t in domains[d]]
    doc_domain = [d for d in domains for _ in domains[d]]
    results = _per_document(score_documents(runner, tokenizer, fingerprint, texts, masks, max_len, batch_size, cache,
                                            weights=weights))
    chosen = _choose(bank, s, results, routes, seed)
    methods = _method_rows(chosen, results, doc_domain, domains, saved)
    static = bank.static_ids(s)
    methods.update({name: methods.pop(name) for name in static})
    route = chosen["ig"]
    return {
        "sparsity": s,
        "methods": methods,
        "masks": {m: {"skip_ratio": bank.skip_ratio(m), "compute_saved": saved[m],
                      "ideal_speedup": runner.ideal_speedup(mask), **_totals([(r, m) for r in results])}
                  for m, mask in masks.items()},
        "routing": {d: _counts([x for x, dd in zip(route, doc_domain) if dd == d]) for d in domains},
        "tokens": {d: sum(r["tokens"] for r, dd in zip(results, doc_domain) if dd == d) for d in domains},
        "documents": [{"domain": d, "route": r_, **r} for r, d, r_ in zip(results, doc_domain, route)],
        "summary": _summary(methods, chosen, results, static, seed),
    }


def format_report(report: dict) -> str:
    domains = list(report["tokens"])
    head = f"{'method':10s} {'ppl':>8s} {'KL':>7s} {'saved':>6s}  " + " ".join(f"{d[:12]:>12s}" for d in domains)
    lines = [f"bank {report['bank']} (sparsity {report['sparsity']}), ppl per domain:", head]
    for name, m in report["methods"].items():
        lines.append(f"{name:10s} {m['overall_ppl']:8.3f} {m['overall_kl']:7.4f} {m['compute_saved']:6.1%}  "
                     + " ".join(f"{m['per_domain'][d]['ppl']:12.3f}" for d in domains))
    s = report["summary"]
    lo, hi = s["ig_vs_best_static_ppl_pct_ci95"]
    lines.append(f"IG {s['ig_ppl']:.3f} vs best static ({s['best_static']}) {s['best_static_ppl']:.3f}: "
                 f"{s['ig_vs_best_static_ppl_pct']:+.2f}% perplexity (95% paired bootstrap over documents: "
                 f"{lo:+.2f}% .. {hi:+.2f}%)")
    return "\n".join(lines)


def plot_report(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(report["methods"])
    domains = list(report["tokens"])
    color = {m: "C7" if m == DENSE else f"C{i}" for i, m in enumerate(methods)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5), gridspec_kw={"width_ratios": [1, 2.5]})
    ppl = [report["methods"][m]["overall_ppl"] for m in methods]
    left.bar(methods, ppl, color=[color[m] for m in methods])
    left.set_ylabel("perplexity (held-out, all domains)")
    left.set_title(f"sparsity {report['sparsity']}: overall")
    left.tick_params(axis="x", rotation=45)
    width = 0.8 / (len(methods) - 1)
    for k, m in enumerate(x for x in methods if x != DENSE):
        ratio = [report["methods"][m]["per_domain"][d]["ppl"] / report["methods"][DENSE]["per_domain"][d]["ppl"]
                 for d in domains]
        right.bar([i + k * width for i in range(len(domains))], ratio, width, label=m, color=color[m])
    right.set_xticks([i + 0.4 - width / 2 for i in range(len(domains))], domains, rotation=30)
    right.set_ylabel("perplexity / dense perplexity")
    right.set_title("per domain")
    right.legend(ncol=3, fontsize=8)
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    """Lay out, write (creating its folder) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict, json_path: Path, plot_path: Path | None, plot) -> None:
    """The report as JSON, and ``plot(report, plot_path)`` when a plot path is given."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    if plot_path:
        plot(report, plot_path)


def seed_from_reports(reports: list[Path], cache: Path, fingerprint: str, max_len: int,
                      domains: dict[str, list[str]], weights: str = "fp32", activations: str = "float32") -> int:
    """Fill the score cache from earlier reports of the same documents and window (their bank's masks)."""
    from masks.labels import keyed_activations, seed_cache

    texts = [t for d in domains for t in domains[d]]
    stored = 0
    for path in reports:
        old = json.loads(path.read_text())
        fmt = old.get("weights", "fp32")
        if (old["max_len"] != max_len or len(old["documents"]) != len(texts) or fmt != weights
                or old.get("activations", keyed_activations(fmt)) != activations):
            raise SystemExit(f"{path}: other documents, window, weight format or activations than this run")
        stored += seed_cache(cache, fingerprint, max_len, texts, MaskBank.load(old["bank"]).mask_tensors(), old["documents"],
                             weights, activations)
    return stored


def run(args: argparse.Namespace) -> int:
    from router.lm_features import TokenTable
    from router.router import Router
    from server import models
    from server.runner import BlockRunner
    from server.weights import cpu_flags

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    lm = models.load(args.model, dtype=models.resolve_weights(args.weights, args.dtype)[1], weights=args.weights)
    bank = MaskBank.load(args.bank)
    runner = BlockRunner(lm.model, max_batch=1, max_len=args.max_len)
    bank.check_model(lm.fingerprint, runner.num_blocks)
    domains = {d: texts[: args.docs_per_domain] for d, texts in load_domain_dir(args.data).items()}
    activations = str(runner.dtype).removeprefix("torch.")
    seeded = seed_from_reports(args.seed_from, args.cache, lm.fingerprint, args.max_len, domains, lm.weights,
                               activations)
    s = bank.sparsity if args.budget is None else args.budget
    inputs = Router(bank, lm=TokenTable.of(lm)).inputs([t for d in domains for t in domains[d]])
    routes = route_methods(bank, inputs, s)
    report = {"bank": str(args.bank), "model": lm.name, "weights": lm.weights, "activations": activations,
              "data": str(args.data),
              "docs_per_domain": args.docs_per_domain, "max_len": args.max_len,
              "command": args.invocation, "cpu_flags": cpu_flags(),
              "router": bank.router.get("kind", "centroid"), "ood": bank.ood, "masks_seeded_from_reports": seeded}
    report.update(evaluate_bank(runner, lm.tokenizer, bank, domains, routes, args.max_len, args.batch_size, args.seed,
                                s, args.cache, lm.fingerprint, lm.weights))
    report["seconds"] = round(time.perf_counter() - start, 1)
    write_report(report, args.json, args.plot, plot_report)
    print(format_report(report))
    print(f"wrote {args.json}{' and ' + str(args.plot) if args.plot else ''} in {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    from server.cli import run_module

    raise SystemExit(run_module(sys.modules[__name__], sys.argv[1:]))
