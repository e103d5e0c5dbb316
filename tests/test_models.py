"""Model registry: dtype resolution (``--dtype``)."""

from __future__ import annotations

import pytest
import torch

from server import models


def test_resolve_dtype_names_and_auto(monkeypatch):
    assert models.resolve_dtype("float32") is torch.float32
    assert models.resolve_dtype("bfloat16") is torch.bfloat16
    assert models.resolve_dtype("float16") is torch.float16
    monkeypatch.setattr(models, "_cpu_has_amx", lambda: True)
    assert models.resolve_dtype("auto", "cpu") is torch.bfloat16
    monkeypatch.setattr(models, "_cpu_has_amx", lambda: False)
    assert models.resolve_dtype("auto", "cpu") is torch.float32
    with pytest.raises(models.ModelLoadError, match="unknown dtype 'int3'"):
        models.resolve_dtype("int3")


def test_encoder_dtype_is_bfloat16_where_the_cpu_computes_in_it(monkeypatch):
    from server import weights

    monkeypatch.setattr(weights, "cpu_features", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert models.resolve_encoder_dtype("auto") is torch.bfloat16
    assert models.resolve_encoder_dtype("float32") is torch.float32
    monkeypatch.setattr(weights, "cpu_features", lambda: {"avx2", "fma"})
    assert models.resolve_encoder_dtype("auto") is torch.float32
    assert models.resolve_encoder_dtype("bfloat16") is torch.bfloat16


def test_load_casts_weights_and_keeps_the_fp32_fingerprint(tiny_model_dir, tiny):
    half = models.load(str(tiny_model_dir), dtype=torch.bfloat16)
    assert half.model.lm_head.weight.dtype == torch.bfloat16
    assert half.fingerprint == tiny.fingerprint  # banks stay valid whatever the serving dtype
