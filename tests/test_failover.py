"""Real failover: two igserve replicas behind a real nginx running deploy/nginx.conf (rendered for
loopback ports), one replica killed (SIGKILL) under load.

Every request whose response had not started when its replica died is retried by nginx on the
other replica and succeeds (non-streaming responses start only when complete, so only one killed
between writing its headers and its body can be lost, and nginx's log shows which); a stream cut
off mid-way ends with a clean error (an incomplete chunked body, never a hang or a fake success); a
real Prometheus scraping both replicas marks the killed one down. Skipped only when the `nginx` or
`prometheus` binary is absent (Debian packages; .ci/run installs both).
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import free_port, spawn_process, stop_process, wait_process
from tests.test_prometheus import PROMETHEUS, _wait, run_prometheus

ROOT = Path(__file__).resolve().parents[1]
NGINX = shutil.which("nginx")
LOG_FORMAT = "log_format failover '$status $request_time \"$upstream_addr\" \"$upstream_status\" $http_x_request_id';"

pytestmark = pytest.mark.skipif(NGINX is None or PROMETHEUS is None,
                                reason="needs the `nginx` and `prometheus` binaries (Debian packages; .ci/run "
                                       "installs them)")


def render_nginx(conf: str, upstreams: list[str], port: int, work: Path) -> str:
    """deploy/nginx.conf with its upstream servers, listen port, user and log paths set for a
    loopback test run; everything else (balancing, retries, streaming) as deployed."""
    servers = re.findall(r"^\s*server\s+[\w.-]+:\d+\s+([^;]*);", conf, flags=re.M)
    assert servers, "deploy/nginx.conf has no upstream servers"
    lines = "".join(f"        server {u} {servers[0]};\n" for u in upstreams)
    conf = re.sub(r"(^\s*server\s+[\w.-]+:\d+[^;]*;\n)+", lines, conf, count=1, flags=re.M)
    conf = re.sub(r"^\s*user\s+\S+;\n", "", conf, flags=re.M)
    conf = re.sub(r"listen\s+\d+;", f"listen 127.0.0.1:{port};", conf)
    conf = re.sub(r"error_log\s+\S+", f"error_log {work / 'error.log'}", conf)
    conf = re.sub(r"access_log\s+\S+;", f"{LOG_FORMAT}\n    access_log {work / 'access.log'} failover;", conf)
    temp = "".join(f"    {kind}_temp_path {work / kind};\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi",
                                                                              "scgi"))
    conf = conf.replace("http {\n", "http {\n" + temp, 1)
    return f"pid {work / 'nginx.pid'};\n" + conf


class Load:
    """Closed-loop clients through the balancer, one connection per request, until stopped."""

    def __init__(self, base: str, model: str):
        self.base, self.model = base, model
        self.stop = threading.Event()
        self.results: list[dict] = []
        self.lock = threading.Lock()

    def _record(self, **result):
        with self.lock:
            self.results.append(result)

    def plain(self):
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True}
        while not self.stop.is_set():
            t0, rid = time.monotonic(), uuid.uuid4().hex
            try:
                r = httpx.post(self.base + "/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=60)
                self._record(kind="plain", start=t0, end=time.monotonic(), status=r.status_code, id=rid,
                             tokens=r.json().get("usage", {}).get("completion_tokens"))
            except httpx.HTTPError as exc:
                self._record(kind="plain", start=t0, end=time.monotonic(), status=None, id=rid, error=repr(exc))

    def streaming(self):
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True,
                "stream": True}
        while not self.stop.is_set():
            t0, lines = time.monotonic(), []
            try:
                with httpx.stream("POST", self.base + "/v1/completions", json=body, timeout=60) as r:
                    lines = [line for line in r.iter_lines() if line.startswith("data:")]
                self._record(kind="stream", start=t0, end=time.monotonic(), status=r.status_code,
                             done=bool(lines) and lines[-1] == "data: [DONE]", error=None)
            except httpx.HTTPError as exc:
                self._record(kind="stream", start=t0, end=time.monotonic(), status=None, done=False, error=repr(exc))


def test_killing_a_replica_under_load(tiny_model_dir, tiny_bank_file, tmp_path, tiny):
    replicas = [spawn_process(tiny_model_dir, tiny_bank_file, "--max-batch", "4") for _ in range(2)]
    nginx = None
    try:
        for proc, base in replicas:
            wait_process(proc, base)
        hostports = [urlsplit(base).netloc for _, base in replicas]
        port = free_port()
        (tmp_path / "nginx.conf").write_text(render_nginx((ROOT / "deploy" / "nginx.conf").read_text(), hostports,
                                                          port, tmp_path))
        nginx = subprocess.Popen([NGINX, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-g",
                                  "daemon off;"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        balancer = f"http://127.0.0.1:{port}"
        _wait("nginx", lambda: (_up(balancer + "/health"), "not up"), timeout=20, interval=0.2)
        with run_prometheus(tmp_path / "prom", *hostports) as prom:
            _wait("both targets up", lambda: (_targets(prom) == {h: "up" for h in hostports}, _targets(prom)),
                  timeout=30)
            load = Load(balancer, tiny.name)
            workers = [threading.Thread(target=load.plain) for _ in range(6)]
            workers += [threading.Thread(target=load.streaming) for _ in range(3)]
            for w in workers:
                w.start()
            time.sleep(3)
            victim = replicas[0][0]
            victim.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            time.sleep(4)
            load.stop.set()
            for w in workers:
                w.join(timeout=60)
            assert not any(w.is_alive() for w in workers), "a client hung"
            _wait("the killed replica marked down", lambda: (_targets(prom).get(hostports[0]) == "down",
                                                              _targets(prom)), timeout=20)
            assert _targets(prom)[hostports[1]] == "up"
            assert prom.query(f'up{{instance="{hostports[0]}"}}')["result"][0]["value"][1] == "0"
    finally:
        if nginx is not None:
            nginx.terminate()
            nginx.wait(timeout=10)
        for proc, _ in replicas:
            stop_process(proc)

    plain = [r for r in load.results if r["kind"] == "plain"]
    streams = [r for r in load.results if r["kind"] == "stream"]
    assert len(plain) >= 6 and len(streams) >= 3
    log = (tmp_path / "access.log").read_text().splitlines()
    by_id = {line.rsplit(" ", 1)[-1]: line for line in log}
    failed = [(r["status"], r.get("error"), round(r["start"] - killed_at, 3), round(r["end"] - killed_at, 3),
               by_id.get(r["id"])) for r in plain if r["status"] != 200 or r["tokens"] != 16]
    # the one loss nginx cannot retry: the killed replica had sent the headers (nginx passed them on,
    # logging 200 from it alone), not the body; at most one request, cut off at the kill
    lost = [f for f in failed if f[0] is None and f[4] is not None and f[4].startswith("200 ")
            and f'"{hostports[0]}" "200"' in f[4] and f[2] < 0 < f[3] < 1.0]
    assert failed == lost and len(lost) <= 1, \
        f"(status, error, start and end against the kill (s), nginx's log line): {failed}"
    # nginx retried requests in flight on the killed replica: two upstreams, the first one failed
    retried = [line for line in log if ", " in line.split('"')[1]]
    assert retried and all(line.startswith("200 ") for line in retried), log[-20:]
    # streams: complete, or (in flight on the killed replica) ended with an error, never a 5xx body
    cut = [r for r in streams if not r["done"]]
    assert all(r["status"] in (200, None) for r in streams)
    assert len(cut) <= 3 and all(r["start"] < killed_at < r["end"] for r in cut), cut
    assert all(r["done"] for r in streams if r["start"] > killed_at + 0.5)


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _targets(prom) -> dict[str, str]:
    return {t["labels"]["instance"]: t["health"] for t in prom.targets()}
