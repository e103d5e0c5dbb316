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
    parser.add_argument("--extend", type=Path,
                        help="bank built from the same data and settings at a smaller sparsity: its removal orders "
                             "start the greedy searches, so only the extra blocks are searched")
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
               docs_per_cluster: int = 128, calib_docs: int = 8, examples: int = 3, learner: str = "greedy",
               extend: MaskBank | None = None) -> MaskBank:
    """Cluster ``docs``, train one mask per cluster and the static baselines; return the bank.
    ``extend``: a bank of the same clusters whose greedy removal orders seed the searches."""
    from router.encoder import ENCODER_DIM, ENCODER_NAME

    b = _Build.start(lm, cfg, work, seed)
    texts = [d["text"] for d in docs]
    emb = _embed_once(texts, [d["id"] for d in docs], b.work)
    b.lap("embedding")
    centroids, labels = kmeans(emb, clusters, seed)
    stats = summarise(labels, texts, clusters, examples)
    b.lap("clustering")
    start_orders = _orders_to_extend(extend, centroids, b.runner.block_names, learner) if extend else {}
    per_cluster = _cluster_targets(b, docs, labels, clusters, docs_per_cluster)
    b.lap("teacher")
    pool = _pool(per_cluster, stats, calib_docs, seed)
    influence = block_influence(b.runner, pool.calib, cfg.batch_size)
    b.lap("shortgpt")
    keep = budget(b.runner.num_blocks, sparsity)
    removals = _removal_orders(b, per_cluster, pool, b.runner.num_blocks - keep, learner, calib_docs, start_orders)
    b.lap("greedy")
    masks, cluster_info = _cluster_masks(b, per_cluster, removals, stats, learner, sparsity)
    b.lap("cluster_masks")
    static = train_mask(b.student, pool.targets, sparsity, cfg, seed * 1000 + clusters, pool.weights,
                        b.work / f"gates-global-{_key(pool.key, sparsity, cfg.to_dict(), seed)}.pt", "L0 global")
    b.lap("static_l0")
    baselines = {"static_l0": static["mask"], "shortgpt": binarise(influence, sparsity),
                 "greedy": mask_without(b.runner.num_blocks, [s["block"] for s in removals["global"]])}
    calib_kl = {name: round(mask_kl(b.runner, pool.calib, m, cfg.batch_size), 5)
                for name, m in [*zip([c["id"] for c in cluster_info], masks), *baselines.items()]}
    b.lap("calibration_kl")
    training = {
        "learner": learner, "method": LEARNER_METHODS[learner],
        "config": cfg.to_dict(), "seed": seed, "clusters": clusters, "docs_per_cluster": docs_per_cluster,
        "calib_docs": calib_docs, "keep_blocks": keep,
        "static_l0": {"gate_logits": [round(v, 4) for v in static["log_alpha"].tolist()]},
        "shortgpt": {"block_influence": [round(v, 5) for v in influence.tolist()]},
        "greedy": {"removal": [{"block": b.runner.block_names[s["block"]], "kl": round(s["kl"], 5)}
                               for s in removals["global"]]},
        "calibration_set_kl": calib_kl,
        "timings_s": b.timings,
    }
    return MaskBank(
        model={"name": lm.name, "fingerprint": lm.fingerprint},
        encoder={"name": ENCODER_NAME, "dim": ENCODER_DIM},
        sparsity=sparsity,
        blocks=list(b.runner.block_names),
        centroids=[[round(v, 6) for v in row] for row in centroids.tolist()],
        masks=[m.tolist() for m in masks],
        mask_ids=[c["id"] for c in cluster_info],
        clusters=cluster_info,
        baselines={k: v.tolist() for k, v in baselines.items()},
        training=training,
        calibration_docs=[d["id"] for d in docs],
    )


LEARNER_METHODS = {
    "greedy": "per cluster: lazy greedy block removal by KL(dense || masked) on the cluster's "
              "calibration documents (top-k teacher targets); the global greedy baseline: exact greedy",
    "l0": "per cluster: L0 Hard Concrete gates, KL(dense || gated) on top-k teacher targets, "
          "Lagrangian sparsity with linear warm-up, binarised to the exact block budget",
}


