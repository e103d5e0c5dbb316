"""What a block mask saves: parameters and weight bytes touched per token.

Decoding one token reads every weight of every block it runs plus the final norm and lm_head, so
a mask's cost is the sum over kept blocks. ``compute_saved`` counts parameters (the same for every
weight format: the figure banks, responses and reports carry); ``ideal_speedup`` counts the bytes
of the weights as served (int4 groups and their scales, int8 channels, bf16, fp32), the bound on
what skipping can buy a decode step that is limited by reading weights. KV-cache reads, which grow
with the context, are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _linear_params(module: torch.nn.Module) -> int:
    """Parameters of a (possibly quantised) linear or norm, counted as the float model has them."""
    if hasattr(module, "in_features") and not isinstance(module, torch.nn.Linear):
        bias = getattr(module, "bias", None)
        return module.in_features * module.out_features + (0 if bias is None else bias.numel())
    return sum(p.numel() for p in module.parameters(recurse=False))


def _params(module: torch.nn.Module) -> int:
    return sum(_linear_params(m) for m in module.modules())


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's weights as served (parameters and buffers, each tensor once)."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers()) if t is not None}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass(frozen=True)
class CostModel:
    block_params: torch.Tensor  # [B] float64, blocks ordered attn_0, ffn_0, attn_1, ...
    block_bytes: torch.Tensor  # [B] float64, in the served format
    head_params: float  # final norm + lm_head
    head_bytes: float

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "CostModel":
        """From a loaded HF causal LM in any weight format (server/weights.py)."""
        parts = [p for layer in model.model.layers
                 for p in ((layer.input_layernorm, layer.self_attn), (layer.post_attention_layernorm, layer.mlp))]
        head = (model.model.norm, model.lm_head)
        return cls(
            block_params=torch.tensor([float(sum(_params(m) for m in p)) for p in parts], dtype=torch.float64),
            block_bytes=torch.tensor([float(sum(module_bytes(m) for m in p)) for p in parts], dtype=torch.float64),
            head_params=float(sum(_params(m) for m in head)),
            head_bytes=float(sum(module_bytes(m) for m in head)),
        )

    def params(self, mask: torch.Tensor) -> float:
        """Parameters touched per token under a bool mask [B] (lm_head included)."""
        return float(self.block_params[mask.cpu().bool()].sum()) + self.head_params

    def bytes(self, mask: torch.Tensor) -> float:
        """Weight bytes read per token under a bool mask [B] in the served format (lm_head included)."""
        return float(self.block_bytes[mask.cpu().bool()].sum()) + self.head_bytes

    def compute_saved(self, mask: torch.Tensor) -> float:
        """Fraction of the dense model's per-token parameters that the mask skips."""
        return 1.0 - self.params(mask) / self.params(self._dense())

    def ideal_speedup(self, mask: torch.Tensor) -> float:
        """Dense over masked weight bytes per token: the decode speedup if reading weights were all."""
        return self.bytes(self._dense()) / self.bytes(mask)

    def _dense(self) -> torch.Tensor:
        return torch.ones(self.block_params.numel(), dtype=torch.bool)
