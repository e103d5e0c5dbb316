"""Shared fixtures: the real default model directory and a tiny random-init Llama beside it."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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
