"""Candidate masks at several budgets, derived from one built bank without another search.

Greedy removal is nested: the first n blocks of a removal order are the greedy mask that skips n
blocks. A bank built at sparsity s stores every cluster's removal order and the global greedy
order, so it answers every smaller budget for free; ShortGPT's influence scores and the global L0
gate logits it stores are binarised at each budget the same way.

``more_cluster_masks`` adds the cluster masks of banks built on the same data at other cluster
counts (e.g. k=4 and k=16): masks fit to groups that the bank's own clusters split or merge.
Their centroids are not used.

``shared_core`` makes masks that batch well: every cluster mask of a budget skips the same first
``core`` blocks of the global greedy order, then the first blocks of its own order not in that
core. A decode batch mixing such masks can still skip the whole core.
"""

from __future__ import annotations

import torch

from masks.bank import MaskBank
from masks.baselines import mask_without
from masks.hard_concrete import binarise, budget
from masks.labels import mask_key


def mask_name(name: str, sparsity: float) -> str:
    """Id of a mask in a multi-budget bank: '<name>@<budget>'."""
    return f"{name}@{sparsity:g}"


def removal_orders(bank: MaskBank) -> dict[str, list[int]]:
    """Block removal order per cluster id and for the global greedy baseline, as block indices."""
    index = {b: j for j, b in enumerate(bank.blocks)}
    orders = {c["id"]: [index[b] for b in c["greedy_removal"]] for c in bank.clusters if "greedy_removal" in c}
    orders["greedy"] = [index[s["block"]] for s in bank.training["greedy"]["removal"]]
    return orders


def _skips(num_blocks: int, sparsity: float) -> int:
    return num_blocks - budget(num_blocks, sparsity)


def static_masks(bank: MaskBank, sparsity: float) -> dict[str, torch.Tensor]:
    """The three static baselines at ``sparsity``: greedy prefix, ShortGPT, global L0 gates."""
    b = len(bank.blocks)
    n = _skips(b, sparsity)
    greedy = removal_orders(bank)["greedy"]
    if n > len(greedy):
        raise ValueError(f"bank {bank.sparsity} holds {len(greedy)} greedy removals, budget {sparsity} needs {n}")
    return {"greedy": mask_without(b, greedy[:n]),
            "shortgpt": binarise(torch.tensor(bank.training["shortgpt"]["block_influence"]), sparsity),
            "static_l0": binarise(torch.tensor(bank.training["static_l0"]["gate_logits"]), sparsity)}


def cluster_masks(bank: MaskBank, sparsity: float, core: int = 0) -> dict[str, torch.Tensor]:
    """Each cluster's greedy mask at ``sparsity``; with ``core`` > 0, shared-core masks (see module doc)."""
    b, n = len(bank.blocks), _skips(len(bank.blocks), sparsity)
    orders = removal_orders(bank)
    shared = orders["greedy"][: min(core, n)]
    out = {}
    for cid in bank.mask_ids:
        own = [j for j in orders[cid] if j not in shared][: n - len(shared)]
        if len(shared) + len(own) < n:
            raise ValueError(f"cluster {cid} order too short for budget {sparsity}")
        out[cid] = mask_without(b, shared + own)
    return out


def candidate_pool(bank: MaskBank, budgets: list[float], cores: dict[float, int] | None = None) -> dict[str, dict]:
    """{id: {"budget", "mask" (bool tensor), "kind", "cluster"}} for every budget: one mask per cluster
    and the static masks. Where ``cores`` gives a core size for a budget, its cluster masks are the
    shared-core masks (ids 'core<n>-<cluster>@<budget>', kind "core"), which batch well."""
    pool = {}
    for s in budgets:
        core = (cores or {}).get(s, 0)
        for cid, m in cluster_masks(bank, s, core).items():
            name = f"core{core}-{cid}" if core else cid
            pool[mask_name(name, s)] = {"budget": s, "mask": m, "kind": "core" if core else "cluster", "cluster": cid}
        for name, m in static_masks(bank, s).items():
            pool[mask_name(name, s)] = {"budget": s, "mask": m, "kind": "static"}
    return pool


def more_cluster_masks(pool: dict[str, dict], banks: list[MaskBank], budgets: list[float]) -> int:
    """Add each bank's cluster masks at every budget to ``pool`` (ids 'k<clusters>-<cluster>@<budget>',
    kind "cluster", no centroid of the pool's bank), skipping masks the pool already holds. Returns how
    many were added."""
    held = {mask_key(p["mask"]) for p in pool.values()}
    added = 0
    for bank in banks:
        for s in budgets:
            for cid, m in cluster_masks(bank, s).items():
                if mask_key(m) not in held:
                    name = mask_name(f"k{len(bank.mask_ids)}-{cid}", s)
                    if name in pool:
                        raise ValueError(f"two banks give candidate {name}: one bank per cluster count")
                    held.add(mask_key(m))
                    pool[name] = {"budget": s, "mask": m, "kind": "cluster"}
                    added += 1
    return added


def shared_skips(masks: list[torch.Tensor]) -> int:
    """Blocks that every mask of a batch skips (the blocks the whole batch can skip)."""
    return int((~torch.stack(masks)).all(0).sum())
