"""L0 mask training: Hard Concrete gates over the 2L blocks of a frozen LM, KL to the dense teacher.

The dense teacher's next-token distributions are computed once per document, on a seeded sample of
positions, and kept as top-k log-probabilities (the rest of the vocabulary folded into one tail
bin). The student is the same LM run through the block-masked runner with sampled soft gates; only
the gate logits (minimised) and the two Lagrange multipliers (maximised) train. The final mask keeps
the exact block budget with the largest deterministic gates. Training checkpoints itself so an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from tqdm import tqdm

from masks.hard_concrete import HardConcrete, Lagrangian, binarise, warmup_target


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 60  # optimiser steps per mask
    batch_size: int = 4  # sequences per step
    seq_len: int = 64  # tokens per sequence (documents are truncated)
    kl_positions: int = 32  # positions per sequence where the KL (and the lm_head) is computed
    top_k: int = 64  # teacher probabilities kept per position; the rest form one tail bin
    lr: float = 0.3  # Adam, gate logits
    lambda_lr: float = 20.0  # SGD (ascent), Lagrange multipliers
    warmup: float = 0.5  # fraction of the steps over which the sparsity target ramps up
    init_log_alpha: float = 2.5
    checkpoint_every: int = 10
    dtype: str = "bfloat16"  # the student's weights during training (the teacher and all scoring stay fp32)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Targets:
    """Tokenised documents with their dense-teacher targets on sampled positions."""

    ids: torch.Tensor  # [n, T] long, right-padded
    valid: torch.Tensor  # [n, T] bool, real tokens
    positions: torch.Tensor  # [n, P] long, positions whose next token is predicted
    weights: torch.Tensor  # [n, P] float, 0 for padding positions of short documents
    top_idx: torch.Tensor  # [n, P, k] long
    top_logp: torch.Tensor  # [n, P, k] float, teacher log-probabilities of top_idx

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, idx: torch.Tensor) -> "Targets":
        return Targets(*(t[idx] for t in self._fields()))

    def _fields(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    @staticmethod
    def cat(parts: list["Targets"]) -> "Targets":
        width = max(p.ids.shape[1] for p in parts)
        padded = [Targets(torch.nn.functional.pad(p.ids, (0, width - p.ids.shape[1])),
                          torch.nn.functional.pad(p.valid, (0, width - p.valid.shape[1])), *p._fields()[2:])
                  for p in parts]
        return Targets(*(torch.cat(ts) for ts in zip(*(p._fields() for p in padded))))

    def save(self, path: Path) -> None:
        torch.save({f.name: getattr(self, f.name) for f in fields(self)}, path)

    @staticmethod
    def load(path: Path) -> "Targets":
        return Targets(**torch.load(path))


def tokenize(tokenizer, texts: list[str], seq_len: int, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [n, T], valid [n, T]) of each text's first ``seq_len`` tokens, right-padded."""
    rows = tokenizer(list(texts), truncation=True, max_length=seq_len)["input_ids"]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        valid[i, : len(r)] = True
    return ids, valid


