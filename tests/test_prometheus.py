"""A real Prometheus scrapes a running igserve.

Starts the `prometheus` binary on 127.0.0.1 with the `igserve` job of deploy/prometheus.yml
(its target pointed at the test server, scrape interval 1s), sends traffic, then reads the
results back through Prometheus's HTTP API. Also evaluates every query of the Grafana dashboard
against that Prometheus, so a query that does not parse or names a wrong series fails here.
Skipped only when the binary is absent (Debian package `prometheus`, installed by .ci/run).
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
import shutil
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "igserve.json"
PROMETHEUS = shutil.which("prometheus")
N_REQUESTS = 3

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the `prometheus` binary is not on PATH (Debian package `prometheus`; .ci/run installs it)",
)

# Grafana's variables, replaced the way Grafana would for "All" over a short range.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "5m", "$__interval": "1s",
                "$job": ".*", "$instance": ".*", "$model_name": ".*"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, fn, timeout: float, interval: float = 0.5):
    """Poll fn() until it returns something truthy; fail with the last value seen."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last and last[0]:
            return last[1]
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last seen: {last and last[1]}")


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path):
        self.url, self.proc, self.log = url, proc, log
        self.http = httpx.Client(base_url=url, timeout=10)

    def query(self, promql: str) -> dict:
        r = self.http.get("/api/v1/query", params={"query": promql})
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{promql}: {r.status_code} {body}"
        return body["data"]

    def targets(self) -> list[dict]:
        return self.http.get("/api/v1/targets").json()["data"]["activeTargets"]


def prometheus_config(*server_hostports: str) -> dict:
    """deploy/prometheus.yml's igserve job, scraping the test servers every second."""
    deploy = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    job = copy.deepcopy(next(j for j in deploy["scrape_configs"] if j["job_name"] == "igserve"))
    job.pop("dns_sd_configs", None)  # compose service names; nothing to resolve here
    job["static_configs"] = [{"targets": list(server_hostports)}]
    job["scrape_interval"] = "1s"
    job["scrape_timeout"] = "1s"
    return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": [job]}


@pytest.fixture
def prometheus(tmp_path, live_server):
    with run_prometheus(tmp_path, urlsplit(live_server.base_url).netloc) as prom:
        yield prom


@contextmanager
def run_prometheus(tmp_path: Path, *hostports: str):
    """A real Prometheus scraping ``hostports`` every second, ready to query."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(*hostports)))
    port = _free_port()
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
    try:
        def ready():
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited with {proc.returncode}:\n{log.read_text()}")
            try:
                return (prom.http.get("/-/ready").status_code == 200, "not ready")
            except httpx.TransportError as exc:
                return (False, repr(exc))
        _wait("prometheus /-/ready", ready, timeout=30)
        yield prom
    finally:
        prom.http.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _send_traffic(live_server) -> None:
    headers = {"Authorization": f"Bearer {live_server.api_key}"} if live_server.api_key else {}
    with httpx.Client(base_url=live_server.base_url, headers=headers, timeout=120) as client:
        models = client.get("/v1/models")
        assert models.status_code == 200, models.text
        model = models.json()["data"][0]["id"]
        for i in range(N_REQUESTS):
            r = client.post("/v1/completions", json={
                "model": model, "prompt": f"Request {i}: the capital of France is",
                "max_tokens": 4, "temperature": 0, "igserve": {"mask": "auto"}})
            assert r.status_code == 200, r.text
            assert "skip_ratio" in r.json()["igserve"], r.json()
        # One streamed request too: TTFT and per-token histograms come from the streaming path.
        with client.stream("POST", "/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 4, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        assert lines and lines[-1].strip() == "data: [DONE]", lines


def test_prometheus_scrapes_igserve(prometheus, live_server):
    _send_traffic(live_server)

    def target_up():
        targets = prometheus.targets()
        return (any(t["health"] == "up" for t in targets), targets)
    _wait("the igserve target to be scraped", target_up, timeout=30)

    # Counts only grow, and the server may have served other tests before: >= N, not == N.
    def count(promql):
        def poll():
            data = prometheus.query(promql)
            value = float(data["result"][0]["value"][1]) if data["result"] else 0.0
            return (value >= N_REQUESTS, data)
        return poll
    _wait("igserve_skip_ratio_count", count('sum(igserve_skip_ratio_count{job="igserve"})'), timeout=30)
    _wait("igserve_request_success_total",
          count('sum(igserve_request_success_total{job="igserve"})'), timeout=30)

    series = prometheus.query("igserve_skip_ratio_count")["result"]
    assert series and all("model_name" in s["metric"] for s in series), series
    by_mask = prometheus.query("sum by (mask) (igserve_requests_by_mask_total)")["result"]
    assert by_mask and all(s["metric"].get("mask") for s in by_mask), by_mask
    assert sum(float(s["value"][1]) for s in by_mask) >= N_REQUESTS, by_mask


def _grafana_to_promql(expr: str) -> str:
    for var in sorted(GRAFANA_VARS, key=len, reverse=True):
        expr = expr.replace(var, GRAFANA_VARS[var])
    return expr


def test_dashboard_queries_evaluate(prometheus, live_server):
    """Every dashboard query is valid PromQL, and the core panels show data after traffic."""
    _send_traffic(live_server)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = {}
    stack = list(dashboard["panels"])
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []) or [])
        for target in panel.get("targets", []) or []:
            exprs[f"{panel['title']}/{target['refId']}"] = _grafana_to_promql(target["expr"])
    assert exprs
    for where, expr in exprs.items():
        assert prometheus.query(expr)["resultType"], where  # query() asserts status == success

    # Panels that must show data once requests were served (errors, aborts may stay empty).
    for metric in ("igserve_request_success_total", "igserve_generation_tokens_total",
                   "igserve_e2e_request_latency_seconds_bucket", "igserve_time_to_first_token_seconds_bucket",
                   "igserve_requests_by_mask_total", "igserve_skip_ratio_sum"):
        where, expr = next(((w, e) for w, e in exprs.items() if metric in e), (None, None))
        assert expr is not None, f"no dashboard query uses {metric}"
        _wait(f"data for dashboard query {where}: {expr}", _has_data(prometheus, expr), timeout=30)


def _has_data(prometheus: Prometheus, promql: str):
    def poll():
        data = prometheus.query(promql)
        return (bool(data["result"]), data)
    return poll


def test_promtool_accepts_deploy_config():
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing although prometheus is installed (both ship in Debian's `prometheus`)"
    result = subprocess.run([promtool, "check", "config", str(PROMETHEUS_CONFIG)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
