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
import time
from pathlib import Path

import torch
from tqdm import tqdm

from masks.bank import DENSE, MaskBank
from masks.corpus import load_domain_dir
from masks.train import tokenize

STATIC = ("static_l0", "shortgpt", "greedy")
METHODS = (DENSE, "ig", *STATIC, "oracle", "random")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from server.models import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL, help="packaged model name or HF directory")
    parser.add_argument("--bank", type=Path, required=True, help="mask bank JSON")
    parser.add_argument("--data", type=Path, required=True, help="folder of <domain>.jsonl|.txt held-out documents")
    parser.add_argument("--json", type=Path, required=True, help="report to write")
    parser.add_argument("--plot", type=Path, help="PNG of the report")
    parser.add_argument("--docs-per-domain", type=int, default=16, help="first N documents of each domain file")
    parser.add_argument("--max-len", type=int, default=128, help="tokens scored per document (its beginning)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random-routing control")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--weights", default="fp32", help="weight format (fp32, bf16, int8, int4)")


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


def _choose(bank: MaskBank, results: list[dict], routes: list[str], seed: int) -> dict[str, list[str]]:
    """Mask id used for each document by each method."""
    gen = torch.Generator().manual_seed(seed)
    random_pick = torch.randint(len(bank.mask_ids), (len(results),), generator=gen).tolist()
    return {
        **{m: [m] * len(results) for m in (DENSE, *STATIC)},
        "ig": routes,
        "oracle": [min(bank.mask_ids, key=lambda m: r["nll"][m]) for r in results],
        "random": [bank.mask_ids[i] for i in random_pick],
    }


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


def evaluate_bank(runner, tokenizer, bank: MaskBank, domains: dict[str, list[str]], routes: dict[str, list[str]],
                  max_len: int = 128, batch_size: int = 8, seed: int = 0) -> dict:
    """Score every document under every mask, then aggregate each method per domain and overall."""
    masks = {m: bank.mask(m) for m in (DENSE, *bank.mask_ids, *STATIC)}
    saved = {m: runner.cost.compute_saved(mask) for m, mask in masks.items()}
    results, doc_domain = [], []
    batches = [(d, texts[i : i + batch_size]) for d, texts in domains.items() for i in range(0, len(texts), batch_size)]
    for domain, texts in tqdm(batches, desc="eval batches", unit="batch"):
        ids, valid = tokenize(tokenizer, texts, max_len)
        scores = score_batch(runner, ids, valid, masks)
        tokens = (valid[:, 1:] & valid[:, :-1]).sum(1).tolist()
        for i, n in enumerate(tokens):
            results.append({"tokens": n, "nll": {m: float(s["nll"][i]) for m, s in scores.items()},
                            "kl": {m: float(s["kl"][i]) for m, s in scores.items()}})
            doc_domain.append(domain)
    chosen = _choose(bank, results, [r for d in domains for r in routes[d]], seed)

    methods = {}
    for method in METHODS:
        rows = list(zip(results, chosen[method]))
        overall = _totals(rows)
        per_domain = {d: _totals([row for row, dd in zip(rows, doc_domain) if dd == d]) for d in domains}
        tokens = sum(r["tokens"] for r, _ in rows)
        methods[method] = {
            "overall_ppl": overall["ppl"], "overall_kl": overall["kl"],
            "per_domain": {d: {"ppl": v["ppl"], "kl": v["kl"]} for d, v in per_domain.items()},
            "compute_saved": sum(saved[m] * r["tokens"] for r, m in rows) / tokens,
            "masks_used": {m: chosen[method].count(m) for m in sorted(set(chosen[method]))},
        }
    best_static = min(STATIC, key=lambda m: methods[m]["overall_ppl"])
    ig, best = methods["ig"]["overall_ppl"], methods[best_static]["overall_ppl"]
    return {
        "sparsity": bank.sparsity,
        "methods": methods,
        "masks": {m: {"skip_ratio": bank.skip_ratio(m), "compute_saved": saved[m],
                      "ideal_speedup": runner.cost.ideal_speedup(mask), **_totals([(r, m) for r in results])}
                  for m, mask in masks.items()},
        "routing": {d: {m: routes[d].count(m) for m in sorted(set(routes[d]))} for d in domains},
        "tokens": {d: sum(r["tokens"] for r, dd in zip(results, doc_domain) if dd == d) for d in domains},
        "documents": [{"domain": d, "route": route, **r} for r, d, route in zip(results, doc_domain, chosen["ig"])],
        "summary": {"best_static": best_static, "ig_ppl": ig, "best_static_ppl": best,
                    "ig_vs_best_static_ppl_pct": 100.0 * (ig - best) / best,
                    "ig_vs_best_static_ppl_pct_ci95": _paired_bootstrap(results, chosen["ig"], chosen[best_static], seed),
                    "ig_vs_random_ppl_pct": 100.0 * (ig / methods["random"]["overall_ppl"] - 1.0),
                    "ig_vs_random_ppl_pct_ci95": _paired_bootstrap(results, chosen["ig"], chosen["random"], seed),
                    "ig_beats_best_static": ig < best,
                    "random_worse_than_ig": methods["random"]["overall_ppl"] > ig,
                    "oracle_bounds_ig": methods["oracle"]["overall_ppl"] <= ig},
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


def run(args: argparse.Namespace) -> int:
    from router.router import Router
    from server import models
    from server.runner import BlockRunner

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    lm = models.load(args.model, dtype=models.resolve_weights(args.weights)[1], weights=args.weights)
    bank = MaskBank.load(args.bank)
    runner = BlockRunner(lm.model, max_slots=1, max_len=args.max_len)
    bank.check_model(lm.fingerprint, runner.num_blocks)
    domains = {d: texts[: args.docs_per_domain] for d, texts in load_domain_dir(args.data).items()}
    router = Router(bank)
    routes = {d: [r.mask_id for r in router.route(texts)] for d, texts in domains.items()}
    report = {"bank": str(args.bank), "model": lm.name, "weights": lm.weights, "data": str(args.data),
              "docs_per_domain": args.docs_per_domain, "max_len": args.max_len}
    report.update(evaluate_bank(runner, lm.tokenizer, bank, domains, routes, args.max_len, args.batch_size, args.seed))
    report["seconds"] = round(time.perf_counter() - start, 1)
    write_report(report, args.json, args.plot, plot_report)
    print(format_report(report))
    print(f"wrote {args.json}{' and ' + str(args.plot) if args.plot else ''} in {report['seconds']:.0f} s")
    return 0
