"""/metrics in Prometheus' text format, under vLLM's metric names with the prefix `qtk:` instead of
`vllm:` (a dashboard built for vLLM works after renaming the prefix).

    gauges      num_requests_running, num_requests_waiting, kv_cache_usage_perc   (read at scrape)
    counters    num_preemptions, prefix_cache_queries, prefix_cache_hits          (read at scrape)
                spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens,
                _num_accepted_tokens_per_pos{position}  (with speculative decoding; read at scrape)
                prompt_tokens, generation_tokens, request_success{finished_reason} (at each finish)
    histograms  time_to_first_token_seconds, inter_token_latency_seconds (= time_per_output_token),
                e2e_request_latency_seconds, request_queue_time_seconds            (at each finish)
The engine's own counters and gauges are read when Prometheus scrapes (a custom collector), so the
engine thread never waits on the metrics; the per-request figures come from RequestStats, which
AsyncLLM fills as outputs reach a request's stream. One registry per server, not the global one.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "qtk:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)


@dataclass
class RequestStats:
    """One request's clock, as its outputs arrive: arrival, first and latest token."""

    arrival: float = field(default_factory=time.monotonic)
    queued: bool = False  # the queue time is recorded
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        for name, doc, value in (("num_requests_running", "Sequences running (in the batch).", s.num_running),
                                 ("num_requests_waiting", "Sequences waiting for admission.", s.num_waiting),
                                 ("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
                                  s.kv_cache_usage)):
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        for name, doc, value in (("num_preemptions", "Preemptions (recompute).", s.num_preemptions),
                                 ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  s.prefix_cache_queries),
                                 ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        spec = s.spec_decode
        if spec is not None:  # speculative decoding (vLLM's spec_decode_* counters)
            for name, doc, value in (("spec_decode_num_drafts", "Steps of a sequence that verified drafts.",
                                      spec.num_drafts),
                                     ("spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens),
                                     ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                      spec.num_accepted_tokens)):
                yield CounterMetricFamily(PREFIX + name, doc, value=value)
            per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted at each position of the drafts.", labels=["position"])
            for position, value in enumerate(spec.accepted_per_pos):
                per_pos.add_metric([str(position)], value)
            yield per_pos


class Metrics:
    def __init__(self, engine):
        """engine: an AsyncLLM (its stats() are read at each scrape)."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", registry=r)
        self.success = Counter(PREFIX + "request_success", "Finished requests by reason.", ["finished_reason"],
                               registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Mean time per output token after the first.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish.", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to first scheduled step.",
                               buckets=LATENCY_BUCKETS, registry=r)

    def observer(self):
        """A new request's observer (AsyncLLM calls it with each output that reaches its stream)."""
        return functools.partial(self.on_output, RequestStats())

    def on_output(self, stats: RequestStats, out) -> None:
        """An output reached the request's stream: new tokens (inter-token latency), maybe its end."""
        now = time.monotonic()
        if not stats.queued and out.queue_time is not None:
            stats.queued = True
            self.queue.observe(out.queue_time)
        tokens = sum(len(c.token_ids) for c in out.outputs)
        new = tokens - stats.tokens
        if new > 0:
            if stats.first_token is None:
                stats.first_token = now
                self.ttft.observe(now - stats.arrival)
            else:
                for _ in range(new):
                    self.itl.observe((now - stats.last_token) / new)
            stats.last_token, stats.tokens = now, tokens
        if out.finished:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.generation_tokens.inc(tokens)
            for c in out.outputs:
                self.success.labels(finished_reason=c.finish_reason).inc()
            self.e2e.observe(now - stats.arrival)
            if stats.first_token is not None and tokens > 1:
                self.tpot.observe((now - stats.first_token) / (tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
