"""One bad request never hurts another, through the real server and the official SDK: the repros
that used to give 500s, body limits, engine death and the drain timeout."""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time

import httpx
import openai
import pytest
import torch

from tests.conftest import TEST_API_KEY, start_process, stop_process
from tests.test_api import LONG, mask_body, run_alone

AUTH = {"Authorization": f"Bearer {TEST_API_KEY}"}


@pytest.fixture(scope="module")
def model(tiny):
    return tiny.name


@pytest.fixture(scope="module")
def server(serve_tiny):
    return serve_tiny(max_tokens_limit=LONG)


def test_same_prompt_with_two_masks_at_once(server, model, tiny, tiny_bank):
    """Two requests with equal prompt ids and different masks share the engine: both succeed and
    each equals its run alone (engine requests used to compare by value, mask tensors included)."""
    client = server.client()
    prompt = "Once upon a time"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(client.completions.create, model=model, prompt=prompt, max_tokens=60, temperature=0,
                           extra_body=mask_body("dense"))
        time.sleep(0.05)
        short = pool.submit(client.completions.create, model=model, prompt=prompt, max_tokens=5, temperature=0,
                            extra_body=mask_body("global"))
        long, short = long.result(), short.result()
    ids = tiny.tokenizer(prompt)["input_ids"]
    assert long.choices[0].text == run_alone(tiny, ids, torch.ones(8, dtype=torch.bool), max_tokens=60,
                                             temperature=0).text
    assert short.choices[0].text == run_alone(tiny, ids, tiny_bank.mask("global"), max_tokens=5, temperature=0).text


@pytest.mark.parametrize("field, value", [("temperature", 1e-300), ("temperature", 5e-324), ("top_p", 1e-300)])
def test_extreme_sampling_values_are_served_and_hurt_no_one(server, model, tiny, field, value):
    """Found by fuzzing: these gave 500 and failed every request in the batch. Below 1e-5 a
    temperature is greedy; a tiny top_p keeps the most likely token."""
    client = server.client()
    victim = client.completions.create(model=model, prompt="Once upon a time", max_tokens=LONG, temperature=0,
                                       stream=True, extra_body=mask_body("dense"))
    chunks = iter(victim)
    next(chunks)
    body = {"temperature": 1.0, field: value}
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, seed=3,
                                  extra_body=mask_body("dense"), **body)
    greedy = run_alone(tiny, tiny.tokenizer("The capital of France is")["input_ids"], torch.ones(8, dtype=torch.bool),
                       max_tokens=8, temperature=0)
    assert r.choices[0].text == greedy.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"


def _rss_kb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_huge_body_is_413_and_stalls_nothing(tiny_model_dir, tiny_bank_file, model):
    """A 30 MB body is refused with 413 before it is read; /health keeps answering fast meanwhile
    and the server's memory stays where it was. A prompt too long to fit in the context is refused
    before it is tokenised."""
    proc, base = start_process(tiny_model_dir, tiny_bank_file)
    try:
        for _ in range(3):  # settle the allocator with ordinary traffic
            assert httpx.post(base + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}
                              ).status_code == 200
        baseline = _rss_kb(proc.pid)
        body = b'{"model": "%s", "prompt": "' % model.encode() + b"a" * 30_000_000 + b'"}'
        result = {}

        def post():
            try:
                result["r"] = httpx.post(base + "/v1/completions", content=body,
                                         headers={"Content-Type": "application/json"}, timeout=60)
            except httpx.TransportError as exc:  # the server may close before the upload ends
                result["exc"] = exc

        sender = threading.Thread(target=post)
        sender.start()
        health_ms = []
        with httpx.Client(base_url=base, timeout=30) as probe:
            while sender.is_alive():
                t = time.perf_counter()
                assert probe.get("/health").status_code == 200
                health_ms.append((time.perf_counter() - t) * 1000)
                time.sleep(0.01)
        sender.join()
        if "r" in result:
            r = result["r"]
            assert r.status_code == 413, r.text
            assert r.json()["error"]["code"] == "request_too_large"
        # Not frozen (it was for ~20 s); bench/reliability.py measures the latency itself.
        assert health_ms and max(health_ms) < 1000, health_ms
        # chunked upload without a Content-Length: refused once the bytes pass the limit
        r = httpx.post(base + "/v1/completions", content=iter([body[:1_000_000]] * 8),
                       headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 413 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        # under the body limit but more characters than the context can hold: 400, not tokenised
        t = time.perf_counter()
        r = httpx.post(base + "/v1/completions", json={"model": model, "prompt": "word " * 700_000}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "characters" in r.json()["error"]["message"]
        assert _rss_kb(proc.pid) <= baseline * 1.10, (baseline, _rss_kb(proc.pid))
        assert httpx.post(base + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}
                          ).status_code == 200
    finally:
        stop_process(proc)


def test_engine_death_turns_health_to_503_and_stops_the_server(tiny_model_dir, tiny_bank_file, model):
    """If the engine thread dies, streams in flight end with an error event, /health says 503,
    new requests get 503, and the server is told to exit (igserve serve then exits 1)."""
    from server.api import ServeConfig
    from tests.conftest import LiveServer

    server = LiveServer(ServeConfig(model=str(tiny_model_dir), bank=str(tiny_bank_file), max_batch=2,
                                    max_model_len=256, max_tokens_limit=LONG, dtype="float32",
                                    log_level="warning")).start()
    try:
        engine = server.app.state.service.loaded.engine
        client = server.client()
        stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=LONG,
                                           temperature=0, stream=True, extra_body=mask_body("dense"))
        chunks = iter(stream)
        next(chunks)

        def die():
            raise SystemExit("simulated crash")

        engine._drain_inbox = die  # the loop calls it between steps
        engine._wake.set()
        with pytest.raises(openai.APIError) as info:
            list(chunks)
        assert "engine stopped" in str(info.value)
        deadline = time.monotonic() + 10
        while not server.failures:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "engine thread died" in server.failures[0]
        health = httpx.get(server.base_url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert health.json()["engine_alive"] is False
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=model, prompt="hi", max_tokens=2)
        assert info.value.status_code == 503
    finally:
        server.stop()


def test_drain_timeout_ends_remaining_streams_with_an_error(tiny_model_dir, tiny_bank_file, model):
    """SIGTERM: a stream that outlasts --drain-timeout ends with an error event and [DONE], a new
    request meanwhile is refused, the process exits, and it says how many it cut off."""
    proc, base = start_process(tiny_model_dir, tiny_bank_file, "--drain-timeout", "0.05", "--max-tokens-limit",
                               str(LONG))
    try:
        events = []
        with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
                "model": model, "prompt": "Once upon a time", "max_tokens": LONG, "temperature": 0, "stream": True,
                "ignore_eos": True, "igserve": {"mask": "dense"}}) as r:
            lines = r.iter_lines()
            events.append(next(lines))
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            events += [line for line in lines if line.startswith("data:")]
        assert events[-1] == "data: [DONE]"
        assert '"error"' in events[-2] and "drain timeout" in events[-2], events[-2]
        assert time.monotonic() - t0 < 15
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert "ending 1 requests still in flight" in proc.stdout.read()
    finally:
        stop_process(proc)
