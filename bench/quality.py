"""`igserve bench quality`: held-out perplexity and greedy agreement of each weight format vs fp32.

Dense model (no mask), the first ``--docs-per-domain`` held-out documents of every domain, each
scored on its first ``--max-len`` tokens with ``masks.evaluate.score_batch`` (the scoring of
``igserve eval``). Greedy agreement: the share of ``--agree-tokens`` greedy tokens per benchmark
prompt (``load/prompts.jsonl``, chat template) equal to fp32's, up to the first difference.
A format listed in ``--no-agree`` skips the agreement run (one too slow to be worth it on the machine at hand).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from bench.serve import PROMPTS
from masks.corpus import load_domain_dir
from masks.evaluate import DENSE, score_batch
from server import models
from server.runner import BlockRunner
from server.weights import machine


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--data", type=Path, default=Path("data/corpus/heldout"))
    parser.add_argument("--weights", default="fp32,bf16,int8,int4")
    parser.add_argument("--docs-per-domain", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8, help="benchmark prompts for greedy agreement")
    parser.add_argument("--agree-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-dtype", default="float32", choices=("float32", "float16", "auto"),
                        help="the greedy runs' K/V cache (perplexity is cache-free); auto: as the server picks")
    parser.add_argument("--no-agree", default="", help="comma-separated formats without the agreement run")
    parser.add_argument("--append", action="store_true",
                        help="add formats to an existing --json report, against its first format")
    parser.add_argument("--json", default="bench/results/quality.json")


def perplexity(runner, tokenizer, docs: list[str], max_len: int, batch_size: int) -> tuple[float, int]:
    nll, tokens = 0.0, 0
    dense = torch.ones(runner.num_blocks, dtype=torch.bool)
    for i in range(0, len(docs), batch_size):
        enc = tokenizer(docs[i:i + batch_size], truncation=True, max_length=max_len, padding=True,
                        return_tensors="pt")
        ids, valid = enc["input_ids"], enc["attention_mask"].bool()
        out = score_batch(runner, ids, valid, {DENSE: dense})[DENSE]
        nll += float(out["nll"].sum())
        tokens += int((valid[:, 1:] & valid[:, :-1]).sum())
    return math.exp(nll / tokens), tokens


def greedy(runner, prompts: list[list[int]], n: int) -> list[list[int]]:
    dense = torch.ones(1, runner.num_blocks, dtype=torch.bool)
    outs = []
    for ids in prompts:
        tok = int(runner.prefill([ids], dense, [0]).argmax(-1))
        out = [tok]
        for step in range(n - 1):
            tok = int(runner.decode([tok], [len(ids) + step], dense, [0]).argmax(-1))
            out.append(tok)
        outs.append(out)
    return outs


def run(args) -> int:
    docs = [t for texts in load_domain_dir(args.data).values() for t in texts[: args.docs_per_domain]]
    items = [json.loads(line) for line in Path(PROMPTS).read_text().splitlines() if line.strip()][: args.prompts]
    no_agree = {f for f in args.no_agree.split(",") if f}
    rows, reference, commands = [], None, []
    if args.append and Path(args.json).is_file():
        old = json.loads(Path(args.json).read_text())
        rows, commands = old["formats"], old["commands"]
        reference = {"ppl": rows[0]["ppl"], "outs": rows[0].get("greedy_tokens")}
    commands.append(f"igserve bench quality --weights {args.weights} --docs-per-domain {args.docs_per_domain} "
                    f"--max-len {args.max_len} --prompts {args.prompts} --agree-tokens {args.agree_tokens}"
                    + (f" --kv-cache-dtype {args.kv_cache_dtype}" if args.kv_cache_dtype != "float32" else "")
                    + (f" --no-agree {args.no_agree}" if args.no_agree else "") + (" --append" if args.append else ""))
    for fmt in [f for f in args.weights.split(",") if f]:
        start = time.perf_counter()
        weights, dtype = models.resolve_weights(fmt)
        lm = models.load(args.model, dtype=dtype, weights=weights)
        tok = lm.tokenizer
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "right"
        prompts = [tok.apply_chat_template([{"role": "user", "content": it["prompt"]}], add_generation_prompt=True)
                   for it in items]
        prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
        kv = "auto" if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype)
        runner = BlockRunner(lm.model, max_batch=1, max_len=max(args.max_len, max(map(len, prompts)) + args.agree_tokens + 1),
                             kv_dtype=kv)
        with torch.inference_mode():
            ppl, n = perplexity(runner, tok, docs, args.max_len, args.batch_size)
            outs = None if fmt in no_agree else greedy(runner, prompts, args.agree_tokens)
        row = {"weights": weights, "dtype": str(dtype).removeprefix("torch."),
               "kv_cache_dtype": str(runner.cache.dtype).removeprefix("torch."), "ppl": round(ppl, 4),
               "tokens": n, "seconds": round(time.perf_counter() - start, 1)}
        if reference is None:
            reference = {"ppl": ppl, "outs": outs}
            row["greedy_tokens"] = outs
        row["ppl_vs_first"] = round(ppl / reference["ppl"] - 1, 5)
        if outs is not None and reference["outs"] is not None:
            agree = []
            for a, b in zip(outs, reference["outs"]):
                k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                agree.append(k / len(a))
            row["greedy_prefix_agreement"] = round(sum(agree) / len(agree), 4)
            row["greedy_identical_prompts"] = sum(a == 1.0 for a in agree)
        print({k: v for k, v in row.items() if k != "greedy_tokens"}, flush=True)
        same = [i for i, r in enumerate(rows) if (r["weights"], r.get("kv_cache_dtype", "float32"))
                == (row["weights"], row["kv_cache_dtype"])]
        if same:  # measured again (--append): the new row takes the old one's place
            rows[same[0]] = row
        else:
            rows.append(row)
        report = {"model": args.model, "data": str(args.data), "docs": len(docs), "max_len": args.max_len,
                  "agreement_prompts": len(items), "agree_tokens": args.agree_tokens,
                  "reference": rows[0]["weights"], "commands": commands, "machine": machine(), "formats": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")  # after every format
    return 0
