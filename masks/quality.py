"""`python -m masks.quality`: generation quality of every method against dense, on held-out chat prompts.

Perplexity on documents understates what depth pruning does to generation, so each method is also
measured on what dense itself would answer:

* teacher-forced, on dense's greedy continuation: top-1 agreement (the masked model's argmax is
  dense's next token) and KL(dense || masked) per position;
* free-running: the masked model's own greedy answer against dense's, as the share of answers
  equal to dense's over the first ``--tokens`` tokens and the mean common-prefix fraction.

Answers end at the end-of-turn token or after ``--tokens``. Prompts: the first user question of
each held-out chat document (NQ-Open) and held-out GSM8K questions, in the chat template, routed
on the user turn as the server routes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from masks.bank import DENSE, MaskBank
from masks.corpus import load_texts
from masks.pool import static_masks

END = "<|im_end|>"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from server.models import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--bank", type=Path, required=True, help="format-2 bank (its budgets are measured)")
    parser.add_argument("--data", type=Path, default=Path("data/corpus/heldout"))
    parser.add_argument("--prompts", type=int, default=24, help="prompts (two thirds chat questions, a third math)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens of each answer compared")
    parser.add_argument("--extra-static", default="0.0333,0.0667",
                        help="smaller budgets measured for the static greedy mask only (a fuller curve)")
    parser.add_argument("--budgets", help="comma-separated budgets of the bank to measure (default: all)")
    parser.add_argument("--merge", type=Path, help="earlier report on the same prompts whose methods are kept")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)


def chat_prompts(data: Path, n: int, seed: int) -> list[str]:
    """User questions: first turns of held-out NQ-Open chat documents, then held-out GSM8K questions."""
    chat = [d["text"] for d in load_texts(data / "chat.jsonl") if d.get("source") == "nq_open"]
    questions = [t.split("<|im_start|>user\n", 1)[1].split(END, 1)[0].strip() for t in chat]
    math = [d["text"].split("\nAnswer:", 1)[0].removeprefix("Question: ").strip()
            for d in load_texts(data / "math.jsonl") if d.get("source") == "gsm8k"]
    rng = random.Random(seed)
    n_math = n // 3
    return rng.sample(questions, min(n - n_math, len(questions))) + rng.sample(math, min(n_math, len(math)))


@torch.inference_mode()
def greedy(runner, prompts: list[list[int]], masks: torch.Tensor, n_tokens: int) -> list[list[int]]:
    """Greedy continuation of every prompt under its own mask row, batched with the KV cache."""
    slots = list(range(len(prompts)))
    logits = runner.prefill(prompts, masks, slots)
    out = [[] for _ in prompts]
    for step in range(n_tokens):
        tokens = logits.argmax(-1).tolist()
        for row, tok in zip(out, tokens):
            row.append(tok)
        if step + 1 < n_tokens:
            logits = runner.decode(tokens, [len(p) + step for p in prompts], masks, slots)
    return out


def cut(answer: list[int], end_id: int) -> list[int]:
    return answer[: answer.index(end_id) + 1] if end_id in answer else answer


@torch.inference_mode()
def teacher_forced(runner, prompts: list[list[int]], answers: list[list[int]], masks: torch.Tensor,
                   dense_logp: list[torch.Tensor] | None = None) -> tuple[list[torch.Tensor], list[float], list[float]]:
    """(log-probs at the answer positions, top-1 agreement, mean KL(dense || masked)) per prompt."""
    seqs = [p + a for p, a in zip(prompts, answers)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], valid[i, : len(s)] = torch.tensor(s), True
    logits = runner.forward(ids, masks, valid).float()
    logp, agree, kl = [], [], []
    for i, (p, a) in enumerate(zip(prompts, answers)):
        lp = logits[i, len(p) - 1 : len(p) - 1 + len(a)].log_softmax(-1)
        logp.append(lp)
        agree.append(float((lp.argmax(-1) == torch.tensor(a)).float().mean()))
        ref = lp if dense_logp is None else dense_logp[i]
        kl.append(float((ref.exp() * (ref - lp)).sum(-1).mean()))
    return logp, agree, kl


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def measure(runner, prompts: list[list[int]], masks: torch.Tensor, dense: dict, n_tokens: int, end_id: int) -> dict:
    """Quality of one method (mask row per prompt) against ``dense`` (its answers and log-probs)."""
    _, agree, kl = teacher_forced(runner, prompts, dense["answers"], masks, dense["logp"])
    answers = [cut(a, end_id) for a in greedy(runner, prompts, masks, n_tokens)]
    prefix = [common_prefix(a, d) / len(d) for a, d in zip(answers, dense["answers"])]
    return {"top1_agreement": sum(agree) / len(agree), "kl": sum(kl) / len(kl),
            "exact_answer_share": sum(a == d for a, d in zip(answers, dense["answers"])) / len(answers),
            "common_prefix": sum(prefix) / len(prefix), "per_prompt_top1": [round(x, 4) for x in agree]}


def method_masks(bank: MaskBank, texts: list[str], extra: list[float],
                 budgets: list[float] | None = None, lm=None) -> dict[str, tuple[float, list[str]]]:
    """{method: (budget, mask id per prompt)} for every budget of the bank and the extra static budgets;
    ``lm``: the LM's token table (router.lm_features), for a router that reads it."""
    from router.predictor import KINDS
    from router.router import Router

    out = {}
    n = len(texts)
    routers = {"ig": Router(bank, lm=lm)}
    if bank.router.get("kind") in KINDS:
        routers["ig_centroid"] = Router(bank, method="centroid", ood=False)
    for s in budgets or bank.budget_list():
        for name, mask_id in bank.static_ids(s).items():
            if name != "static_l0":
                out[f"{name}@{s:g}"] = (s, [mask_id] * n)
        for name, router in routers.items():
            out[f"{name}@{s:g}"] = (s, [r.mask_id for r in router.route(texts, budgets=[s] * n)])
    for s in extra:
        out[f"greedy@{s:g}"] = (s, [f"greedy@{s:g}"] * n)
    return out


