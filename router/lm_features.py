"""The LM's own view of a routing text: the learned router's second input (``lm`` in router.predictor).

The mean of the LM's input embeddings (its token table) over the text's first ``window`` tokens,
centred on the label documents' mean and L2-normalised. MiniLM embeds what a text is about; the
token table shows which of the LM's own tokens it is made of, which is what its blocks see
first. It costs one tokenisation and a table lookup per request, and no forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TokenTable:
    """An LM's tokenizer and input embedding table [V, H], for ``features``. The tokenizer is a private
    copy: truncating sets state on a fast tokenizer, and the server tokenises prompts on other threads."""

    def __init__(self, tokenizer, table: torch.Tensor):
        import copy

        self.tokenizer = copy.deepcopy(tokenizer)
        self.table = table.detach()

    @classmethod
    def of(cls, lm) -> "TokenTable":
        """From a loaded model (server.models.LoadedModel)."""
        return cls(lm.tokenizer, lm.model.get_input_embeddings().weight)

    def mean(self, texts: list[str], window: int) -> torch.Tensor:
        """[n, H] float32: each text's mean input embedding over its first ``window`` tokens (zeros
        for a text with none)."""
        from masks.train import tokenize

        out = torch.zeros(len(texts), self.table.shape[1])
        for i in range(0, len(texts), 64):
            ids, valid = tokenize(self.tokenizer, texts[i : i + 64], window)
            v = valid.float()[..., None]
            out[i : i + 64] = (self.table[ids].float() * v).sum(1) / v.sum(1).clamp(min=1)
        return out


def features(table: TokenTable, texts: list[str], spec: dict) -> torch.Tensor:
    """[n, H] the ``lm`` input for a router whose bank says ``spec`` ({"window", "centre"})."""
    centre = torch.tensor(spec["centre"], dtype=torch.float32)
    return F.normalize(table.mean(texts, int(spec["window"])) - centre, dim=1)


def fit_spec(table: TokenTable, texts: list[str], window: int) -> dict:
    """The bank's ``lm_features`` for label documents ``texts``: the window and their mean (the centre)."""
    centre = table.mean(texts, window).mean(0)
    return {"window": window, "centre": torch.round(centre.double(), decimals=6).tolist()}
