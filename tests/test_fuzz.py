"""Schemathesis fuzzes every operation of /openapi.json on a live tiny-model server: no input may
give a 5xx or hang. Bounded for CI (examples per operation below, 60 s per request); for a longer
run: IGSERVE_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz.py."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.conftest import TEST_API_KEY, metric_value

EXAMPLES = int(os.environ.get("IGSERVE_FUZZ_EXAMPLES", "40"))


# Dropped from random bodies: random n x prompts mostly exceed the server's capacity (a 400), and
# random schemas mostly fail to compile (a 400); either way few examples would reach the engine.
PENDING = ("n", "best_of", "response_format")


def steer(body: dict, model: str) -> None:
    """Past the checks that refuse nearly every random body (the model name, a mask id of the
    bank), so that many examples reach the engine; every other field stays as generated."""
    body["model"] = model
    for field in PENDING:
        body.pop(field, None)
    if "igserve" in body:
        body["igserve"] = {"mask": "auto"}


OPERATIONS = ["GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions", "GET /health", "GET /metrics"]


@pytest.mark.parametrize("operation", OPERATIONS)
def test_no_input_gives_a_server_error(live_server, tiny, operation):
    api = schemathesis.openapi.from_url(live_server.base_url + "/openapi.json")
    method, path = operation.split()
    strategy = api[path][method].as_strategy()
    auth = {"Authorization": f"Bearer {TEST_API_KEY}"}

    @given(case=strategy)
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def fuzz(case):
        if isinstance(case.body, dict) and "model" in case.body:
            steer(case.body, tiny.name)
        r = case.call_and_validate(base_url=live_server.base_url, headers=auth, checks=[not_a_server_error],
                                   timeout=60)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

    statuses = {}
    before = metric_value(live_server.metrics(), "igserve_request_success_total")
    fuzz()
    if method == "POST":  # some examples were valid requests that ran in the engine
        assert metric_value(live_server.metrics(), "igserve_request_success_total") > before, statuses


def test_the_schema_lists_every_route(live_server):
    import httpx

    paths = httpx.get(live_server.base_url + "/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(paths)
    body = paths["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    docs = httpx.get(live_server.base_url + "/docs")
    assert docs.status_code == 200 and "/docs/static/swagger-ui-bundle.js" in docs.text
    assert httpx.get(live_server.base_url + "/docs/static/swagger-ui-bundle.js").status_code == 200  # no CDN
