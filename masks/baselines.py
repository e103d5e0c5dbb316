"""Static block-pruning baselines at a block budget: ShortGPT block influence and greedy removal.

(The third static baseline, one global L0 mask learnt on the whole corpus, is ``train.train_mask``
on all calibration documents; ``masks.build`` runs it.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from masks.train import Targets, mask_kl


@torch.no_grad()
def block_influence(runner, targets: Targets, batch_size: int = 8) -> torch.Tensor:
    """ShortGPT block influence per block: 1 - mean cos(residual in, residual out) over real tokens.

    ShortGPT keeps the most influential blocks: ``hard_concrete.binarise(influence, sparsity)``.

    The residual streams entering each block and the final norm come from a dense forward through
    the runner.
    """
    streams: list[torch.Tensor] = []
    dense = torch.ones(runner.num_blocks, dtype=torch.bool)
    total = torch.zeros(runner.num_blocks, dtype=torch.float64)
    count = 0
    for start in tqdm(range(0, len(targets), batch_size), desc="block influence", unit="batch", leave=False):
        sl = slice(start, start + batch_size)
        valid = targets.valid[sl]
        streams.clear()
        runner.hidden(targets.ids[sl], dense, valid, streams=streams)
        for j in range(runner.num_blocks):
            cos = F.cosine_similarity(streams[j].float(), streams[j + 1].float(), dim=-1)
            total[j] += float(cos[valid].sum())
        count += int(valid.sum())
    return (1.0 - total / count).float()


def greedy_removal(runner, targets: Targets, n_remove: int, batch_size: int = 8,
                   checkpoint: Path | None = None, lazy: bool = False) -> list[dict]:
    """Remove blocks one at a time, each time the one whose removal gives the lowest KL to dense.

    Returns [{"block": j, "kl": KL after removing it, "tried": {candidate: KL}}, ...] of length
    ``n_remove``. Removal is nested, so a run for a larger budget also answers every smaller one:
    with ``checkpoint`` the steps already taken are read back and only the missing ones computed.

    ``lazy`` (lazy greedy): a candidate's KL from an earlier step is taken as a lower bound of its KL
    now (removing more blocks does not help), candidates are tried in order of that bound, and a
    step stops once the best KL found is below every remaining bound. Exact when the bound holds;
    it saves most of the evaluations after the first step.
    """
    steps: list[dict] = json.loads(checkpoint.read_text()) if checkpoint is not None and checkpoint.exists() else []
    mask = torch.ones(runner.num_blocks, dtype=torch.bool)
    bound: dict[int, float] = {}
    for s in steps[:n_remove]:
        mask[s["block"]] = False
        bound.update({int(j): kl for j, kl in s.get("tried", {}).items()})
    for _ in tqdm(range(len(steps), n_remove), desc="greedy removal", unit="block", leave=False):
        candidates = mask.nonzero().squeeze(1).tolist()
        if lazy:
            candidates.sort(key=lambda j: bound.get(j, -math.inf))
        best, tried = None, {}
        for j in tqdm(candidates, desc="candidates", unit="block", leave=False):
            if lazy and best is not None and bound.get(j, -math.inf) >= best[1]:
                break
            trial = mask.clone()
            trial[j] = False
            tried[j] = bound[j] = mask_kl(runner, targets, trial, batch_size)
            if best is None or tried[j] < best[1]:
                best = (j, tried[j])
        mask[best[0]] = False
        steps.append({"block": best[0], "kl": best[1], "tried": {str(j): kl for j, kl in tried.items()}})
        if checkpoint is not None:
            tmp = checkpoint.with_suffix(".tmp")
            tmp.write_text(json.dumps(steps))
            tmp.replace(checkpoint)
    return steps[:n_remove]


def mask_without(num_blocks: int, removed: list[int]) -> torch.Tensor:
    mask = torch.ones(num_blocks, dtype=torch.bool)
    mask[removed] = False
    return mask