def sample_positions(lengths: torch.Tensor, count: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` distinct predicting positions (0 .. len-2) per row; (positions, weights)."""
    positions = torch.zeros(len(lengths), count, dtype=torch.long)
    weights = torch.zeros(len(lengths), count)
    for i, n in enumerate((lengths - 1).clamp_min(0).tolist()):
        pick = torch.randperm(n, generator=gen)[:count].sort().values
        positions[i, : len(pick)] = pick
        weights[i, : len(pick)] = 1.0
    return positions, weights


def _position_logits(runner, ids, valid, positions, gates) -> torch.Tensor:
    """Logits [b, P, V] at the given positions under per-row gates or masks."""
    h = runner.hidden(ids, gates, valid)
    return runner.lm_head(h[torch.arange(len(ids))[:, None], positions]).float()


@torch.no_grad()
def teacher_targets(runner, ids, valid, positions, weights, top_k: int, batch_size: int = 8,
                    desc: str = "teacher") -> Targets:
    """Dense-model top-k next-token log-probabilities at the sampled positions."""
    dense = torch.ones(runner.num_blocks, dtype=torch.bool)
    idx_parts, logp_parts = [], []
    for start in tqdm(range(0, len(ids), batch_size), desc=desc, unit="batch", leave=False):
        sl = slice(start, start + batch_size)
        logp = _position_logits(runner, ids[sl], valid[sl], positions[sl], dense).log_softmax(-1)
        top = logp.topk(top_k, dim=-1)
        idx_parts.append(top.indices)
        logp_parts.append(top.values)
    return Targets(ids, valid, positions, weights, torch.cat(idx_parts), torch.cat(logp_parts))


def topk_kl(student_logits: torch.Tensor, top_idx: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position over the teacher's top-k tokens plus one tail bin.

    The tail bin holds the remaining probability of each distribution, so this is the exact KL of
    the two distributions coarsened to k + 1 outcomes (a lower bound of the full KL).
    """
    s_logp = student_logits.log_softmax(-1)
    s_top = s_logp.gather(-1, top_idx)
    t_top = top_logp.exp()
    t_tail = (1.0 - t_top.sum(-1)).clamp_min(1e-8)
    s_tail = (1.0 - s_top.exp().sum(-1)).clamp_min(1e-8)
    return (t_top * (top_logp - s_top)).sum(-1) + t_tail * (t_tail.log() - s_tail.log())


def batch_kl(runner, targets: Targets, idx: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Mean KL to the teacher over the sampled positions of documents ``idx`` under ``gates``."""
    logits = _position_logits(runner, targets.ids[idx], targets.valid[idx], targets.positions[idx], gates)
    kl = topk_kl(logits, targets.top_idx[idx], targets.top_logp[idx])
    w = targets.weights[idx]
    return (kl * w).sum() / w.sum().clamp_min(1.0)


@torch.no_grad()
def mask_kl(runner, targets: Targets, mask: torch.Tensor, batch_size: int = 8) -> float:
    """Position-weighted mean KL to the teacher of a bool mask over all of ``targets``."""
    total, count = 0.0, 0.0
    for start in range(0, len(targets), batch_size):
        idx = torch.arange(start, min(start + batch_size, len(targets)))
        w = float(targets.weights[idx].sum())
        total += float(batch_kl(runner, targets, idx, mask)) * w
        count += w
    return total / max(count, 1.0)


def train_gates(runner, targets: Targets, sparsity: float, cfg: TrainConfig, seed: int = 0,
                doc_weights: torch.Tensor | None = None, checkpoint: Path | None = None,
                desc: str = "L0") -> dict:
    """Learn gate logits for one mask; returns {"log_alpha", "history"}.

    Each step draws ``batch_size`` documents (with replacement, by ``doc_weights`` if given), one
    gate sample per document, and minimises KL + lambda1 (skip - t) + lambda2 (skip - t)^2 where
    skip is the expected fraction of zero gates and t ramps linearly to ``sparsity``.
    """
    gen = torch.Generator().manual_seed(seed)
    gates = HardConcrete(runner.num_blocks, cfg.init_log_alpha)
    lagrangian = Lagrangian()
    opt = torch.optim.Adam(gates.parameters(), lr=cfg.lr)
    opt_lambda = torch.optim.SGD(lagrangian.parameters(), lr=cfg.lambda_lr, maximize=True)
    weights = torch.ones(len(targets)) if doc_weights is None else doc_weights.float()
    step, history = 0, []
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint)
        gates.load_state_dict(state["gates"])
        lagrangian.load_state_dict(state["lagrangian"])
        opt.load_state_dict(state["opt"])
        opt_lambda.load_state_dict(state["opt_lambda"])
        gen.set_state(state["generator"])
        step, history = state["step"], state["history"]

    def save() -> None:
        if checkpoint is not None:
            tmp = checkpoint.with_suffix(".tmp")
            torch.save({"gates": gates.state_dict(), "lagrangian": lagrangian.state_dict(), "opt": opt.state_dict(),
                        "opt_lambda": opt_lambda.state_dict(), "generator": gen.get_state(), "step": step,
                        "history": history}, tmp)
            tmp.replace(checkpoint)

    warmup_steps = math.ceil(cfg.warmup * cfg.steps)
    bar = tqdm(total=cfg.steps, initial=step, desc=desc, unit="step", leave=False)
    while step < cfg.steps:
        idx = torch.multinomial(weights, cfg.batch_size, replacement=True, generator=gen)
        z = gates.sample(cfg.batch_size, gen)
        kl = batch_kl(runner, targets, idx, z)
        skip = gates.expected_skip()
        target = warmup_target(step, warmup_steps, sparsity)
        loss = kl + lagrangian(skip, target)
        opt.zero_grad()
        opt_lambda.zero_grad()
        loss.backward()
        opt.step()
        opt_lambda.step()
        step += 1
        history.append({"step": step, "kl": float(kl.detach()), "skip": float(skip.detach()), "target": target})
        bar.update(1)
        bar.set_postfix(kl=f"{history[-1]['kl']:.3f}", skip=f"{history[-1]['skip']:.3f}", t=f"{target:.3f}")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            save()
    bar.close()
    return {"log_alpha": gates.log_alpha.detach().clone(), "history": history}


def train_mask(runner, targets: Targets, sparsity: float, cfg: TrainConfig, seed: int = 0,
               doc_weights: torch.Tensor | None = None, checkpoint: Path | None = None, desc: str = "L0") -> dict:
    """Train gates and binarise them to the exact budget; {"mask", "log_alpha", "history"}."""
    result = train_gates(runner, targets, sparsity, cfg, seed, doc_weights, checkpoint, desc)
    return {**result, "mask": binarise(result["log_alpha"], sparsity)}
