"""Assemble a format-2 bank: candidate pool, per-budget specs, the learned router and the OOD threshold."""

from __future__ import annotations

import torch

from masks.bank import DENSE, FORMAT_VERSION, LM_FEATURES_VERSION, MaskBank
from masks.pool import mask_name
from router.predictor import Predictor, cross_validate, fit_spec, out_of_fold

# the predictors cross-validation chooses from (router.predictor): on the encoder's embedding, and
# where the LM's token-table features are given, on them and as a mean of a kNN and a ridge
SPECS = [f"ridge={a:g}" for a in (0.03, 0.1, 0.3, 1.0, 3.0)] + [f"knn={k}" for k in (5, 10, 20, 40)]
LM_SPECS = ([f"lm:ridge={a:g}" for a in (0.3, 1.0, 3.0)] + [f"lm:knn={k}" for k in (10, 20, 40)]
            + [f"knn={k}+lm:ridge={a:g}" for k in (10, 20) for a in (1.0, 3.0)])


def excess_per_token(labels: dict, ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """([n, M] excess NLL per token over dense for each id, [n] tokens) from ``masks.labels`` scores."""
    tokens = torch.tensor(labels["tokens"], dtype=torch.float64).clamp(min=1)
    dense = torch.tensor(labels["nll"][DENSE], dtype=torch.float64)
    nll = torch.tensor([labels["nll"][m] for m in ids], dtype=torch.float64).T
    return (nll - dense[:, None]) / tokens[:, None], tokens


def budget_specs(pool: dict[str, dict], budgets: list[float], cluster_ids: list[str]) -> dict[str, dict]:
    """Per budget: cluster masks aligned with the centroids, every candidate of that budget, the global mask."""
    by_cluster = {(p["budget"], p["cluster"]): k for k, p in pool.items() if "cluster" in p}
    return {f"{s:g}": {"cluster_masks": [by_cluster[s, c] for c in cluster_ids],
                       "candidates": [k for k, p in pool.items() if p["budget"] == s],
                       "global": mask_name("greedy", s)} for s in budgets}


def _reference(excess: torch.Tensor, tokens: torch.Tensor, emb: torch.Tensor, centroids: torch.Tensor,
               cols: dict[str, list[int]]) -> dict[str, float]:
    """Training-label losses of the centroid router and the per-budget oracle, for comparison."""
    nearest = (emb @ centroids.T).argmax(1)
    n = float(tokens.sum()) * len(cols["groups"])
    centroid = sum(float((excess[:, c].gather(1, nearest[:, None]).squeeze(1) * tokens).sum())
                   for c in [torch.tensor(g) for g in cols["clusters"]]) / n
    oracle = sum(float((excess[:, g].min(1).values * tokens).sum()) for g in cols["groups"]) / n
    return {"centroid": centroid, "oracle": oracle}


def select_router(x: dict[str, torch.Tensor], excess: torch.Tensor, tokens: torch.Tensor, ids: list[str],
                  specs: dict[str, dict], centroids: torch.Tensor, seed: int, forced: str | None = None) -> dict:
    """Choose the predictor by 5-fold CV on the training labels (or take ``forced``, a spec); fit it on all
    of them. ``x``: the routing inputs of the label documents (``encoder``, and ``lm`` where given)."""
    col = {m: j for j, m in enumerate(ids)}
    groups = [[col[m] for m in s["candidates"]] for s in specs.values()]
    clusters = [[col[m] for m in s["cluster_masks"]] for s in specs.values()]
    cv = cross_validate(x, excess, tokens, groups, SPECS + (LM_SPECS if "lm" in x else []), folds=5, seed=seed)
    chosen = forced or min(cv, key=cv.get)
    predictor = fit_spec(chosen, x, excess, ids)
    oof = out_of_fold(chosen, x, excess, 5, seed)
    emb = x["encoder"]
    selection = {"cv_excess_nll_per_token": {k: round(v, 5) for k, v in cv.items()}, "chosen": chosen,
                 "train_labels_reference": {k: round(v, 5) for k, v in
                                            _reference(excess, tokens, emb, centroids,
                                                       {"groups": groups, "clusters": clusters}).items()}}
    return {**predictor.to_dict(), "target": "excess NLL per token over dense (nats)", "selection": selection,
            "_oof": oof}


def max_loss_for(oof: torch.Tensor, ids: list[str], specs: dict[str, dict], saved: dict[str, float],
                 target: float) -> float | None:
    """Smallest max_loss whose routing (sparsest budget first, as ``Router``) saves ``target`` compute on
    average over the calibration documents, from out-of-fold predictions; None if no max_loss does."""
    budgets = sorted(specs, key=float, reverse=True)
    cols = {b: [ids.index(m) for m in specs[b]["candidates"]] for b in budgets}

    def mean_saved(x: float) -> float:
        total = 0.0
        for row in oof:
            pick = "dense"
            for b in budgets:
                ok = [j for j in cols[b] if row[j] <= x]
                if ok:
                    pick = ids[min(ok, key=lambda j: row[j])]
                    break
            total += saved[pick]
        return total / len(oof)

    grid = sorted(set(oof.flatten().tolist()))
    if mean_saved(grid[-1]) < target:
        return None
    lo, hi = 0, len(grid) - 1  # mean_saved rises with max_loss: bisect for the first grid value reaching target
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if mean_saved(grid[mid]) < target else (lo, mid)
    return round(grid[lo], 6)


def learned_fallback(oof: torch.Tensor, excess: torch.Tensor, tokens: torch.Tensor, far: torch.Tensor,
                     ids: list[str], specs: dict[str, dict]) -> dict:
    """Whether the learned router should fall back too: on the calibration documents beyond the OOD
    distance, the excess loss of its out-of-fold choice against the global mask's, per budget."""
    out = {}
    for b, spec in specs.items():
        cols = torch.tensor([ids.index(m) for m in spec["candidates"]])
        pick = cols[oof[:, cols].argmin(1)]
        w = tokens[far]
        learned = float((excess.gather(1, pick[:, None]).squeeze(1)[far] * w).sum() / w.sum()) if far.any() else 0.0
        fallback = float((excess[far, ids.index(spec["global"])] * w).sum() / w.sum()) if far.any() else 0.0
        out[b] = {"documents": int(far.sum()), "learned": round(learned, 5), "global": round(fallback, 5)}
    return {"learned": bool(far.any()) and sum(v["global"] for v in out.values()) < sum(v["learned"] for v in out.values()),
            "learned_check": out}


def ood_threshold(centroids: torch.Tensor, emb: torch.Tensor, quantile: float) -> float:
    """Cosine distance to the nearest centroid that ``quantile`` of the calibration documents stay within."""
    dist = 1.0 - (emb @ centroids.T).max(1).values
    return round(float(dist.double().quantile(quantile)), 5)


def _embed_cached(texts: list[str], cache) -> torch.Tensor:
    import hashlib
    import json

    from router.encoder import embed, load_encoder

    path = None
    if cache is not None:
        path = cache / f"embed-{hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:12]}.pt"
        if path.exists():
            return torch.load(path)
    encoder = load_encoder()
    out = torch.cat([embed(texts[i : i + 128], encoder=encoder) for i in range(0, len(texts), 128)])
    if path is not None:
        cache.mkdir(parents=True, exist_ok=True)
        torch.save(out, path)
    return out


def build_routed_bank(source: MaskBank, pool: dict[str, dict], docs: list[dict], labels: dict, budgets: list[float],
                      saved: dict[str, float], args, lm_features: torch.Tensor | None = None,
                      lm_spec: dict | None = None) -> MaskBank:
    """A format-2 bank over ``pool`` with a learned router fit on ``labels`` of ``docs`` (see masks.learn_router);
    ``lm_features`` ([n, H], with their ``lm_spec``, router.lm_features): the LM's input for the router, a
    format-3 bank where the predictor chosen reads it."""
    from masks.build import load_documents

    default = args.default_budget if args.default_budget is not None else source.sparsity
    if default not in budgets:
        raise SystemExit(f"default budget {default} is not among {budgets}")
    specs = budget_specs(pool, budgets, source.mask_ids)
    ids = list(pool)
    excess, tokens = excess_per_token(labels, ids)
    centroids = source.centroid_tensor()
    emb = _embed_cached([d["text"] for d in docs], args.cache)
    x = {"encoder": emb} if lm_features is None else {"encoder": emb, "lm": lm_features}
    router = select_router(x, excess.float(), tokens.float(), ids, specs, centroids, args.seed, args.predictor)
    oof = router.pop("_oof")
    if lm_spec is not None and "lm" in Predictor.from_dict(router).needs():
        router["lm_features"] = lm_spec
    threshold = ood_threshold(centroids, _embed_cached([d["text"] for d in load_documents(args.data)], args.cache),
                              args.ood_quantile)
    far = (1.0 - (emb @ centroids.T).max(1).values) > threshold
    ood = {"distance": threshold, "quantile": args.ood_quantile,
           **learned_fallback(oof, excess.float(), tokens.float(), far, ids, specs)}
    router["max_loss_for_budget"] = {b: max_loss_for(oof, ids, specs, saved, saved[mask_name("greedy", float(b))])
                                     for b in specs}
    d = specs[f"{default:g}"]
    static = [k for k in d["candidates"] if pool[k]["kind"] == "static"]
    training = {**source.training, "source_bank": str(args.bank), "router_seed": args.seed}
    return MaskBank(
        model=source.model, encoder=source.encoder, sparsity=default, blocks=source.blocks,
        centroids=source.centroids, masks=[pool[k]["mask"].tolist() for k in d["cluster_masks"]],
        mask_ids=d["cluster_masks"], clusters=source.clusters, baselines={k: pool[k]["mask"].tolist() for k in static},
        training=training, calibration_docs=source.calibration_docs,
        pool={k: {**{f: v for f, v in p.items() if f != "mask"}, "mask": p["mask"].tolist()} for k, p in pool.items()},
        budgets=specs, router=router,
        ood=ood, format_version=LM_FEATURES_VERSION if "lm_features" in router else FORMAT_VERSION,
    )
