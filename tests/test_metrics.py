"""Prometheus metrics: the contract (names, types, labels, vLLM's buckets) and values that move
exactly as requests are served on a live server (deltas against what the responses report)."""

from __future__ import annotations

import openai
import pytest
from conftest import metric_value, routed_bank

from server import metrics

# name -> (type, extra labels besides model_name)
CONTRACT = {
    "igserve_e2e_request_latency_seconds": ("histogram", set()),
    "igserve_time_to_first_token_seconds": ("histogram", set()),
    "igserve_inter_token_latency_seconds": ("histogram", set()),
    "igserve_request_time_per_output_token_seconds": ("histogram", set()),
    "igserve_request_queue_time_seconds": ("histogram", set()),
    "igserve_router_latency_seconds": ("histogram", set()),
    "igserve_skip_ratio": ("histogram", set()),
    "igserve_compute_saved_ratio": ("histogram", set()),
    "igserve_request_success": ("counter", {"finished_reason"}),
    "igserve_requests_by_mask": ("counter", {"mask"}),
    "igserve_request_errors": ("counter", {"error_type"}),
    "igserve_prompt_tokens": ("counter", set()),
    "igserve_generation_tokens": ("counter", set()),
    "igserve_blocks_executed": ("counter", {"kind"}),
    "igserve_num_requests_running": ("gauge", set()),
    "igserve_num_requests_waiting": ("gauge", set()),
}
# vLLM's boundaries, as transcribed from vllm/v1/metrics/loggers.py (22, 19 and 21 of them).
VLLM_BUCKETS = {
    "igserve_time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                            2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "igserve_inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                                            2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "igserve_e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                            50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
}
VLLM_BUCKETS["igserve_request_time_per_output_token_seconds"] = VLLM_BUCKETS["igserve_inter_token_latency_seconds"]
VLLM_BUCKETS["igserve_request_queue_time_seconds"] = VLLM_BUCKETS["igserve_e2e_request_latency_seconds"]


def test_registry_holds_the_contract():
    families = {f.name: f for f in metrics.REGISTRY.collect()}
    for name, (kind, _) in CONTRACT.items():
        assert families[name].type == kind and families[name].documentation, name
    assert metrics.RATIO_BUCKETS == [round(0.05 * i, 2) for i in range(21)]
    assert metrics.RATIO_BUCKETS[0] == 0 and metrics.RATIO_BUCKETS[-1] == 1


def test_metrics_move_with_requests(live_server, tiny, tiny_bank):
    model = tiny.name
    client = live_server.client()
    before = live_server.metrics()
    jobs = [("code", False), ("math", True), ("dense", False), ("global", True), ("auto", False), ("auto", True)]
    served = []  # (mask, skip_ratio, compute_saved, prompt_tokens, completion_tokens, routed, cached_tokens)
    for i, (mask, stream) in enumerate(jobs):
        kwargs = dict(model=model, prompt=f"Request {i}: write a short poem about the sea", max_tokens=5 + i,
                      temperature=0, extra_body={"igserve": {"mask": mask}})
        if stream:
            chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
            info, usage = chunks[-1].igserve, chunks[-1].usage
        else:
            r = client.completions.create(**kwargs)
            info, usage = r.igserve, r.usage
        served.append((info["mask"], info["skip_ratio"], info["compute_saved"], usage.prompt_tokens,
                       usage.completion_tokens, mask == "auto", usage.prompt_tokens_details.cached_tokens))
    for bad in ({"temperature": -1}, {"n": 17}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt="x", **bad)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="wrong", max_retries=0).models.list()
    after = live_server.metrics()

    def delta(sample, **labels):
        labels["model_name"] = model
        return metric_value(after, sample, **labels) - metric_value(before, sample, **labels)

    n = len(jobs)
    outs = [c for *_, c, _, _ in served]
    assert sum(delta("igserve_request_success_total", finished_reason=r) for r in ("stop", "length", "abort")) == n
    assert delta("igserve_request_success_total", finished_reason="length") == n  # max_tokens reached
    for mask in {m for m, *_ in served}:
        assert delta("igserve_requests_by_mask_total", mask=mask) == sum(m == mask for m, *_ in served), mask
    # every prompt token is either prefilled or found in the prefix cache
    assert delta("igserve_prompt_tokens_total") == sum(p - hit for *_, p, _, _, hit in served)
    assert delta("igserve_prefix_cache_hit_tokens_total") == sum(hit for *_, hit in served)
    assert delta("igserve_generation_tokens_total") == sum(outs)
    for hist in ("igserve_e2e_request_latency_seconds", "igserve_time_to_first_token_seconds",
                 "igserve_request_queue_time_seconds", "igserve_skip_ratio", "igserve_compute_saved_ratio",
                 "igserve_request_time_per_output_token_seconds"):
        assert delta(hist + "_count") == n, hist
    assert delta("igserve_inter_token_latency_seconds_count") == sum(c - 1 for c in outs)
    assert delta("igserve_router_latency_seconds_count") == sum(routed for *_, routed, _ in served)
    assert delta("igserve_skip_ratio_sum") == pytest.approx(sum(s for _, s, *_ in served))
    assert delta("igserve_compute_saved_ratio_sum") == pytest.approx(sum(c for _, _, c, *_ in served))
    assert delta("igserve_e2e_request_latency_seconds_sum") > delta("igserve_time_to_first_token_seconds_sum") > 0
    # every token that went through the model (the prompt not in the prefix cache, and each output but the
    # last) ran each kept block
    for k, kind in enumerate(("attn", "ffn")):
        expected = sum(int(tiny_bank.mask(m)[k::2].sum()) * (p - hit + c - 1) for m, _, _, p, c, _, hit in served)
        assert delta("igserve_blocks_executed_total", kind=kind) == expected, kind
    assert delta("igserve_request_errors_total", error_type="invalid_request_error") == 2
    assert delta("igserve_request_errors_total", error_type="not_found_error") == 1
    assert delta("igserve_request_errors_total", error_type="authentication_error") == 1
    assert metric_value(after, "igserve_num_requests_running", model_name=model) == 0
    assert metric_value(after, "igserve_num_requests_waiting", model_name=model) == 0
    # contract: types, the model_name label on every series, bounded extra labels, the buckets
    for name, (kind, extra) in CONTRACT.items():
        family = after[name]
        assert family.type == kind, name
        assert family.samples, name
        for s in family.samples:
            assert set(s.labels) - {"le"} == {"model_name"} | extra, (name, s.labels)
    bank_ids = set(tiny_bank.all_mask_ids()) | set(routed_bank(tiny_bank)[0].all_mask_ids())  # every bank served here
    for mask in {s.labels["mask"] for s in after["igserve_requests_by_mask"].samples}:
        assert mask in bank_ids
    for name, buckets in {**VLLM_BUCKETS, "igserve_skip_ratio": metrics.RATIO_BUCKETS,
                          "igserve_compute_saved_ratio": metrics.RATIO_BUCKETS}.items():
        bounds = [float(s.labels["le"]) for s in after[name].samples
                  if s.name == name + "_bucket" and s.labels["model_name"] == model]
        assert bounds == [*buckets, float("inf")], name


def test_running_gauge_counts_a_request_in_flight(live_server, tiny):
    client = live_server.client()
    stream = client.completions.create(model=tiny.name, prompt="Once upon a time", max_tokens=200, temperature=0,
                                       stream=True, extra_body={"igserve": {"mask": "dense"}})
    try:
        next(iter(stream))
        assert metric_value(live_server.metrics(), "igserve_num_requests_running", model_name=tiny.name) == 1
    finally:
        stream.close()
