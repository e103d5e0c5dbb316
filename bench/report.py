"""`igserve bench report`: renders bench/REPORT.md and its plots from the committed JSON reports.

Reads what is present under ``--results`` (decode.json, serve.json, encoder.json, eval_*.json,
zeroshot_*.json, locust_stats.csv) and says which reports are missing rather than inventing numbers.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METHOD_ORDER = ("dense", "ig", "ig_centroid", "static_l0", "shortgpt", "greedy", "random", "oracle", "ig_ood")


def add_arguments(parser) -> None:
    parser.add_argument("--results", type=Path, default=Path("bench/results"))
    parser.add_argument("--out", type=Path, default=Path("bench/REPORT.md"))


def _load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def decode_section(report: dict) -> list[str]:
    out = ["## Decode throughput (`bench/results/decode.json`)", "",
           f"{report['model']}, {report['prompt_tokens']}-token prompt, {report['new_tokens']} new tokens, "
           f"{report['threads']} threads, median of {report['repeats']}; ideal speedup from the weight bytes "
           f"read per token in each format.", ""]
    rows = [[r["name"], r.get("weights", report.get("dtype")), r.get("batch", 1), f"{r['skip_ratio']:.2f}",
             f"{r['decode_tok_s']:.1f}", f"{r['prefill_tok_s']:.0f}", f"{r['speedup']:.3f}",
             f"{r['ideal_speedup']:.3f}", "" if r["fraction_of_ideal"] is None else f"{r['fraction_of_ideal']:.0%}"]
            for r in report["runs"]]
    return out + _table(["run", "weights", "batch", "skip", "decode tok/s", "prefill tok/s", "speedup", "ideal",
                         "of ideal"], rows)


def serve_section(report: dict, results: Path) -> list[str]:
    runs = report["runs"]
    modes = sorted({r["mode"] for r in runs})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in modes:
        rs = sorted((r for r in runs if r["mode"] == mode), key=lambda r: r["clients"])
        clients = [r["clients"] for r in rs]
        ax1.plot(clients, [r["output_tok_s"] for r in rs], marker="o", label=mode)
        ax2.plot(clients, [r["ttft_ms_p50"] for r in rs], marker="o", label=f"{mode} TTFT p50")
        ax2.plot(clients, [r["ttft_ms_p95"] for r in rs], marker="x", ls="--", label=f"{mode} TTFT p95")
        ax2.plot(clients, [r["tpot_ms_p50"] for r in rs], marker="s", ls=":", label=f"{mode} TPOT p50")
    ax1.set(xscale="log", xlabel="concurrent streaming clients", ylabel="aggregate output tok/s",
            title="Throughput vs concurrency")
    ax2.set(xscale="log", yscale="log", xlabel="concurrent streaming clients", ylabel="ms", title="Latency")
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(results / "serve.png", dpi=110)
    plt.close(fig)
    rows = [[r["mode"], r["clients"], r["requests"], r["errors"], f"{r['output_tok_s']:.1f}",
             f"{r['ttft_ms_p50']:.0f}", f"{r['ttft_ms_p95']:.0f}", f"{r['tpot_ms_p50']:.1f}",
             f"{r['router_ms_p50']:.1f}", f"{r['skip_ratio_mean']:.3f}"] for r in runs]
    c = report.get("config", {})
    setup = (f"{c.get('model')}, bank {c.get('bank')}, {c.get('dtype') or 'float32'}, {c.get('requests_per_client')} "
             f"streaming chat requests per client of {c.get('max_tokens')} tokens"
             f"{' (ignore_eos)' if c.get('ignore_eos') else ''}, {c.get('cpus')} CPUs.")
    return (["## Serving (`bench/results/serve.json`)", "", setup, "", "![serve](results/serve.png)", ""]
            + _table(["mode", "clients", "requests", "errors", "output tok/s", "TTFT p50 ms", "TTFT p95 ms",
                      "TPOT p50 ms", "router p50 ms", "skip ratio"], rows))


def eval_section(reports: list[tuple[str, dict]], results: Path) -> list[str]:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    out = ["## Quality vs compute saved (`bench/results/eval_*.json`)", "",
           "![quality](results/quality_vs_compute.png)", ""]
    for name, report in reports:
        methods = report["methods"]
        for i, m in enumerate(m for m in METHOD_ORDER if m in methods):
            ax.scatter(methods[m].get("compute_saved", 0.0), methods[m]["overall_ppl"], color=f"C{i}",
                       marker="o" if "0.25" in name else "^", label=f"{m} ({name})")
        rows = [[m, f"{methods[m]['overall_ppl']:.3f}", f"{methods[m]['overall_kl']:.4f}",
                 f"{methods[m].get('compute_saved', 0.0):.1%}"] for m in METHOD_ORDER if m in methods]
        out += [f"### {name} (sparsity {report['sparsity']})", ""]
        out += _table(["method", "held-out ppl", "KL to dense", "compute saved / token"], rows)
    ax.set(xlabel="compute saved per token (parameters touched)", ylabel="held-out perplexity (log)",
           yscale="log", title="Held-out perplexity vs compute saved")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(results / "quality_vs_compute.png", dpi=110)
    plt.close(fig)
    return out


def zeroshot_section(reports: list[tuple[str, dict]]) -> list[str]:
    out = ["## Zero-shot accuracy (`bench/results/zeroshot_*.json`)", ""]
    for name, report in reports:
        methods = report["methods"]
        tasks = list(next(iter(methods.values()))["tasks"])
        rows = [[m] + [f"{100 * methods[m]['tasks'][t]['acc_norm']:.1f} ± {100 * methods[m]['tasks'][t]['ci95']:.1f}"
                       for t in tasks] + [f"{100 * methods[m]['mean_acc_norm']:.1f}"]
                for m in METHOD_ORDER if m in methods]
        n = {t: methods["dense"]["tasks"][t]["n"] for t in tasks} if "dense" in methods else {}
        out += [f"### {name} (sparsity {report['sparsity']}), acc_norm %, ± 95% CI; n = {n}", ""]
        out += _table(["method", *tasks, "average"], rows)
    return out


def encoder_section(report: dict) -> list[str]:
    out = ["## Routing encoder (`bench/results/encoder.json`)", "", f"{report['what']}; {report['source']}.", ""]
    rows = [[r["encoder"], r["dtype"], r["when"], f"{r['ms']:.1f}"] for r in report["runs"]]
    return out + _table(["encoder", "dtype", "when", "ms per route"], rows)


def locust_section(path: Path) -> list[str]:
    with path.open() as f:
        rows = [r for r in csv.DictReader(f)]
    keep = ["Type", "Name", "Request Count", "Failure Count", "Median Response Time", "95%", "Requests/s"]
    return (["## Load test (`bench/results/locust_stats.csv`, `make load`)", ""]
            + _table(keep, [[r.get(k, "") for k in keep] for r in rows]))


def run(args) -> int:
    results = args.results
    lines = ["# igserve benchmark report", "",
             "Rendered by `igserve bench report` from the JSON reports in `bench/results/`; "
             "`make bench` re-measures them first.", ""]
    missing = []
    if (decode := _load(results / "decode.json")) is not None:
        lines += decode_section(decode)
    else:
        missing.append("decode.json")
    if (serve := _load(results / "serve.json")) is not None:
        lines += serve_section(serve, results)
    else:
        missing.append("serve.json")
    if (encoder := _load(results / "encoder.json")) is not None:
        lines += encoder_section(encoder)
    else:
        missing.append("encoder.json")
    evals = [(p.stem.removeprefix("eval_"), _load(p)) for p in sorted(results.glob("eval_*.json"))]
    lines += eval_section(evals, results) if evals else []
    missing += [] if evals else ["eval_*.json"]
    zeroshot = [(p.stem.removeprefix("zeroshot_"), _load(p)) for p in sorted(results.glob("zeroshot_*.json"))]
    lines += zeroshot_section(zeroshot) if zeroshot else []
    missing += [] if zeroshot else ["zeroshot_*.json"]
    if (results / "locust_stats.csv").is_file():
        lines += locust_section(results / "locust_stats.csv")
    else:
        missing.append("locust_stats.csv")
    if missing:
        lines += ["## Not measured", "", *(f"- `{m}` is absent" for m in missing), ""]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0
