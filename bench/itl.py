"""`igserve bench itl`: inter-token latency of running streams while long prompts arrive.

``--streams`` closed-loop streaming clients each generate ``--stream-tokens`` tokens
(``ignore_eos``) again and again; after ``--warmup`` seconds a ``--long-tokens`` prompt (token ids,
one output token) arrives every ``--long-every`` seconds until ``--duration`` ends. Reported: the
gaps between consecutive tokens of the streams (p50/p90/p99/max), before the long prompts start
and while they arrive, and what became of the long requests. A server that prefills a whole long
prompt in one step stalls every stream for that step; chunked prefill under a token budget
bounds the stall to one chunk. Runs are stored by ``--label`` in one JSON file, so a before/after
pair lives side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx
import numpy as np

from server.weights import machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="a running igserve (or any OpenAI-compatible) server")
    parser.add_argument("--api-key")
    parser.add_argument("--label", required=True, help="name of this run in the report (e.g. before, after)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--long-every", type=float, default=1.0, help="seconds between long prompts")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of streams alone first")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds in all")
    parser.add_argument("--mask", default="dense", help="igserve.mask of every request")
    parser.add_argument("--json", type=Path, default=Path("bench/results/itl.json"))


async def _stream(http, model, args, until: float, gaps: list[tuple[float, float]]) -> None:
    body = {"model": model, "prompt": "Once upon a time, in a city by the sea,", "max_tokens": args.stream_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True, "igserve": {"mask": args.mask}}
    while time.monotonic() < until:
        last = None
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                if last is not None:
                    gaps.append((now, now - last))
                last = now


async def _long(http, model, args, ids: list[int], results: list[dict]) -> None:
    t0 = time.monotonic()
    r = await http.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 1,
                                                "igserve": {"mask": args.mask}})
    results.append({"status": r.status_code, "latency_s": round(time.monotonic() - t0, 3)})


def _percentiles(gaps: list[float]) -> dict:
    if not gaps:
        return {"n": 0}
    ms = np.array(gaps) * 1000
    p = {f"p{q}_ms": round(float(np.percentile(ms, q)), 1) for q in (50, 90, 99)}
    return {"n": len(gaps), **p, "max_ms": round(float(ms.max()), 1), "p99_over_p50": round(p["p99_ms"] / p["p50_ms"], 2)}


async def measure(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.streams + 64)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        health = (await http.get("/health")).json()
        start = time.monotonic()
        until = start + args.duration
        gaps: list[tuple[float, float]] = []
        longs: list[dict] = []
        streams = [asyncio.create_task(_stream(http, model, args, until, gaps)) for _ in range(args.streams)]
        await asyncio.sleep(args.warmup)
        rng = random.Random(0)
        long_tasks = []
        while time.monotonic() < until - args.long_every:
            ids = [rng.randrange(1000, 20000) for _ in range(args.long_tokens)]
            long_tasks.append(asyncio.create_task(_long(http, model, args, ids, longs)))
            await asyncio.sleep(args.long_every)
        await asyncio.gather(*streams)
        await asyncio.gather(*long_tasks)
    quiet = [g for t, g in gaps if t < start + args.warmup]
    loaded = [g for t, g in gaps if t >= start + args.warmup + 1]
    return {"label": args.label, "server": health, "itl_streams_alone": _percentiles(quiet),
            "itl_with_long_prompts": _percentiles(loaded),
            "long_requests": {"sent": len(longs), "ok": sum(r["status"] == 200 for r in longs),
                              "statuses": sorted({r["status"] for r in longs}),
                              "latency_p50_s": float(np.median([r["latency_s"] for r in longs])) if longs else None}}


def run(args) -> int:
    result = asyncio.run(measure(args))
    result["params"] = {k: v for k, v in vars(args).items() if k not in ("api_key", "json")}
    result["params"]["json"] = str(args.json)
    report = json.loads(args.json.read_text()) if args.json.exists() else {"runs": {}}
    report["runs"][args.label] = result
    report["machine"] = machine()
    report["command"] = "igserve bench itl --url URL --label LABEL (server as in runs.*.server)"
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("label", "itl_streams_alone", "itl_with_long_prompts",
                                             "long_requests")}, indent=2))
    return 0
