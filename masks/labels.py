"""Per-document loss of every candidate mask: the router's training labels and the held-out scores.

Scoring one document under one mask is the expensive unit (a full forward of the LM), so results
are cached on disk per mask (by its bits, the model fingerprint, the weight format, the activations'
dtype and the token window) and per document (by a hash of its text): adding candidates or documents later scores only
what is new, and the same cache serves ``igserve eval``. Labels need only NLL, so they are scored
one mask at a time and saved after each (resumable); with ``kl`` the masks are scored together
against one dense forward per batch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from tqdm import tqdm

from masks.train import tokenize


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def mask_key(mask: torch.Tensor) -> str:
    return "".join("1" if v else "0" for v in mask.tolist())


# the activations a format's scores were cached with while keys named the format alone (bf16 then
# ran in bfloat16 throughout; it now runs float32 activations where igserve's kernels do)
KEYED_ACTIVATIONS = {"bf16": "bfloat16"}


def keyed_activations(weights: str) -> str:
    return KEYED_ACTIVATIONS.get(weights, "float32")


class ScoreCache:
    """{mask: {doc hash: (tokens, nll, kl or None)}} on disk, one file per mask."""

    def __init__(self, root: Path | None, fingerprint: str, max_len: int, weights: str = "fp32",
                 activations: str | None = None):
        key = f"{fingerprint}-{max_len}" + ("" if weights == "fp32" else f"-{weights}")  # fp32: the original key
        if activations not in (None, keyed_activations(weights)):
            key += f"-{activations}"
        self.root, self.prefix = root, hashlib.sha256(key.encode()).hexdigest()[:10]
        self.rows: dict[str, dict] = {}

    def _file(self, mask: torch.Tensor) -> Path:
        return self.root / f"{self.prefix}-{int(mask_key(mask), 2):x}.pt"

    def get(self, mask: torch.Tensor) -> dict:
        key = mask_key(mask)
        if key not in self.rows:
            path = None if self.root is None else self._file(mask)
            self.rows[key] = torch.load(path) if path is not None and path.exists() else {}
        return self.rows[key]

    def put(self, mask: torch.Tensor, rows: dict) -> None:
        self.get(mask).update(rows)
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self._file(mask).with_suffix(".tmp")
            torch.save(self.get(mask), tmp)
            tmp.replace(self._file(mask))


def _missing(cache: ScoreCache, masks: dict[str, torch.Tensor], hashes: list[str], kl: bool) -> dict[str, list[int]]:
    distinct = {mask_key(t): (m, t) for m, t in masks.items()}  # equal masks are scored once
    out = {}
    for m, t in distinct.values():
        have = cache.get(t)
        idx = [i for i, h in enumerate(hashes) if h not in have or (kl and have[h][2] is None)]
        if idx:
            out[m] = idx
    return out


@torch.no_grad()
def _nll_only(runner, tokenizer, texts: list[str], mask: torch.Tensor, max_len: int, batch_size: int) -> list[tuple]:
    rows = []
    for i in range(0, len(texts), batch_size):
        ids, valid = tokenize(tokenizer, texts[i : i + batch_size], max_len)
        scored = (valid[:, 1:] & valid[:, :-1]).float()
        logp = runner.forward(ids, mask, valid)[:, :-1].float().log_softmax(-1)
        nll = (-logp.gather(-1, ids[:, 1:, None]).squeeze(-1) * scored).sum(1)
        rows += [(int(n), float(v), None) for n, v in zip(scored.sum(1).tolist(), nll.tolist())]
    return rows


def _with_kl(runner, tokenizer, texts: list[str], masks: dict[str, torch.Tensor], max_len: int,
             batch_size: int) -> dict[str, list[tuple]]:
    from masks.evaluate import score_batch

    out = {m: [] for m in masks}
    for i in tqdm(range(0, len(texts), batch_size), desc=f"scoring {len(masks)} masks", unit="batch", leave=False):
        ids, valid = tokenize(tokenizer, texts[i : i + batch_size], max_len)
        tokens = (valid[:, 1:] & valid[:, :-1]).sum(1).tolist()
        scores = score_batch(runner, ids, valid, masks)
        for m in masks:
            out[m] += [(n, float(a), float(b)) for n, a, b in zip(tokens, scores[m]["nll"], scores[m]["kl"])]
    return out


def score_documents(runner, tokenizer, fingerprint: str, texts: list[str], masks: dict[str, torch.Tensor],
                    max_len: int = 128, batch_size: int = 8, cache: Path | None = None, kl: bool = True,
                    weights: str = "fp32") -> dict:
    """{"tokens": [n], "nll": {id: [n]}, "kl": {id: [n]} (with ``kl``), "scored": pairs scored now}: summed
    NLL and KL(dense || masked) over each document's predicted tokens, with the linears in ``weights``.
    Only (mask, document) pairs missing from ``cache`` are scored."""
    store = ScoreCache(cache, fingerprint, max_len, weights, str(runner.dtype).removeprefix("torch."))
    hashes = [text_hash(t) for t in texts]
    todo = _missing(store, masks, hashes, kl)
    if kl and todo:
        idx = sorted({i for v in todo.values() for i in v})
        got = _with_kl(runner, tokenizer, [texts[i] for i in idx], {m: masks[m] for m in todo}, max_len, batch_size)
        for m, rows in got.items():
            store.put(masks[m], {hashes[i]: r for i, r in zip(idx, rows)})
    for m, idx in ([] if kl or not todo else tqdm(list(todo.items()), desc="labels (NLL per mask)", unit="mask")):
        rows = _nll_only(runner, tokenizer, [texts[i] for i in idx], masks[m], max_len, batch_size)
        store.put(masks[m], {hashes[i]: r for i, r in zip(idx, rows)})
    first = store.get(next(iter(masks.values())))
    out = {"tokens": [first[h][0] for h in hashes], "nll": {}, "kl": {}, "scored": sum(map(len, todo.values()))}
    for m, t in masks.items():
        have = store.get(t)
        out["nll"][m] = [have[h][1] for h in hashes]
        if kl:
            out["kl"][m] = [have[h][2] for h in hashes]
    return out


def seed_cache(cache: Path, fingerprint: str, max_len: int, texts: list[str], masks: dict[str, torch.Tensor],
               documents: list[dict], weights: str = "fp32", activations: str | None = None) -> int:
    """Store per-document scores of an earlier ``igserve eval`` report (its ``documents``, in the order of
    ``texts``) so that those masks are not scored again. Returns how many masks were stored."""
    store = ScoreCache(cache, fingerprint, max_len, weights, activations)
    stored = 0
    for m, t in masks.items():
        if m in documents[0]["nll"]:
            store.put(t, {text_hash(x): (d["tokens"], d["nll"][m], d["kl"][m]) for x, d in zip(texts, documents)})
            stored += 1
    return stored