@dataclasses.dataclass
class _Build:
    """What every step of one build reads: the model, the settings, the work dir of this model's
    weights, the fp32 runner (teacher and every reported KL) and the student (``cfg.dtype``), and
    the seconds each step took."""

    lm: object
    cfg: TrainConfig
    work: Path
    seed: int
    runner: object
    student: object
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    clock: float = dataclasses.field(default_factory=time.perf_counter)

    @classmethod
    def start(cls, lm, cfg: TrainConfig, work: Path, seed: int) -> "_Build":
        from server.runner import BlockRunner

        work = work / f"{lm.name}-{lm.fingerprint.split(':')[-1][:8]}"
        work.mkdir(parents=True, exist_ok=True)
        runner = BlockRunner(lm.model, max_batch=1, max_len=cfg.seq_len)
        student = runner if cfg.dtype == "float32" else \
            BlockRunner(copy.deepcopy(lm.model).to(getattr(torch, cfg.dtype)), max_batch=1, max_len=cfg.seq_len)
        return cls(lm, cfg, work, seed, runner, student)

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = round(now - self.clock, 1)
        self.clock = now


def _embed_once(texts: list[str], ids: list[str], work: Path) -> torch.Tensor:
    """The documents' routing embeddings, computed by one of the builds sharing ``work``."""
    from router.encoder import ENCODER_NAME

    key = _key(ENCODER_NAME, ids, texts)
    return run_once({"embed": (work / f"embed-{key}.lock", lambda: _embeddings(texts, work, key))},
                    "embeddings")["embed"]


def _cluster_targets(b: _Build, docs: list[dict], labels: torch.Tensor, clusters: int,
                     docs_per_cluster: int) -> list[tuple[Targets, str, list[str]]]:
    """Per cluster: the dense teacher's targets on a seeded sample of its documents, their cache
    key and the sampled document ids."""
    gen = torch.Generator().manual_seed(b.seed)
    data_key = _key(b.lm.fingerprint, b.cfg.seq_len, b.cfg.kl_positions, b.cfg.top_k, b.seed)
    chosen, jobs = {}, {}
    for c in range(clusters):
        members = (labels == c).nonzero().squeeze(1)
        pick = members[torch.randperm(len(members), generator=gen)[:docs_per_cluster]].sort().values.tolist()
        key = _key(data_key, c, [docs[i]["id"] for i in pick])
        chosen[c] = (key, pick)
        jobs[c] = (b.work / f"teacher-{key}.lock",
                   partial(_targets, b.runner, b.lm.tokenizer, [docs[i]["text"] for i in pick], b.cfg, b.seed + c,
                           b.work / f"teacher-{key}.pt", f"teacher c{c}"))
    teachers = run_once(jobs, "teacher targets")
    return [(teachers[c], key, [docs[i]["id"] for i in pick]) for c, (key, pick) in chosen.items()]


@dataclasses.dataclass
class _Pool:
    """The whole corpus for the static baselines: every cluster's documents, weighted by cluster
    size, and the seeded calibration sample of it (ShortGPT, the global greedy order, reported KL)."""

    targets: Targets
    weights: torch.Tensor
    key: str
    calib_idx: torch.Tensor
    calib: Targets


def _pool(per_cluster: list[tuple[Targets, str, list[str]]], stats: list[dict], calib_docs: int, seed: int) -> _Pool:
    pooled = Targets.cat([t for t, _, _ in per_cluster])
    weights = torch.cat([torch.full((len(t),), stats[c]["size"] / len(t)) for c, (t, _, _) in enumerate(per_cluster)])
    calib_idx = torch.multinomial(weights, min(calib_docs, len(pooled)), replacement=False,
                                  generator=torch.Generator().manual_seed(seed)).sort().values
    return _Pool(pooled, weights, _key([k for _, k, _ in per_cluster]), calib_idx, pooled.take(calib_idx))


