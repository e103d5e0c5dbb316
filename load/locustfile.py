"""Locust load test for igserve's OpenAI-compatible streaming chat endpoint.

One user class, two tagged tasks:
  * ``ig``    -- input-guided routing (``"igserve": {"mask": "auto"}``)
  * ``dense`` -- forced dense model (``"igserve": {"mask": "dense"}``)
Run both (the default, 50/50) or pick one with ``--tags ig`` / ``--tags dense``.

Besides the end-to-end request (type ``CHAT``), every streamed request reports two custom
metrics through ``events.request.fire`` so they land in the stats, the CSV files and the web UI:
  * ``TTFT`` -- time to first token (ms): request sent -> first chunk with content
  * ``TPOT`` -- time per output token (ms): (last token - first token) / (tokens - 1)
Each is named by variant (``ig`` / ``dense``). With ``--csv PREFIX`` the masks the server chose
are also written to ``PREFIX_masks.json``.

Example (against a server already listening on 127.0.0.1:8000):
  locust -f load/locustfile.py --headless -u 4 -r 1 -t 60s \
      --host http://127.0.0.1:8000 --csv bench/results/locust --tags ig
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import time
from pathlib import Path

from locust import User, between, events, tag, task
from openai import OpenAI

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"
DEFAULT_MODEL = "smollm2-135m-instruct"
VARIANT_MASK = {"ig": "auto", "dense": "dense"}

log = logging.getLogger("igserve.load")
# The OpenAI SDK's HTTP client logs every request at INFO; keep the locust output readable.
for _name in ("httpx", "httpx2", "openai"):
    logging.getLogger(_name).setLevel(logging.WARNING)

# variant -> mask id -> count (mask ids as reported by the server in the `igserve` object)
MASKS_SEEN: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def load_prompts(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL file of ``{"domain": str, "prompt": str}`` objects."""
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            item = json.loads(line)
            if not isinstance(item.get("domain"), str) or not isinstance(item.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: expected {{'domain': str, 'prompt': str}}")
            items.append(item)
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


@events.init_command_line_parser.add_listener
def _add_arguments(parser):
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), env_var="IGSERVE_PROMPTS",
                        help="JSONL file of {domain, prompt} objects (default: load/prompts.jsonl)")
    parser.add_argument("--model-name", default=DEFAULT_MODEL, env_var="IGSERVE_MODEL",
                        help=f"model field sent in requests (default: {DEFAULT_MODEL})")
    parser.add_argument("--api-key", default="", env_var="IGSERVE_API_KEY", is_secret=True,
                        help="API key, if the server was started with --api-key")
    parser.add_argument("--max-tokens", type=int, default=32, env_var="IGSERVE_MAX_TOKENS",
                        help="max_tokens per request (default: 32)")
    parser.add_argument("--request-timeout", type=float, default=300.0,
                        help="client timeout per request in seconds (default: 300)")


def _option(environment, name, default):
    opts = getattr(environment, "parsed_options", None)
    value = getattr(opts, name, None) if opts is not None else None
    return default if value in (None, "") else value


@events.test_stop.add_listener
def _report_masks(environment, **_kwargs):
    if not MASKS_SEEN:
        return
    summary = {variant: dict(counts.most_common()) for variant, counts in MASKS_SEEN.items()}
    log.info("masks chosen by the server: %s", json.dumps(summary, sort_keys=True))
    prefix = _option(environment, "csv_prefix", None)
    if prefix:
        with open(f"{prefix}_masks.json", "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, sort_keys=True)


class IgserveChatUser(User):
    """Streams chat completions from igserve, one mixed-domain prompt per request."""

    host = "http://127.0.0.1:8000"
    wait_time = between(0.1, 1.0)

    def on_start(self):
        env = self.environment
        self.model = _option(env, "model_name", DEFAULT_MODEL)
        self.max_tokens = int(_option(env, "max_tokens", 32))
        self.prompts = load_prompts(_option(env, "prompts", str(DEFAULT_PROMPTS)))
        self.client = OpenAI(
            base_url=self.host.rstrip("/") + "/v1",
            api_key=_option(env, "api_key", "") or "EMPTY",
            max_retries=0,  # a 429/503 must show up as a failure, not be hidden by retries
            timeout=float(_option(env, "request_timeout", 300.0)),
        )

    def on_stop(self):
        self.client.close()

    @tag("ig")
    @task
    def chat_ig(self):
        self._stream_chat("ig")

    @tag("dense")
    @task
    def chat_dense(self):
        self._stream_chat("dense")

    def _stream_chat(self, variant: str) -> None:
        item = random.choice(self.prompts)
        context = {"variant": variant, "domain": item["domain"]}
        start = time.perf_counter()
        seen, error = _Streamed(), None
        try:
            stream = self.client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": item["prompt"]}],
                max_tokens=self.max_tokens,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"igserve": {"mask": VARIANT_MASK[variant]}},
            )
            with stream:
                for chunk in stream:
                    seen.add(chunk, time.perf_counter())
        except Exception as exc:  # noqa: BLE001 -- every failure is reported to locust
            error = exc
        end = time.perf_counter()
        error = error or seen.error(variant)
        events.request.fire(
            request_type="CHAT",
            name=f"/v1/chat/completions [{variant}]",
            response_time=(end - start) * 1000.0,
            response_length=seen.tokens,
            response=None,
            context=context,
            exception=error,
        )
        if error is None:
            MASKS_SEEN[variant][seen.mask] += 1
            seen.fire_latencies(variant, start, context)


class _Streamed:
    """What one stream's chunks said: when content arrived, the usage, the mask the server chose."""

    def __init__(self):
        self.first = self.last = None
        self.content_chunks = 0
        self.usage_tokens = None
        self.mask = None

    def add(self, chunk, now: float) -> None:
        ig = getattr(chunk, "igserve", None)
        if isinstance(ig, dict) and ig.get("mask") is not None:
            self.mask = str(ig["mask"])
        if getattr(chunk, "usage", None) is not None:
            self.usage_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta is not None and choice.delta.content:
                self.content_chunks += 1
                if self.first is None:
                    self.first = now
                self.last = now

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.content_chunks

    def error(self, variant: str) -> Exception | None:
        """A stream that worked but did not say what was asked."""
        if self.mask is None:
            return RuntimeError("response carried no igserve.mask")
        if variant == "dense" and self.mask != "dense":
            return RuntimeError(f"dense request was served with mask {self.mask!r}")
        return None

    def fire_latencies(self, variant: str, start: float, context: dict) -> None:
        """TTFT and TPOT as custom locust requests."""
        if self.first is not None:
            events.request.fire(request_type="TTFT", name=variant,
                                response_time=(self.first - start) * 1000.0, response_length=0,
                                response=None, context=context, exception=None)
        if self.first is not None and self.tokens > 1:
            events.request.fire(request_type="TPOT", name=variant,
                                response_time=(self.last - self.first) * 1000.0 / (self.tokens - 1),
                                response_length=0, response=None, context=context, exception=None)
