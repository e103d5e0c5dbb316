"""Loading for `igserve serve`: model, mask bank and router into a ready engine (``Loaded``).

Loading blocks for seconds, so it runs on a thread of its own that ends with it: the OpenMP
workers torch starts there end too, and the engine thread stays the only one with a team (see
server.async_engine).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from os.path import commonprefix
from pathlib import Path
from typing import Callable

import torch

from masks.bank import DENSE, BankError, MaskBank
from router.encoder import load_encoder
from router.lm_features import TokenTable
from router.router import Router
from server import models
from server.async_engine import AsyncEngine
from server.config import ServeConfig
from server.depth import AdaptiveDepth
from server.engine import LLMEngine
from server.metrics import ServingMetrics
from server.runner import BlockRunner
from server.structured import StructuredOutputs

REPO_ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("igserve.loading")


@dataclass(frozen=True)
class MaskChoice:
    mask: torch.Tensor
    skip_ratio: float
    compute_saved: float


@dataclass
class Loaded:
    """Everything a request needs once loading is done."""

    name: str
    tokenizer: object
    context: int
    vocab_size: int
    max_token_chars: int  # the longest token's text: a prompt longer than context * this cannot fit
    masks: dict[str, MaskChoice]  # every id a client may force, "dense" included
    routing: bool  # False: dense mode (no bank)
    engine: AsyncEngine
    metrics: ServingMetrics
    dtype: str
    weights: str
    kernels: str  # "igserve-avx2" (the fused blocks or igserve's quantised linears run) or "torch"
    structured: StructuredOutputs  # response_format grammars for this tokenizer (built once: walks the vocabulary)
    router: Router | None  # None: dense mode
    kv_cache_dtype: str


def bank_path(bank: str | None) -> Path | None:
    if not bank:
        return None
    path = Path(bank).expanduser()
    if not path.is_absolute() and not path.exists():
        path = REPO_ROOT / path  # the default bank ships inside the package tree
    return path if path.is_file() else None


def _mask_tensors(bank: MaskBank | None, router: Router | None, num_blocks: int) -> dict[str, torch.Tensor]:
    """One tensor per mask id, shared by forced and routed requests."""
    if bank is None:
        return {DENSE: torch.ones(num_blocks, dtype=torch.bool)}
    return {i: router.masks[i] if i in router.masks else bank.mask(i) for i in bank.all_mask_ids()}


def shared_chat_prefix(tokenizer) -> list[int] | None:
    """The token ids every one-turn chat prompt starts with: the chat template up to the user's
    text (for SmolLM2 its default system turn), as the server renders and tokenises chats."""
    try:
        ids = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                       add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"] for text in ("a", "Zq 1")]
    except Exception:  # no chat template: nothing is shared
        return None
    return commonprefix(ids) or None


def load_served(cfg: ServeConfig, on_death: Callable[[str], None] = lambda message: None) -> Loaded:
    """Load model, bank and encoder, and build the engine (blocking; raises ModelLoadError,
    BankError or EncoderError with a message for the operator)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dtype = models.resolve_encoder_dtype(cfg.dtype, cfg.device)
    weights, lm_dtype = models.resolve_weights(cfg.weights, cfg.dtype, cfg.device)
    dtype_name = str(lm_dtype).removeprefix("torch.")
    lm = models.load(cfg.model, device=cfg.device, dtype=lm_dtype, weights=weights)
    kv_dtype = "auto" if cfg.kv_cache_dtype == "auto" else getattr(torch, cfg.kv_cache_dtype)
    runner = BlockRunner(lm.model, max_batch=cfg.max_batch, max_len=cfg.max_model_len, kv_dtype=kv_dtype)
    kernels = runner.kernels
    log.info("model %s: %s weights (%s kernels), %s activations on %s", lm.name, weights, kernels, dtype_name,
             cfg.device)
    log.info("KV cache: %s, %d slots of %d positions", runner.cache.dtype, cfg.max_batch, runner.max_len)
    if cfg.adaptive_depth_budget is not None and not cfg.adaptive_depth:
        raise BankError("--adaptive-depth-budget needs --adaptive-depth")
    path = bank_path(cfg.bank)
    bank, router, depth = None, None, None
    if path is None:
        routing_flags = [flag for flag, on in (("--router", cfg.router), ("--budget", cfg.budget is not None),
                                               ("--adaptive-depth", cfg.adaptive_depth)) if on]
        if routing_flags:
            raise BankError(f"{', '.join(routing_flags)} need a mask bank, and there is none at {cfg.bank}")
        log.warning("no mask bank at %s: serving dense (mask 'dense' for every request, router not loaded)",
                    cfg.bank)
    else:
        bank = MaskBank.load(path)
        bank.check_model(lm.fingerprint, runner.num_blocks)
        encoder = load_encoder(cfg.device, dtype)
        log.info("routing encoder: %s", str(dtype).removeprefix("torch."))
        try:
            router = Router(bank, encoder, method=cfg.router, default_budget=cfg.budget, lm=TokenTable.of(lm))
            if cfg.adaptive_depth:
                shared = None if cfg.adaptive_depth_mask != "global" else {
                    b: (g, router.masks[g]) for b in router.budgets if (g := bank.global_id(b)) is not None}
                depth = AdaptiveDepth(router.budgets, router.default_budget, cfg.adaptive_depth_queue,
                                      cfg.adaptive_depth_budget, shared)
        except ValueError as exc:  # BankError included
            raise BankError(f"mask bank {path}: {exc}") from None
        log.info("mask bank %s: %d clusters, budgets %s (default %g), %s router%s", path, len(bank.mask_ids),
                 ", ".join(f"{b:g}" for b in router.budgets), router.default_budget, router.method,
                 f", adaptive depth to {depth.sparse:g} at {depth.engage} waiting" if depth else "")
    masks = {i: MaskChoice(m, 1.0 - float(m.float().mean()), runner.cost.compute_saved(m))
             for i, m in _mask_tensors(bank, router, runner.num_blocks).items()}
    metrics = ServingMetrics(lm.name, {i: (m.skip_ratio, m.compute_saved) for i, m in masks.items()})
    engine = LLMEngine(runner, lm.tokenizer, cfg.max_batch, router, cfg.max_num_batched_tokens, depth,
                       prefix_cache=cfg.prefix_cache, shared_prefix=shared_chat_prefix(lm.tokenizer))
    max_token_chars = max(len(t) for t in lm.tokenizer.convert_ids_to_tokens(list(range(len(lm.tokenizer)))))
    return Loaded(lm.name, lm.tokenizer, runner.max_len, lm.model.config.vocab_size, max_token_chars, masks,
                  router is not None, AsyncEngine(engine, cfg.max_queue, metrics, on_death), metrics, dtype_name,
                  weights, kernels, StructuredOutputs(lm.tokenizer, lm.model.config.vocab_size), router,
                  str(runner.cache.dtype).removeprefix("torch."))


async def in_own_thread(fn, *args):
    """``fn(*args)`` on a new thread that ends with it (see the module docstring)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def target():
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(done.set_exception, exc)
        else:
            loop.call_soon_threadsafe(done.set_result, result)

    threading.Thread(target=target, name="igserve-load", daemon=True).start()
    return await done
