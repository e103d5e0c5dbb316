"""`igserve bench decode`: prefill and decode throughput per weight format, HF generate vs the runner.

One process, one prompt, greedy. For each weight format (``--weights``): the runner dense at batch
1 and at a batch of ``--batch`` rows, and at batch 1 with masks that skip 25% of the blocks
(attention only, FFN only, mixed), each next to its ideal speedup from the weight bytes touched
per token in that format (server/cost.py). HF ``generate`` runs dense on the fp32 weights.
``speedup`` is decode tokens/s over the same format's dense batch-1 figure from the same run.
Each figure is the median of ``--repeats`` runs, interleaved so machine load hits every case alike.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from server import cpu_kernels, models, weights as wf
from server.runner import BlockRunner

PROMPT = (
    "The history of astronomy spans thousands of years, from the first observations of the night sky by "
    "ancient civilisations to modern space telescopes. Early astronomers tracked the motions of the Sun, "
    "the Moon and the planets to build calendars, predict eclipses and navigate across seas. "
)


def skip_masks(num_layers: int, fraction: float = 0.25) -> dict[str, torch.Tensor]:
    """Masks that skip round(fraction * 2L) blocks in the deep layers (never the last layer)."""
    n = round(fraction * 2 * num_layers)
    deep = list(range(num_layers - 1 - n, num_layers - 1))  # n layers before the last
    out = {}
    for name, blocks in (
        ("attn25", [2 * i for i in deep]),
        ("ffn25", [2 * i + 1 for i in deep]),
        ("mixed25", [2 * i + (k % 2) for k, i in enumerate(deep)]),
    ):
        mask = torch.ones(2 * num_layers, dtype=torch.bool)
        mask[blocks] = False
        out[name] = mask
    return out


class _TokenClock(BaseStreamer):
    """Timestamps every token HF generate emits (the first put() is the prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _rates(start: float, times: list[float], prompt_len: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) from the start time and one timestamp per new token."""
    prefill = prompt_len / (times[0] - start)
    decode = (len(times) - 1) / (times[-1] - times[0])
    return prefill, decode


def run_hf(model, prompt_ids: list[int], new_tokens: int) -> tuple[float, float]:
    clock = _TokenClock()
    ids = torch.tensor([prompt_ids])
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, streamer=clock)
    return _rates(start, clock.times[1:], len(prompt_ids))


def run_runner(runner: BlockRunner, prompt_ids: list[int], mask: torch.Tensor, new_tokens: int,
               batch: int = 1) -> tuple[float, float]:
    """Greedy decode of ``batch`` copies of the prompt through the runner as the engine drives it
    (one host sync per step for the sampled tokens); (prefill tok/s of one prompt, decode tok/s of
    all rows)."""
    masks = mask.expand(batch, -1)
    slots = list(range(batch))
    start = time.perf_counter()
    tokens = cpu_kernels.argmax(runner.prefill([prompt_ids], masks[:1], [0])).tolist() * batch
    times = [time.perf_counter()]
    runner.copy_slot(0, slots[1:], len(prompt_ids))  # the rows share the prompt: prefill it once
    for step in range(new_tokens - 1):
        tokens = cpu_kernels.argmax(runner.decode(tokens, [len(prompt_ids) + step] * batch, masks, slots)).tolist()
        times.append(time.perf_counter())
    prefill, decode = _rates(start, times, len(prompt_ids))
    return prefill, decode * batch


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--json", default="bench/results/decode.json", help="report path")
    parser.add_argument("--weights", default="fp32,bf16,int8,int4",
                        help="comma-separated weight formats, each optionally FORMAT:DTYPE (activations, "
                             "e.g. int4:bfloat16; default: what auto picks)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="rows of the batched dense run (0: skip it)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-dtypes", default="auto",
                        help="comma-separated K/V cache dtypes, each run per format (auto: as the server picks)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def prompt_ids(tokenizer, n: int) -> list[int]:
    """The benchmark prompt's first ``n`` tokens (PROMPT repeated as far as needed)."""
    return tokenizer(PROMPT * (1 + n // 40), add_special_tokens=False)["input_ids"][:n]


def dense_decode_tok_s(model: str, fmt: str, prompt_tokens: int = 128, new_tokens: int = 64, repeats: int = 3) -> float:
    """Median batch-1 dense decode tok/s of the runner in weight format ``fmt`` (this module's prompt
    and timing), for reports that set it beside a peer's batch-1 figure (``bench compare``)."""
    resolved, dtype = models.resolve_weights(fmt, "auto")
    lm = models.load(model, dtype=dtype, weights=resolved)
    runner = BlockRunner(lm.model, max_batch=1, max_len=prompt_tokens + new_tokens + 1)
    ids = prompt_ids(lm.tokenizer, prompt_tokens)
    dense = torch.ones(runner.num_blocks, dtype=torch.bool)
    with torch.inference_mode():
        run_runner(runner, ids, dense, new_tokens)  # warm-up
        return round(statistics.median(run_runner(runner, ids, dense, new_tokens)[1] for _ in range(repeats)), 2)


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    cases, runners, lms = _cases(args)
    lm0 = next(iter(lms.values()))
    ids = prompt_ids(lm0.tokenizer, args.prompt_tokens)
    samples = _measure(cases, runners, lms, ids, args.new_tokens, args.repeats)
    runs = [_run_record(case, samples[case[0], case[1]], runners[case[1]]) for case in cases]
    for r in runs:
        base = next(b["decode_tok_s"] for b in runs if b["name"] == "runner_dense" and b["weights"] == r["weights"])
        r["speedup"] = round(r["decode_tok_s"] / base, 4)
        r["fraction_of_ideal"] = round(r["speedup"] / r["ideal_speedup"], 4) if r["batch"] == 1 else None
    report = {
        "model": lm0.name,
        "fingerprint": lm0.fingerprint,
        "threads": torch.get_num_threads(),
        "device": "cpu",
        **wf.machine(),
        "torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "auto_weights": wf.auto_format(),
        "kernels": {fmt: runner.kernels for fmt, runner in runners.items()},
        **cpu_kernels.int4bf16_rows(),
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "command": args.invocation,
        "runs": runs,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    _print_runs(runs)
    return 0


def _cases(args) -> tuple[list[tuple], dict[str, BlockRunner], dict]:
    """The cases (name, format, mask or None for HF, batch), and per weight format (and K/V cache
    dtype, ``FORMAT/kv-DTYPE`` when several are asked for) its runner and model."""
    cases, runners, lms = [], {}, {}
    kvs = [k for k in args.kv_cache_dtypes.split(",") if k]
    for spec in [f for f in args.weights.split(",") if f]:
        name, _, act = spec.partition(":")
        resolved, dtype = models.resolve_weights(name, act or "auto")
        lm = models.load(args.model, dtype=dtype, weights=resolved)
        for kv in kvs:  # one model, a runner (and cache) per K/V dtype
            fmt = spec if len(kvs) == 1 else f"{spec}/kv-{kv}"
            lms[fmt] = lm
            runners[fmt] = BlockRunner(lm.model, max_batch=max(1, args.batch),
                                       max_len=args.prompt_tokens + args.new_tokens + 1,
                                       kv_dtype="auto" if kv == "auto" else getattr(torch, kv))
            dense = torch.ones(runners[fmt].num_blocks, dtype=torch.bool)
            if spec == "fp32" and kv == kvs[0]:
                cases.append(("hf_generate_dense", fmt, None, 1))
            cases.append(("runner_dense", fmt, dense, 1))
            if args.batch > 1:
                cases.append((f"runner_dense_b{args.batch}", fmt, dense, args.batch))
            cases += [(f"runner_{n}", fmt, mask, 1) for n, mask in skip_masks(runners[fmt].num_layers).items()]
    return cases, runners, lms


def _measure(cases: list[tuple], runners: dict, lms: dict, ids: list[int], new_tokens: int,
             repeats: int) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """(name, format) -> (prefill, decode) tok/s per repeat, after one warm-up round (allocator,
    kernels, caches); the cases interleave so machine load hits each alike."""
    def one(case):
        _, fmt, mask, batch = case
        if mask is None:
            return run_hf(lms[fmt].model, ids, new_tokens)
        return run_runner(runners[fmt], ids, mask, new_tokens, batch)

    with torch.inference_mode():
        for case in cases:
            one(case)
        samples = {(c[0], c[1]): [] for c in cases}
        for _ in range(repeats):
            for case in cases:
                samples[case[0], case[1]].append(one(case))
    return samples


def _run_record(case: tuple, got: list[tuple[float, float]], runner: BlockRunner) -> dict:
    """One case's medians, its mask and the weight bytes it reads per token."""
    name, fmt, mask, batch = case
    mask = torch.ones(runner.num_blocks, dtype=torch.bool) if mask is None else mask
    return {
        "name": name, "weights": fmt, "batch": batch,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(runner.cache.dtype).removeprefix("torch."),
        "skip_ratio": round(1 - float(mask.float().mean()), 4),
        "skipped_blocks": [b for b, keep in zip(runner.block_names, mask.tolist()) if not keep],
        "decode_tok_s": round(statistics.median(s[1] for s in got), 2),
        "prefill_tok_s": round(statistics.median(s[0] for s in got), 1),
        "weight_mb_per_token": round(runner.cost.bytes(mask) / 2**20, 1),
        "ideal_speedup": round(runner.cost.ideal_speedup(mask), 4),
        "decode_tok_s_samples": [round(s[1], 2) for s in got],
    }


def _print_runs(runs: list[dict]) -> None:
    print(f"{'run':<20}{'weights':>14}{'batch':>6}{'skip':>6}{'decode tok/s':>14}{'prefill tok/s':>15}"
          f"{'speedup':>9}{'ideal':>8}")
    for r in runs:
        print(f"{r['name']:<20}{r['weights']:>14}{r['batch']:>6}{r['skip_ratio']:>6.2f}{r['decode_tok_s']:>14.2f}"
              f"{r['prefill_tok_s']:>15.1f}{r['speedup']:>9.3f}{r['ideal_speedup']:>8.3f}")
