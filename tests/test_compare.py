"""`igserve bench compare`'s handling of a llama-server that dies at start-up, against stand-ins for
llama.cpp's binaries (the real ones are a benchmark peer, never needed by tests)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from bench import compare

# Dies with SIGSEGV unless started with --no-repack (as llama-server on an AMX CPU with a Q4_1
# GGUF); otherwise answers /health on --port.
FAKE_SERVER = """#!{python}
import http.server, os, signal, sys
if "--no-repack" not in sys.argv:
    os.kill(os.getpid(), signal.SIGSEGV)
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{{"status":"ok"}}')
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""

# Prints llama-bench's JSON; its tokens/s says whether it was asked for --repack 0.
FAKE_BENCH = """#!{python}
import json, sys
print(json.dumps([{{"avg_ts": 100.0 if "--repack" in sys.argv else 250.0}}]))
"""


def _install(root: Path, name: str, text: str) -> None:
    path = root / "build" / "bin" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.format(python=sys.executable))
    path.chmod(0o755)


def test_a_llama_server_that_crashes_at_start_is_served_again_with_no_repack(tmp_path):
    _install(tmp_path, "llama-server", FAKE_SERVER)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    proc, url, extra = compare.serve_llama(tmp_path, gguf, 4, 64)
    try:
        assert extra == compare.LLAMA_FALLBACK
        assert httpx.get(url + "/health").json() == {"status": "ok"}
    finally:
        compare._stop(proc)
    assert proc.args[-1] == "--no-repack"


def test_llama_bench_reports_the_fallback_form_for_formats_that_needed_it(tmp_path):
    _install(tmp_path, "llama-bench", FAKE_BENCH)
    files = {"Q4_1": tmp_path / "q.gguf", "BF16": tmp_path / "b.gguf"}
    out = compare.llama_bench(tmp_path, files, 16, {"Q4_1"})
    assert out == {"Q4_1": 250.0, "BF16": 250.0, "Q4_1 --no-repack": 100.0}
    assert compare.llama_bench(tmp_path, files, 16) == {"Q4_1": 250.0, "BF16": 250.0}


def test_batch1_decode_is_set_beside_llama_bench_at_the_same_format():
    """igserve's int4 formats are compared with Q4_1 (as llama-bench runs it, and in its fallback
    form where llama-server needed one) at llama-bench's depth, the figure after a longer prompt
    beside it; a format llama-bench did not run gives no entry."""
    bench = {"Q4_1": 200.0, "Q4_1 --no-repack": 100.0, "BF16": 50.0}
    got = compare.batch1_decode(150.0, "int4bf16", bench, deep_tok_s=120.0)
    assert got["llama_format"] == "Q4_1" and got["ratio"] == 0.75 and got["ok"] is False
    assert got["ratio_vs_fallback"] == 1.5 and got["llama_bench_fallback"] == "--repack 0"
    assert got["prompt_tokens"] == 1 and (got["deep_prompt_tokens"], got["igserve_dense_tok_s_deep"]) == (128, 120.0)
    bf16 = compare.batch1_decode(60.0, "bf16", bench)
    assert bf16["ok"] is True and "ratio_vs_fallback" not in bf16
    assert compare.batch1_decode(60.0, "fp32", bench) is None
    assert compare.batch1_decode(60.0, "int8", bench) is None
    assert compare.batch1_decode(None, "int4", bench) is None


def test_batch1_decode_of_other_formats_goes_beside_the_served_one():
    """The served format first, then each other format llama-bench ran at its same format (bf16 vs
    BF16); formats without a llama.cpp counterpart measured here are not run at all."""
    bench = {"Q4_1": 200.0, "BF16": 50.0}
    calls = []

    def measure(weights, prompt_tokens):
        calls.append((weights, prompt_tokens))
        return {"int4bf16": 210.0, "bf16": 40.0}[weights] + (0 if prompt_tokens == 1 else -10)

    got = compare.batch1_decodes("int4bf16", ["bf16", "fp32", "int4bf16", ""], bench, measure)
    assert {w for w, _ in calls} == {"int4bf16", "bf16"} and len(calls) == 4
    assert got["batch1_decode"]["ratio"] == 1.05 and got["batch1_decode"]["igserve_dense_tok_s_deep"] == 200.0
    assert list(got["batch1_decode_other_formats"]) == ["bf16"]
    assert got["batch1_decode_other_formats"]["bf16"]["ratio"] == 0.8
    assert got["batch1_decode_other_formats"]["bf16"]["ok"] is False


def test_acceptance_reports_ig_over_dense_at_the_most_clients():
    """igserve's runs carry its weight format as their format; IG/dense is found by mode."""
    run = lambda server, fmt, mode, c, tok: {"server": server, "format": fmt, "mode": mode, "clients": c,
                                             "output_tok_s": tok, "ttft_ms_p50": 30.0}
    runs = [run("llama-server", "Q4_1", "plain", c, 100.0) for c in (1, 16)]
    runs += [run("igserve", "int4bf16", m, c, t) for m, c, t in
             (("ig", 1, 110.0), ("dense", 1, 100.0), ("ig", 16, 160.0), ("dense", 16, 200.0))]
    got = compare.acceptance(runs, [1, 16])
    assert got["ig_over_dense_max_clients"] == 0.8
    assert got["ig_over_best_llama_x1"] == {"ratio": 1.1, "llama_best_format": "Q4_1", "ok": True}
    assert got["ig_over_best_llama_x16"]["ok"] is True and got["ttft_p50_x1"]["ok"] is True


def test_runs_send_at_least_min_requests():
    """Few clients send more requests each, so a 1-client percentile is not the median of 4."""
    args = compare.argparse_namespace(requests_per_client=4, min_requests=16)
    assert [compare.per_client(args, c) for c in (1, 3, 4, 16)] == [16, 6, 4, 4]
    args.min_requests = 0
    assert compare.per_client(args, 1) == 4
