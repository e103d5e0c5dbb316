"""`igserve bench reliability`: what a 30 MB request body does to a running server.

Starts `igserve serve` (the default model and bank unless told otherwise), sends ordinary
requests, then a ``--body-mb`` body while probing ``/health`` every 10 ms on a kept-alive
connection. Reports the body's status, /health latency during the upload, and the server's RSS
before and after (it must return to within 10% of its baseline).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from server import models
from server.config import DEFAULT_BANK
from server.weights import machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--bank", default=DEFAULT_BANK)
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--body-mb", type=int, default=30)
    parser.add_argument("--json", type=Path, default=Path("bench/results/reliability.json"))


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _probe(http: httpx.Client, busy: threading.Thread) -> list[float]:
    out = []
    while busy.is_alive():
        t = time.perf_counter()
        http.get("/health")
        out.append((time.perf_counter() - t) * 1000)
        time.sleep(0.01)
    return out


def measure(args, base: str, pid: int) -> dict:
    with httpx.Client(base_url=base, timeout=120) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for _ in range(5):
            http.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 8})
        idle = [_probe_once(http) for _ in range(50)]
        baseline = _rss_mb(pid)
        body = b'{"model": "%s", "prompt": "' % model.encode() + b"a" * (args.body_mb * 1_000_000) + b'"}'
        result = {}

        def post():
            try:
                r = httpx.post(base + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                               timeout=120)
                result.update(status=r.status_code, error=r.json()["error"])
            except httpx.HTTPError as exc:
                result.update(status=None, transport_error=repr(exc))

        sender = threading.Thread(target=post)
        start = time.perf_counter()
        sender.start()
        during = _probe(http, sender)
        sender.join()
        result["answered_s"] = round(time.perf_counter() - start, 3)
        time.sleep(1)
        after = _rss_mb(pid)
    return {"body": result, "health_idle_ms": _stats(idle), "health_during_upload_ms": _stats(during),
            "rss_mb": {"baseline": round(baseline, 1), "after": round(after, 1),
                       "after_over_baseline": round(after / baseline, 3)}}


def _probe_once(http: httpx.Client) -> float:
    t = time.perf_counter()
    http.get("/health")
    return (time.perf_counter() - t) * 1000


def _stats(ms: list[float]) -> dict:
    return {"n": len(ms), "median": round(statistics.median(ms), 1), "max": round(max(ms), 1)} if ms else {"n": 0}


def run(args) -> int:
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", args.model, "--bank", args.bank, "--port",
           str(args.port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("server did not start")
            time.sleep(0.5)
        report = measure(args, base, proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    report.update(command=f"igserve bench reliability --body-mb {args.body_mb} --json {args.json}",
                  server=" ".join(cmd[2:]), machine=machine())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0
