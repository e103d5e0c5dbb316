"""`igserve bench kernels`: where a decode step's matmul time goes, per linear family and rows.

For each weight format (``--weights``) and number of rows (``--rows``), every family of the
model's linears (fused q/k/v, o, fused gate/up, down over all layers; the lm_head) is timed the way
a step runs it: one layer's module after the other, so the weights stream from memory as in a
forward rather than staying in cache. Each figure is the median of ``--repeats`` interleaved
passes: milliseconds per step, GMAC/s and weight GB/s (the weights' bytes as served,
server/cost.py). Same shapes, same process: the families and formats compare directly.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from server import cpu_kernels, models, weights as wf
from server.cost import module_bytes
from server.runner import BlockRunner


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--weights", default="int4,int4q8", help="comma-separated weight formats")
    parser.add_argument("--rows", default="1,4,16,64", help="comma-separated rows per call")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default="bench/results/kernels.json", help="report path")


def families(runner: BlockRunner) -> dict[str, list[torch.nn.Module]]:
    """Each linear family as a step runs it: one module per layer, and the lm_head."""
    per_layer = [runner.fused_linears(i) for i in range(runner.num_layers)]
    out = {name: [layer[name] for layer in per_layer] for name in per_layer[0]}
    out["lm_head"] = [runner.model.lm_head]
    return out


def _pass_s(modules: list[torch.nn.Module], x: torch.Tensor) -> float:
    start = time.perf_counter()
    for m in modules:
        m(x)
    return time.perf_counter() - start


@torch.inference_mode()
def measure(runner: BlockRunner, rows: list[int], repeats: int) -> list[dict]:
    """One record per (family, rows): median ms per step over interleaved repeats, GMAC/s, GB/s."""
    fams = families(runner)
    inputs = {(name, r): torch.randn(r, mods[0].in_features, dtype=runner.dtype)
              for name, mods in fams.items() for r in rows}
    for (name, _), x in inputs.items():  # warm-up: one-time packing, first-touch pages
        _pass_s(fams[name], x)
    times: dict[tuple[str, int], list[float]] = {key: [] for key in inputs}
    for _ in range(repeats):
        for (name, r), x in inputs.items():
            times[name, r].append(_pass_s(fams[name], x))
    out = []
    for (name, r), ts in times.items():
        s = statistics.median(ts)
        weights = sum(m.in_features * m.out_features for m in fams[name])
        size = sum(module_bytes(m) for m in fams[name])
        out.append({"family": name, "rows": r, "modules": len(fams[name]), "ms_per_step": round(1000 * s, 3),
                    "gmac_s": round(weights * r / s / 1e9, 1),
                    "weight_mb": round(size / 1e6, 4), "weight_gb_s": round(size / s / 1e9, 1),
                    "spread_ms": [round(1000 * min(ts), 3), round(1000 * max(ts), 3)]})
    return out


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    report = {"command": args.invocation, "model": args.model, "threads": torch.get_num_threads(),
              **wf.machine(),
              "torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "repeats": args.repeats, **cpu_kernels.int4bf16_rows(), "formats": {}}
    for fmt in args.weights.split(","):
        weights, dtype = models.resolve_weights(fmt)
        lm = models.load(args.model, dtype=dtype, weights=weights)
        runner = BlockRunner(lm.model, max_batch=1, max_len=64)
        runs = measure(runner, rows, args.repeats)
        report["formats"][fmt] = {"kernels": wf.kernels(lm.model), "dtype": str(dtype).removeprefix("torch."),
                                  "runs": runs}
        for r in runs:
            print(f"{fmt:8s} {r['family']:8s} x{r['rows']:<3d} {r['ms_per_step']:8.3f} ms  {r['gmac_s']:7.1f} GMAC/s  "
                  f"{r['weight_gb_s']:6.1f} GB/s", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0
