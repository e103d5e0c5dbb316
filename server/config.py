"""`igserve serve` configuration: one ``ServeConfig``; its command-line flags are made from its fields.

Each field's help text lives in its metadata, so a new setting is one line here and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from server import models, weights as wf

DEFAULT_BANK = "masks/banks/smollm2-135m-instruct-routed.json"
KV_DTYPES = ("auto", "float32", "float16")  # what the fused CPU blocks read (bf16 activations: auto)
ROUTERS = ("learned", "centroid")  # router.router.METHODS (not imported here: that loads torch)


def _opt(default, help: str, **argparse_kwargs):
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass
class ServeConfig:
    model: str = _opt(models.DEFAULT_MODEL, "packaged model name or HF directory")
    bank: str | None = _opt(DEFAULT_BANK, "mask bank JSON; a missing file serves dense")
    router: str | None = _opt(None, "how a routed request picks its mask: learned (the bank's loss predictor) or "
                                    "centroid (nearest cluster centroid); default: learned when the bank has a "
                                    "learned router (format 2), else centroid", choices=ROUTERS)
    budget: float | None = _opt(None, "budget (sparsity) a routed request gets when it names none; one the bank "
                                      "holds (default: the bank's)")
    adaptive_depth: bool = _opt(False, "under load, routed requests that fix no budget are admitted at the bank's "
                                       "next sparser budget (README, load-adaptive depth)")
    adaptive_depth_queue: int = _opt(8, "with --adaptive-depth: waiting requests at which admissions go sparser; "
                                        "back to the default budget once fewer than half as many wait")
    adaptive_depth_budget: float | None = _opt(None, "with --adaptive-depth: the budget admissions take under "
                                                     "load; one the bank holds, sparser than the default "
                                                     "(default: the bank's next budget above the default)")
    adaptive_depth_mask: str = _opt("global", "with --adaptive-depth: the mask an adapted request runs: the budget's "
                                              "global mask, shared by every adapted row so a batch skips the whole "
                                              "budget, or a routed one", choices=("global", "routed"))
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "port to listen on")
    api_key: str | None = _opt(None, "require 'Authorization: Bearer KEY' on /v1 (default: $IGSERVE_API_KEY)",
                               env="IGSERVE_API_KEY")
    device: str = _opt("cpu", "cpu, cuda or cuda:N")
    dtype: str = _opt("auto", "weights and KV cache; auto: bfloat16 on CUDA and on CPUs with AMX, else float32",
                      choices=models.DTYPES)
    weights: str = _opt("auto", "linear weight format; auto: by CPU (README, weight formats)",
                        choices=wf.FORMATS)
    kv_cache_dtype: str = _opt("auto", "K/V cache element type; auto: float16 where the fused CPU blocks run "
                                       "(float32 activations on CPU), else the activations' dtype",
                               choices=KV_DTYPES)
    max_batch: int = _opt(16, "sequences per step (KV cache slots)")
    max_queue: int = _opt(64, "waiting requests before 429")
    max_tokens_limit: int = _opt(1024, "largest max_tokens a request may ask for")
    max_model_len: int = _opt(2048, "context length (prompt + output) the KV cache is sized for")
    max_num_batched_tokens: int | None = _opt(None, "tokens per engine step while requests are decoding: one per "
                                                    "decoding request, the rest for prefill chunks (long prompts "
                                                    "are prefilled over several steps); default: sized per step "
                                                    "from the step cost measured at start-up, so a chunk adds at "
                                                    "most 0.75x the step's decode time")
    prefix_cache: bool = _opt(True, "a freed cache slot keeps its K/V; a request whose prompt starts with tokens a "
                                    "free slot holds under the same mask skips their prefill (shared system "
                                    "prompts, chat turns); the chat template's shared start is warmed at "
                                    "start-up under each mask the router can pick")
    max_body_bytes: int = _opt(4 * 1024 * 1024, "largest request body; larger bodies get 413")
    drain_timeout: float = _opt(30.0, "seconds in-flight requests may take to finish on SIGTERM; then they end "
                                      "with an error and the process exits")
    log_level: str = _opt("info", "debug, info, warning or error")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(ServeConfig):
        meta = dict(f.metadata)
        env = meta.pop("env", None)
        default = os.environ.get(env, f.default) if env else f.default
        kind = str(f.type).split(" ")[0]
        if kind == "bool":  # --flag / --no-flag
            parser.add_argument("--" + f.name.replace("_", "-"), default=default,
                                action=argparse.BooleanOptionalAction, **meta)
            continue
        parser.add_argument("--" + f.name.replace("_", "-"), default=default,
                            type={"int": int, "float": float}.get(kind), **meta)


def from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig)})
