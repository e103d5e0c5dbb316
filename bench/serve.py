"""`igserve bench serve`: concurrent streaming chat clients against a server, IG routing vs forced dense.

Starts its own server (``--model``, ``--bank``, ``--max-batch``, ``--server-args``) unless ``--url``
names a running one. For each
client count and each mode (``ig``: ``igserve.mask`` auto; ``dense``: forced) -- the two modes
alternate per client count so background load hits both alike -- C closed-loop clients each send
R greedy streaming requests with mixed-domain prompts, each generating exactly ``--max-tokens``
(``ignore_eos``, so that IG and dense do the same work). Reported per run: aggregate output
tokens/s (completion tokens over wall time), TTFT and per-token latency percentiles, router ms
skip ratio, budget and the share admitted sparser by ``--adaptive-depth`` from the ``igserve``
objects, and the acceptance checks of the serving design.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from server import models
from server.config import DEFAULT_BANK
from server.weights import machine

PROMPTS = Path(__file__).resolve().parents[1] / "load" / "prompts.jsonl"
MODES = {"ig": "auto", "dense": "dense"}


@dataclass
class Sample:
    tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    router_ms: float | None = None
    skip_ratio: float | None = None
    budget: float | None = None
    adaptive: bool = False  # admitted at a sparser budget by the server's --adaptive-depth
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details: prompt tokens the prefix cache held
    error: str | None = None


async def stream_chat(http: httpx.AsyncClient, model: str, prompt: str, mask: str, max_tokens: int,
                      ignore_eos: bool = True) -> Sample:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos,
            "igserve": {"mask": mask}}
    start = time.perf_counter()
    first = last = None
    sample = Sample()
    usage_tokens, content_chunks = None, 0
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return Sample(error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Sample(error=chunk["error"]["message"])
                info = chunk.get("igserve")  # absent from other servers (bench compare)
                if info:
                    sample.router_ms, sample.skip_ratio = info["router_ms"], info["skip_ratio"]
                    sample.budget, sample.adaptive = info.get("budget"), bool(info.get("adaptive"))
                if usage := chunk.get("usage"):
                    usage_tokens = usage["completion_tokens"]
                    sample.prompt_tokens = usage.get("prompt_tokens")
                    sample.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    last = time.perf_counter()
                    first = first or last
                    content_chunks += 1
    except httpx.HTTPError as exc:
        return Sample(error=f"{type(exc).__name__}: {exc}")
    sample.tokens = content_chunks if usage_tokens is None else usage_tokens
    if first is not None:
        sample.ttft_s = first - start
        if sample.tokens > 1:
            sample.tpot_s = (last - first) / (sample.tokens - 1)
    return sample


async def run_clients(http, model: str, prompts: list[str], mode: str, clients: int, per_client: int,
                      max_tokens: int, ignore_eos: bool = True) -> dict:
    async def client(i: int) -> list[Sample]:
        # consecutive clients start on different prompts, so every step mixes domains
        return [await stream_chat(http, model, prompts[(i + j * clients) % len(prompts)], MODES[mode], max_tokens,
                                   ignore_eos) for j in range(per_client)]

    start = time.perf_counter()
    samples = [s for batch in await asyncio.gather(*(client(i) for i in range(clients))) for s in batch]
    wall = time.perf_counter() - start
    ok = [s for s in samples if s.error is None]

    def pct(values, q):
        values = [v for v in values if v is not None]
        return round(float(np.percentile(values, q)), 2) if values else None

    def mean(values):  # None: a server without igserve objects (llama-server)
        values = [v for v in values if v is not None]
        return round(float(np.mean(values)), 4) if values else None

    return {
        "mode": mode, "clients": clients,
        "output_tok_s": round(sum(s.tokens for s in ok) / wall, 2),
        "ttft_ms_p50": pct([s.ttft_s * 1000 for s in ok if s.ttft_s], 50),
        "ttft_ms_p95": pct([s.ttft_s * 1000 for s in ok if s.ttft_s], 95),
        "tpot_ms_p50": pct([s.tpot_s * 1000 for s in ok if s.tpot_s], 50),
        "tpot_ms_p95": pct([s.tpot_s * 1000 for s in ok if s.tpot_s], 95),
        "router_ms_p50": pct([s.router_ms for s in ok], 50),
        "skip_ratio_mean": mean([s.skip_ratio for s in ok]),
        "budget_mean": mean([s.budget for s in ok]),
        "adaptive_share": round(sum(s.adaptive for s in ok) / len(ok), 4) if ok else None,
        "prompt_cached_share": _cached_share(ok),
        "requests": len(samples), "errors": len(samples) - len(ok),
        "output_tokens": sum(s.tokens for s in ok), "wall_s": round(wall, 2),
        "error_examples": sorted({s.error for s in samples if s.error})[:3],
    }


def _cached_share(samples: list[Sample]) -> float | None:
    """Share of the prompt tokens the server's prefix cache held (None: the server does not say)."""
    known = [s for s in samples if s.cached_tokens is not None and s.prompt_tokens]
    return round(sum(s.cached_tokens for s in known) / sum(s.prompt_tokens for s in known), 4) if known else None


