"""Shared fixtures: the real default model directory and a tiny random-init Llama beside it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read at import: else LiteLLM fetches a price list
torch.set_num_threads(2)

TINY_LAYERS = 4


@pytest.fixture(scope="session")
def real_model_dir():
    from server import models

    return models.prepare(models.DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, real_model_dir):
    """A 4-layer random Llama with GQA and the real tokenizer (so chat templates work)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(real_model_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    from server import models

    return models.load(str(tiny_model_dir))


@pytest.fixture(scope="session")
def real(real_model_dir):
    from server import models

    return models.load(models.DEFAULT_MODEL)


# ---------------------------------------------------------------------------- serving
# Three clearly different domains; the tiny bank's centroids are their embeddings.
TINY_BANK_TEXTS = {
    "code": "def quicksort(xs):\n    if len(xs) < 2:\n        return xs\n    pivot = xs[0]\n"
            "    return quicksort([x for x in xs if x < pivot]) + [pivot]  # Python function",
    "math": "Solve for x: 3x + 5 = 20. Then compute the derivative of f(x) = x^3 - 2x and the integral of x^2.",
    "chat": "Hi there! How was your weekend? I went hiking with friends and we had a lovely picnic by the lake.",
}
# 2 of the tiny model's 8 blocks skipped per mask (25% block budget), a different pair per cluster.
TINY_BANK_SKIPS = {"code": (1, 4), "math": (2, 7), "chat": (0, 5), "global": (3, 6)}
TEST_API_KEY = "test-key"


@pytest.fixture(scope="session")
def tiny_bank(tiny):
    """A MaskBank for the tiny model: 3 clusters (code, math, chat) and a 'global' baseline."""
    from masks.bank import MaskBank
    from router.encoder import ENCODER_DIM, ENCODER_NAME, embed
    from server.runner import block_names

    names = block_names(TINY_LAYERS)

    def mask(skip):
        return [j not in skip for j in range(len(names))]

    ids = list(TINY_BANK_TEXTS)
    return MaskBank(
        model={"name": tiny.name, "fingerprint": tiny.fingerprint},
        encoder={"name": ENCODER_NAME, "dim": ENCODER_DIM},
        sparsity=0.25, blocks=names, centroids=embed(list(TINY_BANK_TEXTS.values())).tolist(),
        masks=[mask(TINY_BANK_SKIPS[i]) for i in ids], mask_ids=ids,
        clusters=[{"size": 1, "examples": [TINY_BANK_TEXTS[i]]} for i in ids],
        baselines={"global": mask(TINY_BANK_SKIPS["global"])},
    )


def routed_bank(tiny_bank, ood: float | None = None):
    """(bank, planted labels, candidate ids): the tiny bank as format 2, budgets 0.125 (1 block) and
    0.25 (2 blocks, the default), a ridge router fit on planted losses of the three centroid texts:
    on the math text the math mask is lowest, on the code and chat texts the global mask, so there
    the learned router and the nearest centroid choose differently."""
    from masks.bank import MaskBank
    from router.encoder import embed
    from router.predictor import fit

    n_blocks = len(tiny_bank.blocks)
    pool = {}
    for s, n_skip in ((0.125, 1), (0.25, 2)):
        for name, skips in TINY_BANK_SKIPS.items():
            mask = [j not in skips[:n_skip] for j in range(n_blocks)]
            pool[f"{name}@{s:g}"] = {"budget": s, "kind": "static" if name == "global" else "cluster", "mask": mask}
    ids = list(pool)
    emb = embed(list(TINY_BANK_TEXTS.values()))
    target = torch.full((3, len(ids)), 0.5)
    for i, text_id in enumerate(TINY_BANK_TEXTS):
        for j, m in enumerate(ids):
            name, s = m.split("@")
            target[i, j] = (0.1 if (name == text_id == "math") or (name == "global" and text_id != "math") else 0.5) \
                + (0.3 if s == "0.25" else 0.0)
    router = fit("ridge", emb, target, ids, 1e-6).to_dict()
    budgets = {f"{s:g}": {"cluster_masks": [f"{c}@{s:g}" for c in TINY_BANK_TEXTS],
                          "candidates": [m for m in ids if pool[m]["budget"] == s], "global": f"global@{s:g}"}
               for s in (0.125, 0.25)}
    d = budgets["0.25"]
    return MaskBank(model=tiny_bank.model, encoder=tiny_bank.encoder, sparsity=0.25, blocks=tiny_bank.blocks,
                    centroids=tiny_bank.centroids, masks=[pool[m]["mask"] for m in d["cluster_masks"]],
                    mask_ids=d["cluster_masks"], clusters=tiny_bank.clusters,
                    baselines={"global@0.25": pool["global@0.25"]["mask"]}, pool=pool, budgets=budgets,
                    router=router, ood={"distance": ood} if ood is not None else {}), target, ids


def lm_routed_bank(tiny_bank, tiny):
    """(bank, table): ``routed_bank`` as format 3, its predictor a ridge on the LM's token-table
    features of the three centroid texts (router.lm_features, window 16) fit to the same planted
    losses, and the tiny LM's token table."""
    from dataclasses import replace

    from masks.bank import LM_FEATURES_VERSION
    from router import lm_features
    from router.predictor import fit_spec

    bank, target, ids = routed_bank(tiny_bank)
    texts = list(TINY_BANK_TEXTS.values())
    table = lm_features.TokenTable(tiny.tokenizer, tiny.model.get_input_embeddings().weight)
    spec = lm_features.fit_spec(table, texts, 16)
    router = {**fit_spec("lm:ridge=1e-06", {"lm": lm_features.features(table, texts, spec)}, target, ids).to_dict(),
              "lm_features": spec}
    return replace(bank, router=router, format_version=LM_FEATURES_VERSION), table


@pytest.fixture(scope="session")
def tiny_bank_file(tiny_bank, tmp_path_factory):
    path = tmp_path_factory.mktemp("banks") / "tiny.json"
    tiny_bank.save(path)
    return path


@pytest.fixture(scope="session")
def routed_bank_file(tiny_bank, tmp_path_factory):
    path = tmp_path_factory.mktemp("banks") / "tiny-routed.json"
    routed_bank(tiny_bank)[0].save(path)
    return path


class LiveServer:
    """A real uvicorn server on 127.0.0.1 running in a thread of the test process."""

    def __init__(self, cfg, bank=None):
        import socket

        from server.api import DrainingServer, create_app

        self.cfg, self.bank, self.api_key = cfg, bank, cfg.api_key
        self.failures = []
        self.app = create_app(cfg, self.failures.append)
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.server = DrainingServer(self.app, cfg)
        self._thread = None

    def start(self, wait: bool = True) -> "LiveServer":
        import threading

        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        return self.wait_healthy() if wait else self

    def wait_healthy(self, timeout: float = 120.0) -> "LiveServer":
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert not self.failures, self.failures
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server at {self.base_url} not healthy after {timeout}s")

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=60)
        self._sock.close()

    def metrics(self) -> dict:
        """/metrics (no API key), parsed: {family name: prometheus_client Metric}."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base_url + "/metrics").text
        return {family.name: family for family in text_string_to_metric_families(text)}

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "none", max_retries=0, **kwargs)


@pytest.fixture(scope="session")
def serve_tiny(tiny_model_dir, tiny_bank, tiny_bank_file):
    """Factory: start a live tiny-model server with the tiny bank; every one is stopped at the end."""
    from server.api import ServeConfig

    servers = []

    def start(**overrides) -> LiveServer:
        fields = dict(model=str(tiny_model_dir), bank=str(tiny_bank_file), api_key=TEST_API_KEY, max_batch=4,
                      max_queue=8, max_tokens_limit=200, max_model_len=256, dtype="float32",
                      log_level="warning")  # as the references
        server = LiveServer(ServeConfig(**{**fields, **overrides}), tiny_bank).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def live_server(serve_tiny):
    """The shared tiny-model server (tiny bank, API key); has .base_url, .api_key, .bank."""
    return serve_tiny()


def metric_value(families: dict, sample_name: str, **labels) -> float:
    """Sum of the samples called ``sample_name`` whose labels include ``labels``."""
    family = families.get(sample_name.removesuffix("_total").removesuffix("_count").removesuffix("_sum"))
    if family is None:
        return 0.0
    return sum(s.value for s in family.samples if s.name == sample_name and labels.items() <= s.labels.items())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process(model_dir, bank, *args: str) -> tuple[subprocess.Popen, str]:
    """`igserve serve` in a subprocess on a free loopback port; returned once /health is 200."""
    proc, base = spawn_process(model_dir, bank, *args)
    wait_process(proc, base)
    return proc, base


def spawn_process(model_dir, bank, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir), "--bank", str(bank),
           "--port", str(port), "--max-model-len", "256", "--dtype", "float32", "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return proc, f"http://127.0.0.1:{port}"


def wait_process(proc: subprocess.Popen, base: str) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(base + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{base} not healthy after 120 s"
        time.sleep(0.2)


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
