"""`/metrics` for day 3.5's server: vLLM's metric names and buckets through `prometheus_client` (provided).

Two sources: the engine's own state (`EngineStats`, one snapshot per engine turn, read at each scrape
by `EngineCollector`) and what the handlers measure where the client feels it (latencies, token
counts per request: `ServerMetrics`'s histograms). The names are vLLM's (v1) after a `tiny_llm:`
prefix instead of `vllm:`, every sample has a `model_name` label, and every histogram has vLLM's
buckets, so a vLLM dashboard carries over with one substitution.
"""

from __future__ import annotations

from typing import Callable

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "tiny_llm:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's request_params_n


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to `max_model_len`."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


# (kind, name, help, EngineStats attribute): the engine's gauges and counters.
ENGINE_FAMILIES = (
    (GaugeMetricFamily, "num_requests_running", "Requests holding KV blocks and generating.", "num_running"),
    (GaugeMetricFamily, "num_requests_waiting", "Requests waiting for admission.", "num_waiting"),
    (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", "kv_cache_usage"),
    (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    (CounterMetricFamily, "num_preemptions", "Preemptions (a sequence's blocks taken back).", "num_preemptions"),
    (CounterMetricFamily, "prompt_tokens", "Prompt tokens prefilled.", "prompt_tokens"),
    (CounterMetricFamily, "generation_tokens", "Tokens generated.", "generation_tokens"),
)


class EngineCollector:
    """The engine's gauges and counters, from the engine thread's last `EngineStats` at each scrape."""

    def __init__(self, stats: Callable[[], object], model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self):
        stats = self.stats()
        for family, name, help_text, attribute in ENGINE_FAMILIES:
            metric = family(PREFIX + name, help_text, labels=["model_name"])
            metric.add_metric([self.model_name], getattr(stats, attribute))
            yield metric


class ServerMetrics:
    """/metrics: the engine's snapshot (`EngineCollector`) and what the handlers measure per request."""

    def __init__(self, model_name: str, stats: Callable[[], object], max_model_len: int):
        self.registry = prometheus_client.CollectorRegistry()
        self.registry.register(EngineCollector(stats, model_name))
        self.model_name = model_name

        def histogram(name: str, help_text: str, buckets):
            return prometheus_client.Histogram(PREFIX + name, help_text, ["model_name"], buckets=buckets,
                                               registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "A request's decode time over its output tokens after the first.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time from reaching the engine to its first step.",
                               REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Time from the first step to the first token.",
                                 REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Time from the first token to the last.",
                                REQUEST_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "Time from the first step to the last token.",
                                   REQUEST_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of each finished request.", tokens)
        self.generation_tokens = histogram("request_generation_tokens", "Tokens generated for each finished request.",
                                           tokens)
        self.max_tokens = histogram("request_params_max_tokens", "Each request's max_tokens.", tokens)
        self.n = histogram("request_params_n", "Each HTTP request's n (choices per prompt).", N_BUCKETS)
        self.success = prometheus_client.Counter(PREFIX + "request_success", "Requests finished, by reason.",
                                                 ["model_name", "finished_reason"], registry=self.registry)

    def request_ended(self, reason: str, e2e: float, prompt_tokens: int, generation_tokens: int,
                      max_tokens: int) -> None:
        """One engine request's end, however it came (`reason`: a finish reason, "abort" included)."""
        self.success.labels(self.model_name, reason).inc()
        self.e2e.observe(e2e)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)
        self.max_tokens.observe(max_tokens)

    def phases(self, queued: float, scheduled: float, first_token: float | None, last_token: float | None,
               num_tokens: int) -> None:
        """vLLM's phases of a request that was scheduled: queued (until its first step), prefill (to its first
        token), decode (to its last), inference (prefill and decode), and its time per output token."""
        self.queue.observe(scheduled - queued)
        if first_token is None:
            return
        self.prefill.observe(max(0.0, first_token - scheduled))
        self.decode.observe(last_token - first_token)
        self.inference.observe(max(0.0, last_token - scheduled))
        if num_tokens > 1:
            self.tpot.observe((last_token - first_token) / (num_tokens - 1))

    def render(self) -> tuple[bytes, str]:
        return prometheus_client.generate_latest(self.registry), prometheus_client.CONTENT_TYPE_LATEST
