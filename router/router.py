"""Input-guided routing: embed a request's routing text, pick a mask of the bank.

Two methods: ``centroid`` (the paper: the mask of the nearest cluster centroid, cosine) and
``learned`` (a predictor of each candidate's excess loss, ``router.predictor``, over the text's
encoder embedding and, where the bank's predictor reads them, the LM's token-table features,
``router.lm_features``; the lowest prediction within the requested budget wins). A request may
ask for a budget the bank holds or for ``max_loss``: the sparsest candidate predicted to add at
most that much loss (dense if none).
A text farther from every centroid than the bank's ``ood`` distance gets the budget's global mask
(the mask fit on the whole corpus), and its ``Route`` says so.

``Router`` is synchronous and batched. The server's engine calls it from its own thread, once per
step for all the requests it is about to admit, so concurrent arrivals share one encoder batch
and the encoder never competes with a step for the CPU.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from masks.bank import DENSE, BankError, MaskBank
from router.encoder import ENCODER_DIM, EncoderError, check_name, embed, load_encoder
from router.lm_features import TokenTable, features as lm_features
from router.predictor import KINDS, Predictor

METHODS = ("learned", "centroid")


@dataclass(frozen=True)
class Route:
    mask_id: str
    distance: float | None  # cosine distance (1 - cos) to the nearest centroid; None: no router ran
    router_ms: float  # time spent routing (for a batch: the whole batch)
    budget: float = 0.0  # sparsity of the chosen mask (0 for dense)
    fallback: bool = False  # out of distribution: the budget's global mask was used
    predicted_loss: float | None = None  # learned router: predicted excess NLL per token (nats)

    @property
    def by_router(self) -> bool:
        """False for a mask bound without routing (adaptive depth's global mask)."""
        return self.distance is not None


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
    """Routes texts over a mask bank; see the module doc for the methods and options.

    ``masks`` maps every id a client may force to its bool tensor (the bank's, built once);
    ``budgets`` lists the budgets the bank holds and ``default_budget`` the one used when a request
    names none; ``check`` raises ``ValueError`` for options this bank cannot serve.
    """

    def __init__(self, bank: MaskBank, encoder=None, method: str | None = None, ood: bool = True,
                 default_budget: float | None = None, lm: TokenTable | None = None):
        """``lm``: the served LM's token table, for a learned router that reads it (``route`` needs it
        then; ``route_embedded`` takes the inputs already made)."""
        try:
            check_name(bank.encoder["name"])
        except EncoderError as exc:
            raise BankError(f"mask bank needs encoder {bank.encoder['name']!r}: {exc}") from exc
        if bank.encoder["dim"] != ENCODER_DIM:
            raise BankError(f"mask bank centroids have {bank.encoder['dim']} dimensions, the encoder {ENCODER_DIM}")
        learned = bank.router.get("kind") in KINDS
        self.method = method or ("learned" if learned else "centroid")
        if self.method not in METHODS:
            raise BankError(f"router method {self.method!r} not available: choose one of {', '.join(METHODS)}")
        if self.method == "learned" and not learned:
            raise BankError(f"router method 'learned' not available for this bank: it has centroids only (format "
                            f"{bank.format_version}, no learned router); route it with 'centroid' or build a "
                            f"format-2 bank with masks.learn_router")
        self.bank = bank
        self._encoder = encoder  # loaded on first use: routing precomputed embeddings needs none
        self.centroids = F.normalize(bank.centroid_tensor(), dim=1)
        # Centroid routing on a format-2 bank ignores its predictor: no predicted loss, so no max_loss either.
        self.predictor = Predictor.from_dict(bank.router) if self.method == "learned" else None
        self.lm = lm
        reads_lm = self.predictor is not None and "lm" in self.predictor.needs()
        self.lm_spec = bank.router.get("lm_features") if reads_lm else None
        if reads_lm and self.lm_spec is None:
            raise BankError("mask bank's learned router reads the LM's token table but holds no lm_features")
        self.masks = bank.mask_tensors()
        self.mask_ids = list(bank.mask_ids)
        self.budgets = bank.budget_list()
        self.default_budget = float(bank.sparsity)
        if default_budget is not None:
            try:
                self.check(budget=default_budget)
            except ValueError as exc:
                raise BankError(f"default budget: {exc}") from None
            self.default_budget = float(default_budget)
        # The learned router falls back only where the bank says it helps on far calibration documents.
        applies = ood and (self.method == "centroid" or bank.ood.get("learned", True))
        self.ood_distance = bank.ood.get("distance") if applies else None

    @property
    def encoder(self):
        if self._encoder is None:
            self._encoder = load_encoder()
        return self._encoder

    def warm_up(self) -> None:
        """The encoder's warm-up, then one route through the whole path (the LM's features, the
        predictor), so the first request does not pay their first calls."""
        self.encoder.warm_up()
        if self.lm_spec is None or self.lm is not None:
            self.route(["warm-up"])

    def check(self, budget: float | None = None, max_loss: float | None = None) -> None:
        """Raise ``ValueError`` (message fit for a client) for a budget / max_loss this bank cannot serve."""
        if budget is not None and max_loss is not None:
            raise ValueError("give either budget or max_loss, not both")
        if budget is not None and not any(abs(budget - b) < 1e-9 for b in self.budgets):
            raise ValueError(f"budget {budget} is not in this mask bank; available: {', '.join(map(str, self.budgets))}")
        if max_loss is not None:
            if self.predictor is None:
                raise ValueError("max_loss needs the learned router (a predicted loss per mask); this server routes "
                                 "by nearest centroid")
            if not math.isfinite(max_loss) or max_loss < 0:
                raise ValueError(f"max_loss must be a finite number >= 0, got {max_loss}")

    def mask_ids_at(self, budget: float | None = None) -> list[str]:
        """The masks this router may pick at a budget (default: its default budget), OOD fallback included."""
        s = self.default_budget if budget is None else budget
        ids = self.bank.candidate_ids(s) if self.predictor is not None else self.bank.cluster_ids(s)
        fallback = self.bank.global_id(s) if self.ood_distance is not None else None
        return ids + [fallback] if fallback is not None and fallback not in ids else ids

    def route(self, texts: list[str], budgets: list[float | None] | None = None,
              max_losses: list[float | None] | None = None, batch_size: int = 32) -> list[Route]:
        """One Route per text; ``budgets[i]`` / ``max_losses[i]`` are that text's options (None: default)."""
        n = len(texts)
        budgets, max_losses = budgets or [None] * n, max_losses or [None] * n
        for b, x in zip(budgets, max_losses):
            self.check(b, x)
        start = time.perf_counter()
        return self.route_embedded(self.inputs(texts, batch_size), budgets, max_losses, start)

    def inputs(self, texts: list[str], batch_size: int = 32) -> dict[str, torch.Tensor]:
        """What this router reads of each text: the encoder's embedding, and the LM's token-table
        features where its predictor reads them (router.lm_features)."""
        with torch.inference_mode():
            out = {"encoder": embed(texts, batch_size, self.encoder)}
            if self.lm_spec is not None:
                if self.lm is None:
                    raise BankError("this bank's learned router reads the LM's token table: give the Router lm=")
                out["lm"] = lm_features(self.lm, texts, self.lm_spec)
        return out

    def route_embedded(self, x: dict[str, torch.Tensor] | torch.Tensor, budgets: list[float | None],
                       max_losses: list[float | None], start: float | None = None) -> list[Route]:
        """``route`` on inputs already computed (``inputs``; a tensor: the encoder's embeddings; ``start``:
        when routing began, for ``router_ms``)."""
        start = time.perf_counter() if start is None else start
        emb = x["encoder"] if isinstance(x, dict) else x
        with torch.inference_mode():
            best, idx = (emb @ self.centroids.T).max(1)
            pred = self.predictor.predict(x) if self.predictor is not None else None
        picks = [self._pick(1.0 - float(best[i]), int(idx[i]), None if pred is None else pred[i], budgets[i],
                            max_losses[i]) for i in range(len(emb))]
        ms = (time.perf_counter() - start) * 1000
        return [Route(m, d, ms, self.bank.budget_of(m), fb, pl) for m, d, fb, pl in picks]

    def _pick(self, distance: float, nearest: int, pred: torch.Tensor | None, budget: float | None,
              max_loss: float | None) -> tuple[str, float, bool, float | None]:
        """(mask id, distance, fallback, predicted loss) for one text."""
        out = self.ood_distance is not None and distance > self.ood_distance
        loss = {} if pred is None else dict(zip(self.predictor.candidates, pred.tolist()))
        if max_loss is not None:
            return self._within(loss, max_loss, out, distance)
        s = self.default_budget if budget is None else budget
        if out and self.bank.global_id(s) is not None:
            m = self.bank.global_id(s)
            return m, distance, True, loss.get(m)
        if pred is None:
            return self.bank.cluster_ids(s)[nearest], distance, False, None
        m = min(self.bank.candidate_ids(s), key=lambda c: loss[c])
        return m, distance, False, loss[m]

    def _within(self, loss: dict[str, float], max_loss: float, out: bool, distance: float):
        """The sparsest candidate predicted within ``max_loss`` (lowest prediction among equals); dense if none."""
        for s in sorted(self.budgets, reverse=True):
            ids = [self.bank.global_id(s)] if out and self.bank.global_id(s) else self.bank.candidate_ids(s)
            ok = [m for m in ids if loss[m] <= max_loss]
            if ok:
                m = min(ok, key=lambda c: loss[c])
                return m, distance, out, loss[m]
        return DENSE, distance, out, 0.0