def _orders_to_extend(bank: MaskBank, centroids: torch.Tensor, block_names, learner: str) -> dict[str, list[dict]]:
    """The removal orders a smaller-budget bank stores, as greedy steps, once it is known to hold these clusters."""
    from masks.pool import removal_orders

    if learner != "greedy" or list(bank.blocks) != list(block_names) or len(bank.centroids) != len(centroids) or \
            not torch.allclose(torch.tensor(bank.centroids), centroids.float(), atol=1e-4):
        raise SystemExit("--extend: that bank was not built from these clusters (data, seed, --clusters) "
                         "with the greedy learner")
    kl = {s["block"]: s["kl"] for s in bank.training["greedy"]["removal"]}
    orders = removal_orders(bank)
    return {("global" if name == "greedy" else name): [{"block": j, "kl": kl.get(bank.blocks[j]) if name == "greedy"
                                                        else None} for j in order]
            for name, order in orders.items()}


def _removal_orders(b: _Build, per_cluster: list[tuple[Targets, str, list[str]]], pool: _Pool, n_remove: int,
                    learner: str, calib_docs: int, start: dict[str, list[dict]] | None = None) -> dict[str, list[dict]]:
    """Greedy removal orders, each computed once: the global baseline by exact greedy, the cluster
    masks of the greedy learner by lazy greedy (fewer evaluations; never favours the clusters).
    ``start``: steps already known per order, written as its checkpoint where it has none."""
    greedy_sets = {"global": (pool.calib, _key(pool.key, pool.calib_idx.tolist(), b.cfg.dtype), False)}
    if learner == "greedy":
        for c, (targets, key, _) in enumerate(per_cluster):
            gen = torch.Generator().manual_seed(b.seed + c)
            idx = torch.randperm(len(targets), generator=gen)[:calib_docs].sort().values
            greedy_sets[f"c{c}"] = (targets.take(idx), _key(key, idx.tolist(), b.cfg.dtype, "lazy"), True)
    for name, (_, key, _) in greedy_sets.items():
        checkpoint = b.work / f"greedy-{key}.json"
        if start and name in start and not checkpoint.exists():
            checkpoint.write_text(json.dumps(start[name]))
    jobs = {name: (b.work / f"greedy-{key}.lock",
                   partial(greedy_removal, b.student, data, n_remove, len(data), b.work / f"greedy-{key}.json", lazy))
            for name, (data, key, lazy) in greedy_sets.items()}
    return run_once(jobs, "greedy removal orders")


def _cluster_masks(b: _Build, per_cluster: list[tuple[Targets, str, list[str]]], removals: dict[str, list[dict]],
                   stats: list[dict], learner: str, sparsity: float) -> tuple[list[torch.Tensor], list[dict]]:
    """Each cluster's mask (its greedy removal order, or L0 gates) and its bank entry."""
    runner, cfg = b.runner, b.cfg
    masks, cluster_info = [], []
    for c, (targets, key, ids) in enumerate(tqdm(per_cluster, desc=f"cluster masks s={sparsity}", unit="mask")):
        if learner == "greedy":
            mask = mask_without(runner.num_blocks, [s["block"] for s in removals[f"c{c}"]])
            learnt = {"greedy_removal": [runner.block_names[s["block"]] for s in removals[f"c{c}"]]}
        else:
            out = train_mask(b.student, targets, sparsity, cfg, b.seed * 1000 + c,
                             checkpoint=b.work / f"gates-{_key(key, sparsity, cfg.to_dict(), b.seed, c)}.pt",
                             desc=f"L0 c{c}")
            mask = out["mask"]
            learnt = {"gate_logits": [round(v, 4) for v in out["log_alpha"].tolist()], "final_kl": out["history"][-1]["kl"]}
        masks.append(mask)
        first = targets.take(torch.arange(min(32, len(targets))))
        cluster_info.append({"id": f"c{c}", **stats[c], "train_docs": len(ids),
                             "calibration_kl": round(mask_kl(runner, first, mask, cfg.batch_size), 5),  # 32 docs
                             "skipped": [runner.block_names[j] for j in (~mask).nonzero().squeeze(1).tolist()],
                             **learnt})
    return masks, cluster_info


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
                      args.docs_per_cluster, args.calib_docs, args.examples, args.learner,
                      MaskBank.load(args.extend) if args.extend else None)
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