def evaluate(lm, bank: MaskBank, questions: list[str], n_tokens: int, extra: list[float],
             budgets: list[float] | None = None) -> dict:
    from router.lm_features import TokenTable
    from server.runner import BlockRunner

    tok = lm.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]  # as the server encodes a chat
    end_id = tok.convert_tokens_to_ids(END)
    runner = BlockRunner(lm.model, max_batch=len(prompts), max_len=max(map(len, prompts)) + n_tokens + 1)
    tensors = dict(bank.mask_tensors())
    tensors.update({f"greedy@{s:g}": static_masks(bank, s)["greedy"] for s in extra})
    ones = torch.ones(len(prompts), runner.num_blocks, dtype=torch.bool)
    answers = [cut(a, end_id) for a in greedy(runner, prompts, ones, n_tokens)]
    logp, _, _ = teacher_forced(runner, prompts, answers, ones)
    dense = {"answers": answers, "logp": logp}
    methods = {}
    for name, (s, ids) in method_masks(bank, questions, extra, budgets, TokenTable.of(lm)).items():
        rows = torch.stack([tensors[i] for i in ids])
        saved = sum(runner.cost.compute_saved(r) for r in rows) / len(rows)
        shared = int((~rows).all(0).sum())
        methods[name] = {"budget": s, "compute_saved": saved, "shared_skipped_blocks": shared,
                         "masks_used": {m: ids.count(m) for m in sorted(set(ids))},
                         **measure(runner, prompts, rows, dense, n_tokens, end_id)}
        print(f"{name:22s} saved {saved:6.1%}  top-1 {methods[name]['top1_agreement']:.3f}  "
              f"prefix {methods[name]['common_prefix']:.3f}  exact {methods[name]['exact_answer_share']:.3f}")
    return {"prompts": questions, "dense_answers": [tok.decode(a) for a in answers], "methods": methods}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from masks.evaluate import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    families = sorted({name.split("@")[0] for name in report["methods"]})
    for ax, metric, label in ((axes[0], "top1_agreement", "teacher-forced top-1 agreement with dense"),
                              (axes[1], "common_prefix", "common-prefix share of greedy answers")):
        for i, fam in enumerate(families):
            pts = sorted((m["compute_saved"], m[metric]) for n, m in report["methods"].items() if n.split("@")[0] == fam)
            ax.plot(*zip(*pts), marker="o", color=f"C{i}", label=fam)
        ax.axhline(0.75 if metric == "top1_agreement" else float("nan"), color="grey", ls=":", lw=1)
        ax.set(xlabel="compute saved per token (parameters touched)", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"held-out chat prompts ({len(report['prompts'])}), {report['tokens']} tokens, {report['dtype']}")
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    from server.weights import cpu_flags
    from server import models

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    lm = models.load(args.model)
    bank = MaskBank.load(args.bank)
    bank.check_model(lm.fingerprint, 2 * lm.model.config.num_hidden_layers)
    extra = [float(s) for s in args.extra_static.split(",") if s]
    questions = chat_prompts(args.data, args.prompts, args.seed)
    report = {"command": args.invocation, "bank": str(args.bank),
              "model": lm.name, "dtype": str(lm.model.dtype).removeprefix("torch."), "tokens": args.tokens,
              "cpu_flags": cpu_flags(),
              **evaluate(lm, bank, questions, args.tokens, extra, [float(b) for b in args.budgets.split(",")]
                         if args.budgets else None)}
    if args.merge:
        old = json.loads(args.merge.read_text())
        if old["prompts"] != report["prompts"] or old["dense_answers"] != report["dense_answers"]:
            raise SystemExit(f"{args.merge}: other prompts or dense answers")
        report["methods"] = {**old["methods"], **report["methods"]}
        report["command"] = old["command"] + " ; " + report["command"]
    report["seconds"] = round(time.perf_counter() - start, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(report, args.plot)
    print(f"wrote {args.json} in {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    from server.cli import run_module

    raise SystemExit(run_module(sys.modules[__name__], sys.argv[1:]))