def acceptance(runs: list[dict]) -> dict:
    """The serving targets: 16 clients >= 4x one client; router <= 10% of median TTFT; IG above dense."""
    by = {(r["mode"], r["clients"]): r for r in runs}
    counts = sorted({r["clients"] for r in runs})
    lo, hi = counts[0], counts[-1]
    scaling = {mode: round(by[mode, hi]["output_tok_s"] / max(by[mode, lo]["output_tok_s"], 1e-9), 2)
               for mode in MODES if (mode, lo) in by and (mode, hi) in by}
    ig = [r for r in runs if r["mode"] == "ig" and r["ttft_ms_p50"]]
    router_share = round(max((r["router_ms_p50"] / r["ttft_ms_p50"] for r in ig), default=0.0), 4)
    ig_over_dense = {c: round(by["ig", c]["output_tok_s"] / max(by["dense", c]["output_tok_s"], 1e-9), 3)
                     for c in counts if ("ig", c) in by and ("dense", c) in by}
    return {
        f"scaling_{hi}_over_{lo}": scaling,
        "scaling_ok": all(v >= 4 for v in scaling.values()) if (lo, hi) == (1, 16) else None,
        "router_share_of_ttft_max": router_share,
        "router_ok": router_share <= 0.10,
        "ig_over_dense": ig_over_dense,
        "ig_faster_ok": all(v > 1 for v in ig_over_dense.values()),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, max_batch: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", args.model, "--bank", args.bank,
           "--port", str(port), "--max-batch", str(max_batch), "--max-model-len", str(args.max_model_len),
           "--dtype", args.dtype, "--weights", args.weights, "--log-level", "warning"]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    cmd += shlex.split(getattr(args, "server_args", None) or "")
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before becoming healthy")
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout}s")


async def bench(url: str, args, client_counts: list[int]) -> list[dict]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    items = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = [item["prompt"] for item in items]
    random.Random(0).shuffle(prompts)
    limits = httpx.Limits(max_connections=max(client_counts) + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        for mode in MODES:  # warm-up: first-call costs stay out of the figures
            await stream_chat(http, model, prompts[0], MODES[mode], 4)
        runs = []
        for clients in client_counts:
            for mode in args.modes:
                run = await run_clients(http, model, prompts, mode, clients, args.requests_per_client,
                                        args.max_tokens, args.ignore_eos)
                print(f"{mode:>5} x{clients:<3} {run['output_tok_s']:8.2f} tok/s  ttft p50 {run['ttft_ms_p50']} ms "
                      f"p95 {run['ttft_ms_p95']} ms  tpot p50 {run['tpot_ms_p50']} ms  router p50 "
                      f"{run['router_ms_p50']} ms  skip {run['skip_ratio_mean']}  errors {run['errors']}",
                      flush=True)
                runs.append(run)
    return runs


def add_arguments(parser) -> None:
    parser.add_argument("--url", help="a running server (default: start one with --model and --bank)")
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--bank", default=DEFAULT_BANK)
    parser.add_argument("--api-key", default=os.environ.get("IGSERVE_API_KEY"))
    parser.add_argument("--clients", default="1,4,16", help="comma-separated concurrent client counts")
    parser.add_argument("--modes", default="ig,dense", help="comma-separated: ig, dense")
    parser.add_argument("--requests-per-client", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024, help="for a server this command starts")
    parser.add_argument("--max-batch", type=int, help="for a server this command starts (default: the largest "
                                                      "client count, so that no request waits for a slot)")
    parser.add_argument("--server-args", default="", help="more `igserve serve` flags for a server this command "
                                                           "starts, e.g. '--budget 0.125 --adaptive-depth'")
    parser.add_argument("--dtype", default="auto", choices=models.DTYPES, help="for a server this command starts")
    parser.add_argument("--weights", default="auto", help="for a server this command starts")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="every request generates exactly --max-tokens (as vLLM's throughput benchmark), "
                             "so both modes do the same work")
    parser.add_argument("--prompts", default=str(PROMPTS), help="JSONL of {domain, prompt}")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout (s)")
    parser.add_argument("--server-log", help="file for the output of a server this command starts")
    parser.add_argument("--json", help="write the results here")


def run(args) -> int:
    client_counts = sorted(int(c) for c in args.clients.split(","))
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        print(f"error: unknown mode(s) {sorted(unknown)}; known: {', '.join(MODES)}", file=sys.stderr)
        return 2
    proc, url = (None, args.url.rstrip("/")) if args.url else start_server(args, args.max_batch or max(client_counts))
    try:
        health = wait_healthy(url, proc)
        if health.get("routing") != "ig" and "ig" in args.modes:
            print("warning: the server runs dense (no mask bank): 'ig' requests are served dense", file=sys.stderr)
        runs = asyncio.run(bench(url, args, client_counts))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    result = {"runs": runs, "acceptance": acceptance(runs),
              "config": {"url": args.url, "model": health.get("model"), "bank": None if args.url else args.bank,
                         "routing": health.get("routing"), "clients": client_counts,
                         "dtype": health.get("dtype"), "weights": health.get("weights"),
                         "ignore_eos": args.ignore_eos, "router": health.get("router"),
                         "default_budget": health.get("default_budget"),
                         "max_batch": None if args.url else args.max_batch or max(client_counts),
                         "server_args": None if args.url else args.server_args,
                         "requests_per_client": args.requests_per_client, "max_tokens": args.max_tokens,
                         "prompts": str(args.prompts)},
              # the machine this command ran on: the server's too, unless --url names another one
              "machine": machine(), "command": args.invocation}
    print(json.dumps(result["acceptance"], indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0
