"""`igserve bench decode`: prefill and decode throughput of HF generate vs the block-masked runner.

One process, one prompt, batch 1, greedy. Runs: HF ``generate`` dense, the runner dense, and the
runner with masks that skip 25% of the blocks (attention only, FFN only, mixed), each next to its
ideal speedup from the parameters touched per token. ``speedup`` is decode tokens/s over the
runner's dense figure from the same run. Each figure is the median of ``--repeats`` runs.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from server import models
from server.engine import LLMEngine, Request
from server.runner import BlockRunner
from server.sampling import SamplingParams

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


def run_runner(engine: LLMEngine, prompt_ids: list[int], mask: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    engine.add(Request(prompt_ids, mask, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)))
    times = []
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
        times.append(time.perf_counter())
    return _rates(start, times, len(prompt_ids))


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--json", default="bench/results/decode.json", help="report path")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = models.load(args.model)
    ids = lm.tokenizer(PROMPT * 8, add_special_tokens=False)["input_ids"][: args.prompt_tokens]
    runner = BlockRunner(lm.model, max_slots=1, max_len=args.prompt_tokens + args.new_tokens + 1)
    engine = LLMEngine(runner, lm.tokenizer)
    dense = torch.ones(runner.num_blocks, dtype=torch.bool)
    cases = [("hf_generate_dense", None), ("runner_dense", dense)]
    cases += [(f"runner_{name}", mask) for name, mask in skip_masks(runner.num_layers).items()]

    def measure(mask):
        if mask is None:
            return run_hf(lm.model, ids, args.new_tokens)
        return run_runner(engine, ids, mask, args.new_tokens)

    with torch.inference_mode():
        for _, mask in cases:  # warm-up: allocator, kernels, caches
            measure(mask)
        samples = {name: [] for name, _ in cases}
        for _ in range(args.repeats):  # interleaved, so drift in machine load hits every case alike
            for name, mask in cases:
                samples[name].append(measure(mask))

    runs = []
    for name, mask in cases:
        prefill = statistics.median(s[0] for s in samples[name])
        decode = statistics.median(s[1] for s in samples[name])
        mask = dense if mask is None else mask
        runs.append({
            "name": name,
            "skip_ratio": 1 - float(mask.float().mean()),
            "skipped_blocks": [b for b, keep in zip(runner.block_names, mask.tolist()) if not keep],
            "decode_tok_s": round(decode, 2),
            "prefill_tok_s": round(prefill, 1),
            "ideal_speedup": round(runner.ideal_speedup(mask), 4),
            "decode_tok_s_samples": [round(s[1], 2) for s in samples[name]],
        })
    base = next(r["decode_tok_s"] for r in runs if r["name"] == "runner_dense")
    for r in runs:
        r["speedup"] = round(r["decode_tok_s"] / base, 4)
        r["fraction_of_ideal"] = round(r["speedup"] / r["ideal_speedup"], 4)
    report = {
        "model": lm.name,
        "fingerprint": lm.fingerprint,
        "threads": torch.get_num_threads(),
        "device": "cpu",
        "dtype": str(runner.dtype).replace("torch.", ""),
        "machine": platform.processor() or platform.machine(),
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "command": f"igserve bench decode --model {args.model} --json {args.json}",
        "runs": runs,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'run':<20}{'skip':>6}{'decode tok/s':>14}{'prefill tok/s':>15}{'speedup':>9}{'ideal':>8}")
    for r in runs:
        print(f"{r['name']:<20}{r['skip_ratio']:>6.2f}{r['decode_tok_s']:>14.2f}{r['prefill_tok_s']:>15.1f}"
              f"{r['speedup']:>9.3f}{r['ideal_speedup']:>8.3f}")
    return 0
