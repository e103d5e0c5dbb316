"""Input-guided routing: embed a request's routing text, pick the mask of the nearest centroid (cosine).

``Router`` is synchronous and batched. The server's engine calls it from its own thread, once per
step for all the requests it is about to admit, so concurrent arrivals share one encoder batch
and the encoder never competes with a step for the CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from masks.bank import BankError, MaskBank
from router.encoder import ENCODER_DIM, EncoderError, check_name, embed, load_encoder


@dataclass(frozen=True)
class Route:
    mask_id: str
    distance: float  # cosine distance (1 - cos) to the chosen centroid
    router_ms: float  # time spent routing (for a batch: the whole batch)


def chat_routing_text(messages: list[dict]) -> str:
    """What a chat request is routed on: the last user turn, then the system prompt.

    The last user turn says what the model is about to answer, so it carries the domain; the
    system prompt adds standing context ("you are a SQL assistant"). Earlier turns and assistant
    replies are left out: they describe what was already answered and would blur the signal. The
    user turn comes first because the encoder keeps only the beginning of a long text.
    """
    users = [m["content"] for m in messages if m["role"] == "user"]
    systems = [m["content"] for m in messages if m["role"] in ("system", "developer")]
    return "\n\n".join(users[-1:] + systems)


class Router:
    """Nearest-centroid lookup over a mask bank's centroids."""

    def __init__(self, bank: MaskBank, encoder=None):
        try:
            check_name(bank.encoder["name"])
        except EncoderError as exc:
            raise BankError(f"mask bank needs encoder {bank.encoder['name']!r}: {exc}") from exc
        if bank.encoder["dim"] != ENCODER_DIM:
            raise BankError(f"mask bank centroids have {bank.encoder['dim']} dimensions, the encoder {ENCODER_DIM}")
        self.encoder = encoder or load_encoder()
        self.centroids = F.normalize(bank.centroid_tensor(), dim=1)
        self.mask_ids = list(bank.mask_ids)
        self.masks = {mask_id: bank.mask(mask_id) for mask_id in self.mask_ids}

    def warm_up(self) -> None:
        self.encoder.warm_up()

    def route(self, texts: list[str], batch_size: int = 32) -> list[Route]:
        start = time.perf_counter()
        with torch.inference_mode():
            sims = embed(texts, batch_size, self.encoder) @ self.centroids.T
        best, idx = sims.max(1)
        ms = (time.perf_counter() - start) * 1000
        return [Route(self.mask_ids[i], 1.0 - s, ms) for s, i in zip(best.tolist(), idx.tolist())]
