"""Prometheus metrics, ``igserve_`` prefix, label ``model_name``.

Names and buckets follow vLLM's (``vllm:`` -> ``igserve_``) where the meaning is the same, so
dashboards written for vLLM carry over. Label values are bounded: mask ids come from the bank,
finish reasons and error types from fixed sets, never from the client.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from server.engine import Request, StepOutput

REGISTRY = CollectorRegistry()
LABEL = "model_name"

# vLLM's boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]
# igserve's own.
ROUTER_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
RATIO_BUCKETS = [round(0.05 * i, 2) for i in range(21)]  # 0, 0.05, ..., 1


def _histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
    return Histogram(name, doc, [LABEL], buckets=buckets, registry=REGISTRY)


def _counter(name: str, doc: str, *labels: str) -> Counter:
    return Counter(name, doc, [LABEL, *labels], registry=REGISTRY)


def _gauge(name: str, doc: str) -> Gauge:
    return Gauge(name, doc, [LABEL], registry=REGISTRY)


E2E_LATENCY = _histogram("igserve_e2e_request_latency_seconds",
                         "End-to-end request latency in seconds (arrival to last token).", REQUEST_LATENCY_BUCKETS)
TTFT = _histogram("igserve_time_to_first_token_seconds",
                  "Time to first token in seconds (arrival, routing included, to first token).", TTFT_BUCKETS)
INTER_TOKEN_LATENCY = _histogram("igserve_inter_token_latency_seconds",
                                 "Time between consecutive output tokens of a request in seconds.",
                                 TOKEN_LATENCY_BUCKETS)
TIME_PER_OUTPUT_TOKEN = _histogram("igserve_request_time_per_output_token_seconds",
                                   "Mean time per output token after the first, per request, in seconds.",
                                   TOKEN_LATENCY_BUCKETS)
QUEUE_TIME = _histogram("igserve_request_queue_time_seconds",
                        "Time a request waited for a batch slot in seconds.", REQUEST_LATENCY_BUCKETS)
ROUTER_LATENCY = _histogram("igserve_router_latency_seconds",
                            "Time spent choosing a mask (encoder + nearest centroid) in seconds.", ROUTER_BUCKETS)
SKIP_RATIO = _histogram("igserve_skip_ratio", "Fraction of blocks the request's mask skips.", RATIO_BUCKETS)
COMPUTE_SAVED = _histogram("igserve_compute_saved_ratio",
                           "Fraction of parameters per token the request's mask does not touch.", RATIO_BUCKETS)

REQUEST_SUCCESS = _counter("igserve_request_success", "Finished requests by finish reason (stop|length|abort).",
                           "finished_reason")
REQUESTS_BY_MASK = _counter("igserve_requests_by_mask", "Admitted requests by the mask they run with.", "mask")
ROUTER_FALLBACKS = _counter("igserve_router_fallbacks", "Routed requests that were out of distribution and took "
                            "the budget's global mask.")
REQUESTS_BY_BUDGET = _counter("igserve_requests_by_budget", "Routed requests by the budget (sparsity) of their mask.",
                              "budget")
REQUEST_ERRORS = _counter("igserve_request_errors", "Error responses by OpenAI error type.", "error_type")
DRAIN_CUT = _counter("igserve_drain_timeout_requests", "Requests still in flight at the drain timeout on shutdown, "
                     "ended with an error.")
PROMPT_TOKENS = _counter("igserve_prompt_tokens", "Prefilled prompt tokens (the choices of one prompt prefill it once; "
                         "prefix-cache hits are not prefilled).")
PREFIX_HITS = _counter("igserve_prefix_cache_hit_tokens", "Prompt tokens whose K/V a slot still held under the "
                       "request's mask (prefix cache), so they were not prefilled.")
GENERATION_TOKENS = _counter("igserve_generation_tokens", "Generated tokens.")
ADAPTIVE_DEPTH = _counter("igserve_adaptive_depth_requests", "Routed requests that load-adaptive depth admitted at "
                          "a sparser budget than the default (--adaptive-depth).")
BLOCKS_EXECUTED = _counter("igserve_blocks_executed", "Block executions (one block on one token) by kind.", "kind")

NUM_RUNNING = _gauge("igserve_num_requests_running", "Requests in a batch slot.")
NUM_WAITING = _gauge("igserve_num_requests_waiting", "Requests waiting for a batch slot.")


def count_error(model_name: str, error_type: str) -> None:
    """One error response (from the event loop; also while the model is still loading)."""
    REQUEST_ERRORS.labels(model_name, error_type).inc()


class ServingMetrics:
    """The metrics of one served model, observed on the engine thread. ``mask_costs``: mask id ->
    (skip ratio, compute saved), observed once per request when it is prefilled."""

    def __init__(self, model_name: str, mask_costs: dict[str, tuple[float, float]]):
        self.model_name = model_name
        self.mask_costs = mask_costs
        self.e2e = E2E_LATENCY.labels(model_name)
        self.ttft = TTFT.labels(model_name)
        self.itl = INTER_TOKEN_LATENCY.labels(model_name)
        self.tpot = TIME_PER_OUTPUT_TOKEN.labels(model_name)
        self.queue = QUEUE_TIME.labels(model_name)
        self.router = ROUTER_LATENCY.labels(model_name)
        self.skip = SKIP_RATIO.labels(model_name)
        self.saved = COMPUTE_SAVED.labels(model_name)
        self.prompt_tokens = PROMPT_TOKENS.labels(model_name)
        self.prefix_hits = PREFIX_HITS.labels(model_name)
        self.generation_tokens = GENERATION_TOKENS.labels(model_name)
        self.blocks = [BLOCKS_EXECUTED.labels(model_name, kind) for kind in ("attn", "ffn")]
        self.running = NUM_RUNNING.labels(model_name)
        self.waiting = NUM_WAITING.labels(model_name)
        self._queued: dict[str, float] = {}  # request id -> time it entered the engine's queue
        self._last_token: dict[str, float] = {}

    def queue_sizes(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def _scheduled(self, req: Request) -> None:
        REQUESTS_BY_MASK.labels(self.model_name, req.mask_id).inc()
        skip_ratio, compute_saved = self.mask_costs[req.mask_id]
        self.skip.observe(skip_ratio)
        self.saved.observe(compute_saved)
        if req.route is not None:
            if req.route.by_router:  # a mask bound without the router took no routing time
                self.router.observe(req.route.router_ms / 1000)
            REQUESTS_BY_BUDGET.labels(self.model_name, f"{req.route.budget:g}").inc()
            if req.route.fallback:
                ROUTER_FALLBACKS.labels(self.model_name).inc()
            if req.adapted:
                ADAPTIVE_DEPTH.labels(self.model_name).inc()

    def drain_cut(self, n: int) -> None:
        if n:
            DRAIN_CUT.labels(self.model_name).inc(n)

    def queued(self, req: Request, now: float) -> None:
        """The request entered the engine's waiting queue."""
        self._queued[req.request_id] = now

    def step(self, outputs: list[StepOutput], blocks: list[int], now: float) -> None:
        """One engine step: its outputs and the block executions it added [attn, ffn]."""
        for counter, n in zip(self.blocks, blocks):
            if n:
                counter.inc(n)
        for out in outputs:
            req = out.request
            if out.error is not None:  # failed in the engine: the API counts the error it answers
                self.finished(req, now)
                continue
            self.generation_tokens.inc(len(out.new_token_ids))
            last = self._last_token.get(req.request_id)
            if last is None:  # this step prefilled the request
                self._scheduled(req)
                self.prompt_tokens.inc(len(req.prompt_ids) - req.num_shared - req.num_cached)
                self.prefix_hits.inc(req.num_cached)
                if req.first_token_time is not None:  # None: scored only (max_tokens 0), no token
                    self.ttft.observe(req.first_token_time - req.arrival)
                self.queue.observe(req.scheduled_time - self._queued.pop(req.request_id))
            else:
                self.itl.observe(now - last)
            self._last_token[req.request_id] = now
            if out.finished:
                self.finished(req, now)

    def finished(self, req: Request, now: float) -> None:
        """A request left the engine: done, or aborted (``finish_reason == "abort"``)."""
        self._queued.pop(req.request_id, None)
        self._last_token.pop(req.request_id, None)
        if req.finish_reason == "error":
            return
        REQUEST_SUCCESS.labels(self.model_name, req.finish_reason).inc()
        self.e2e.observe(now - req.arrival)
        if len(req.output_ids) > 1 and req.first_token_time is not None:
            self.tpot.observe((now - req.first_token_time) / (len(req.output_ids) - 1))
