"""`igserve masks build`: cluster a calibration corpus and learn one block mask per cluster, plus baselines.

Steps: embed every training document (routing encoder) -> seeded k-means into N clusters -> per
cluster, dense-teacher targets on a seeded sample of its documents -> one mask per cluster ->
static baselines at the same budget (global L0 mask, ShortGPT block influence, greedy removal) ->
the mask bank JSON.

The cluster-mask learner is ``--learner greedy`` (default: lazy greedy removal by KL to dense on
the cluster's calibration documents; the global greedy baseline runs the exact search) or ``l0``
(Hard Concrete gates, ``masks.train``): at CPU-feasible step counts the L0 masks were far worse
than greedy ones (held-out perplexity at sparsity 0.25: bench/results/eval_s0.25_l0.json vs
eval_s0.25.json).

Every expensive intermediate is cached under ``--work-dir`` by a hash of its inputs, so an
interrupted build resumes. Builds at several sparsities can run at the same time on one work dir:
the embeddings, each cluster's teacher targets and each greedy removal order are computed once
(by whichever build takes its lock file first), and as removal orders are nested a smaller budget
reads a prefix of a larger one's.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import os
import time
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from masks.bank import MaskBank
from masks.baselines import block_influence, greedy_removal, mask_without
from masks.cluster import kmeans, summarise
from masks.corpus import build_corpus, load_texts
from masks.hard_concrete import binarise, budget
from masks.train import Targets, TrainConfig, mask_kl, sample_positions, teacher_targets, tokenize, train_mask

DEFAULT_DATA = Path("data/corpus/train")
DEFAULT_WORK = Path("data/masks-work")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from server.models import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL, help="packaged model name or HF directory")
    parser.add_argument("--clusters", type=int, default=8, help="number of clusters = masks in the bank")
    parser.add_argument("--sparsity", type=float, default=0.25, help="fraction of blocks every mask skips")
    parser.add_argument("--out", type=Path, required=True, help="mask bank JSON to write")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA,
                        help="folder of <domain>.jsonl|.txt training documents (default: the corpus train split, "
                             "built with `python -m masks.corpus` if missing)")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK, help="cache of resumable intermediates")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--docs-per-cluster", type=int, default=128,
                        help="documents per cluster that the LM trains on (seeded sample)")
    parser.add_argument("--learner", choices=("greedy", "l0"), default="greedy", help="how cluster masks are learnt")
    parser.add_argument("--calib-docs", type=int, default=8,
                        help="documents for ShortGPT influence and each greedy removal (global: sampled across "
                             "clusters; per cluster: from that cluster)")
    parser.add_argument("--examples", type=int, default=3, help="example texts stored per cluster")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (1 is faster on a busy machine)")
    for f in dataclasses.fields(TrainConfig):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                            help=f"mask learning (teacher targets, L0, greedy): {f.name} (default {f.default})")


def load_documents(data: Path) -> list[dict]:
    """Every document of every <domain>.jsonl|.txt file in ``data``, with ``id`` and ``text``."""
    files = sorted(p for p in data.iterdir() if p.suffix in (".jsonl", ".txt"))
    if not files:
        raise SystemExit(f"{data}: no <domain>.jsonl or <domain>.txt files")
    return [doc for p in files for doc in load_texts(p)]


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _embeddings(texts: list[str], work: Path, key: str) -> torch.Tensor:
    from router.encoder import embed, load_encoder

    path = work / f"embed-{key}.pt"
    if path.exists():
        return torch.load(path)
    encoder = load_encoder()
    chunks = [embed(texts[i : i + 128], encoder=encoder)
              for i in tqdm(range(0, len(texts), 128), desc="embedding", unit="chunk", leave=False)]
    out = torch.cat(chunks)
    torch.save(out, path)
    return out


def _targets(runner, tokenizer, texts: list[str], cfg: TrainConfig, seed: int, path: Path, desc: str) -> Targets:
    if path.exists():
        return Targets.load(path)
    ids, valid = tokenize(tokenizer, texts, cfg.seq_len)
    positions, weights = sample_positions(valid.sum(1), cfg.kl_positions, torch.Generator().manual_seed(seed))
    targets = teacher_targets(runner, ids, valid, positions, weights, cfg.top_k, cfg.batch_size, desc)
    targets.save(path)
    return targets


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _try_lock(lock: Path) -> bool:
    """Create ``lock`` holding our PID; False while another live build holds it (a dead one's is taken over)."""
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            holder = lock.read_text().strip()
        except OSError:
            return False
        if not holder or _alive(int(holder)):  # empty: its owner is writing the PID right now
            return False
        lock.unlink(missing_ok=True)
        return _try_lock(lock)
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def run_once(jobs: dict[str, tuple[Path, Callable[[], object]]], desc: str) -> dict:
    """Run every job {name: (lock file, fn)} and return {name: fn()}, cooperating with concurrent builds:
    a job locked by another build is put off until the lock goes, then run (resuming from its checkpoint)."""
    results, pending = {}, dict(jobs)
    with tqdm(total=len(jobs), desc=desc, unit="job") as bar:
        while pending:
            for name, (lock, fn) in list(pending.items()):
                if not _try_lock(lock):
                    continue
                try:
                    results[name] = fn()
                finally:
                    lock.unlink(missing_ok=True)
                del pending[name]
                bar.update(1)
            if pending:
                time.sleep(2)
    return results


def build_bank(lm, docs: list[dict], clusters: int, sparsity: float, cfg: TrainConfig, work: Path, seed: int = 0,
               docs_per_cluster: int = 128, calib_docs: int = 8, examples: int = 3, learner: str = "greedy") -> MaskBank:
    """Cluster ``docs``, train one mask per cluster and the static baselines; return the bank."""
    from router.encoder import ENCODER_DIM, ENCODER_NAME
    from server.runner import BlockRunner

    keep = budget(2 * lm.model.config.num_hidden_layers, sparsity)
    work = work / f"{lm.name}-{lm.fingerprint.split(':')[-1][:8]}"
    work.mkdir(parents=True, exist_ok=True)
    runner = BlockRunner(lm.model, max_slots=1, max_len=cfg.seq_len)  # fp32: teacher and every reported KL
    student = runner if cfg.dtype == "float32" else \
        BlockRunner(copy.deepcopy(lm.model).to(getattr(torch, cfg.dtype)), max_slots=1, max_len=cfg.seq_len)
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = round(now - clock, 1)
        clock = now

    texts = [d["text"] for d in docs]
    emb_key = _key(ENCODER_NAME, [d["id"] for d in docs], texts)
    emb = run_once({"embed": (work / f"embed-{emb_key}.lock", lambda: _embeddings(texts, work, emb_key))},
                   "embeddings")["embed"]
    lap("embedding")
    centroids, labels = kmeans(emb, clusters, seed)
    stats = summarise(labels, texts, clusters, examples)
    lap("clustering")

    gen = torch.Generator().manual_seed(seed)
    data_key = _key(lm.fingerprint, cfg.seq_len, cfg.kl_positions, cfg.top_k, seed)
    chosen, jobs = {}, {}
    for c in range(clusters):
        members = (labels == c).nonzero().squeeze(1)
        pick = members[torch.randperm(len(members), generator=gen)[:docs_per_cluster]].sort().values.tolist()
        key = _key(data_key, c, [docs[i]["id"] for i in pick])
        chosen[c] = (key, pick)
        jobs[c] = (work / f"teacher-{key}.lock",
                   partial(_targets, runner, lm.tokenizer, [texts[i] for i in pick], cfg, seed + c,
                           work / f"teacher-{key}.pt", f"teacher c{c}"))
    teachers = run_once(jobs, "teacher targets")
    per_cluster: list[tuple[Targets, str, list[str]]] = [
        (teachers[c], key, [docs[i]["id"] for i in pick]) for c, (key, pick) in chosen.items()]
    lap("teacher")

    # The whole corpus for the static baselines: every cluster's documents, weighted by cluster size.
    pooled = Targets.cat([t for t, _, _ in per_cluster])
    doc_weights = torch.cat([torch.full((len(t),), stats[c]["size"] / len(t)) for c, (t, _, _) in enumerate(per_cluster)])
    pooled_key = _key([k for _, k, _ in per_cluster])
    calib_idx = torch.multinomial(doc_weights, min(calib_docs, len(pooled)), replacement=False,
                                  generator=torch.Generator().manual_seed(seed)).sort().values
    calib = pooled.take(calib_idx)
    influence = block_influence(runner, calib, cfg.batch_size)
    lap("shortgpt")

    # Greedy removal orders, each computed once: the global baseline by exact greedy, the cluster
    # masks of the greedy learner by lazy greedy (fewer evaluations; never favours the clusters).
    n_remove = runner.num_blocks - keep
    greedy_sets = {"global": (calib, _key(pooled_key, calib_idx.tolist(), cfg.dtype), False)}
    if learner == "greedy":
        for c, (targets, key, _) in enumerate(per_cluster):
            idx = torch.randperm(len(targets), generator=torch.Generator().manual_seed(seed + c))[:calib_docs].sort().values
            greedy_sets[f"c{c}"] = (targets.take(idx), _key(key, idx.tolist(), cfg.dtype, "lazy"), True)

    jobs = {name: (work / f"greedy-{key}.lock",
                   partial(greedy_removal, student, data, n_remove, len(data), work / f"greedy-{key}.json", lazy))
            for name, (data, key, lazy) in greedy_sets.items()}
    removals = run_once(jobs, "greedy removal orders")
    lap("greedy")

    masks, cluster_info = [], []
    for c, (targets, key, ids) in enumerate(tqdm(per_cluster, desc=f"cluster masks s={sparsity}", unit="mask")):
        if learner == "greedy":
            mask = mask_without(runner.num_blocks, [s["block"] for s in removals[f"c{c}"]])
            learnt = {"greedy_removal": [runner.block_names[s["block"]] for s in removals[f"c{c}"]]}
        else:
            out = train_mask(student, targets, sparsity, cfg, seed * 1000 + c,
                             checkpoint=work / f"gates-{_key(key, sparsity, cfg.to_dict(), seed, c)}.pt",
                             desc=f"L0 c{c}")
            mask = out["mask"]
            learnt = {"gate_logits": [round(v, 4) for v in out["log_alpha"].tolist()], "final_kl": out["history"][-1]["kl"]}
        masks.append(mask)
        first = targets.take(torch.arange(min(32, len(targets))))
        cluster_info.append({"id": f"c{c}", **stats[c], "train_docs": len(ids),
                             "calibration_kl": round(mask_kl(runner, first, mask, cfg.batch_size), 5),  # 32 docs
                             "skipped": [runner.block_names[j] for j in (~mask).nonzero().squeeze(1).tolist()],
                             **learnt})
    lap("cluster_masks")

    static = train_mask(student, pooled, sparsity, cfg, seed * 1000 + clusters, doc_weights,
                        work / f"gates-global-{_key(pooled_key, sparsity, cfg.to_dict(), seed)}.pt", "L0 global")
    lap("static_l0")
    baselines = {"static_l0": static["mask"], "shortgpt": binarise(influence, sparsity),
                 "greedy": mask_without(runner.num_blocks, [s["block"] for s in removals["global"]])}
    calib_kl = {name: round(mask_kl(runner, calib, m, cfg.batch_size), 5)
                for name, m in [*zip([c["id"] for c in cluster_info], masks), *baselines.items()]}
    lap("calibration_kl")

    training = {
        "learner": learner,
        "method": {"greedy": "per cluster: lazy greedy block removal by KL(dense || masked) on the cluster's "
                             "calibration documents (top-k teacher targets); the global greedy baseline: exact greedy",
                   "l0": "per cluster: L0 Hard Concrete gates, KL(dense || gated) on top-k teacher targets, "
                         "Lagrangian sparsity with linear warm-up, binarised to the exact block budget"}[learner],
        "config": cfg.to_dict(), "seed": seed, "clusters": clusters, "docs_per_cluster": docs_per_cluster,
        "calib_docs": calib_docs, "keep_blocks": keep,
        "static_l0": {"gate_logits": [round(v, 4) for v in static["log_alpha"].tolist()]},
        "shortgpt": {"block_influence": [round(v, 5) for v in influence.tolist()]},
        "greedy": {"removal": [{"block": runner.block_names[s["block"]], "kl": round(s["kl"], 5)}
                               for s in removals["global"]]},
        "calibration_set_kl": calib_kl,
        "timings_s": timings,
    }
    return MaskBank(
        model={"name": lm.name, "fingerprint": lm.fingerprint},
        encoder={"name": ENCODER_NAME, "dim": ENCODER_DIM},
        sparsity=sparsity,
        blocks=list(runner.block_names),
        centroids=[[round(v, 6) for v in row] for row in centroids.tolist()],
        masks=[m.tolist() for m in masks],
        mask_ids=[c["id"] for c in cluster_info],
        clusters=cluster_info,
        baselines={k: v.tolist() for k, v in baselines.items()},
        training=training,
        calibration_docs=[d["id"] for d in docs],
    )


def run(args: argparse.Namespace) -> int:
    from server import models

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if not args.data.is_dir():
        if args.data != DEFAULT_DATA:
            raise SystemExit(f"{args.data}: no such folder")
        build_corpus(DEFAULT_DATA.parent, seed=0)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    lm = models.load(args.model)
    docs = load_documents(args.data)
    bank = build_bank(lm, docs, args.clusters, args.sparsity, cfg, args.work_dir, args.seed,
                      args.docs_per_cluster, args.calib_docs, args.examples, args.learner)
    bank.training["data"] = str(args.data)
    bank.training["build_seconds"] = round(time.perf_counter() - start, 1)
    bank.save(args.out)
    print(f"wrote {args.out}: {len(bank.masks)} masks + {len(bank.baselines)} baselines, sparsity {bank.sparsity}, "
          f"{len(docs)} documents, {bank.training['build_seconds']:.0f} s")
    for info in bank.clusters:
        print(f"  {info['id']}: {info['size']:4d} docs, calibration KL {info['calibration_kl']:.4f}, "
              f"skips {', '.join(info['skipped'])}")
    for name, kl in bank.training["calibration_set_kl"].items():
        print(f"  calibration-set KL {name:10s} {kl:.4f}")
    return 0
