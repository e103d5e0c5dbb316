"""Token sampling (greedy, temperature, top-p, per-request seed) and stop-sequence handling."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Below this temperature sampling is greedy: logits / 1e-300 overflow to inf (as vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def generator(self, device) -> torch.Generator | None:
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed)
        return g


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of logits [B, V]."""
    greedy = logits.argmax(-1).tolist()
    out = []
    for i, p in enumerate(params):
        if p.temperature < GREEDY_TEMPERATURE:
            out.append(greedy[i])
            continue
        probs = torch.softmax(logits[i].float() / p.temperature, -1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            # in float64: a top_p such as 1e-300 is 0 in float32 and would drop every token
            drop = (sorted_p.cumsum(0) - sorted_p).double() >= p.top_p
            drop[0] = False
            sorted_p[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        out.append(int(torch.multinomial(probs, 1, generator=generators[i])))
    return out


def find_stop(text: str, stops: list[str], start: int) -> int:
    """Index in text of the earliest stop string that ends after ``start``, or -1."""
    hits = [text.find(s, max(0, start - len(s) + 1)) for s in stops]
    hits = [h for h in hits if h >= 0]
    return min(hits) if hits else -1


def holdback(stops: list[str]) -> int:
    """Characters to hold back while streaming: a stop string may still be completing."""
    return max((len(s) - 1 for s in stops), default=0)
