"""Prometheus metrics of one daemon, in a registry owned by its app (no global registry).

Names are vLLM's (``vllm:*``), so the Gateway API Inference Extension's endpoint picker,
production-stack dashboards and existing alerts read a pagefleet pod as they read a vLLM
pod; what vLLM has no name for is ``pagefleet:*``. docs/metrics.md lists every series.
Labels: ``model_name`` (vLLM's label), ``role`` and ``pod``.

Invariant: per-request series (histograms, finish reasons) are observed once per finished
request by the HTTP layer; engine-wide counters and gauges are read from the latest
``EngineStats`` snapshot at scrape time, so they never drift from the engine's own counts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagefleet.api.cost import cost_per_million_tokens
from pagefleet.engine.outputs import RequestMetrics

LABELS = ("model_name", "role", "pod")

# Seconds. Dense below one second where CPU and GPU serving both live, sparse above.
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# Token counts per request, 1-2-5 steps as vLLM's (its dashboards' heatmaps read these edges).
_COUNT_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))


class _EngineStatsCollector(Collector):
    """Exports the latest EngineStats snapshot; aliases keep older vLLM names working."""

    def __init__(self, owner: DaemonMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        stats = self._owner.latest_stats
        values = self._owner.label_values
        if stats is None:
            return

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(values, value)
            return c

        yield gauge(
            "vllm:num_requests_running", "Requests in the running batch.", stats.num_running
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Requests admitted by the engine and waiting to be scheduled (incl. preempted).",
            stats.num_waiting,
        )
        usage = float(stats.kv_usage)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0-1 (blocks in use).", usage)
        yield gauge("vllm:gpu_cache_usage_perc", "Alias of vllm:kv_cache_usage_perc.", usage)
        yield gauge("pagefleet:kv_cache_num_blocks", "KV blocks in the pool.", stats.num_blocks)
        yield gauge(
            "pagefleet:kv_cache_free_blocks",
            "KV blocks free or cached-but-unreferenced.",
            stats.num_free_blocks,
        )
        yield counter(
            "vllm:prompt_tokens", "Prompt tokens processed (prefill).", stats.prompt_tokens_total
        )
        yield counter("vllm:generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        for prefix in ("vllm:prefix_cache", "vllm:gpu_prefix_cache"):
            yield counter(
                f"{prefix}_queries",
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_queries_tokens,
            )
            yield counter(
                f"{prefix}_hits",
                "Prompt tokens served from the prefix cache.",
                stats.prefix_hits_tokens,
            )
        yield counter(
            "vllm:num_preemptions", "Requests preempted (recompute).", stats.num_preempted_total
        )
        yield counter(
            "pagefleet:kv_cache_evictions", "Cached blocks evicted (LRU).", stats.evictions_total
        )
        yield counter("pagefleet:engine_steps", "Engine steps run.", stats.steps_total)
        yield from self._cost(gauge, counter, stats)
        # Info series the GIE endpoint picker reads: block size (prefix-cache scorer) and the
        # LoRA adapters (none yet; the value is a timestamp, as vLLM's is).
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "KV-cache configuration.",
            labels=[*LABELS, "block_size", "num_gpu_blocks"],
        )
        info.add_metric([*values, str(self._owner.block_size), str(stats.num_blocks)], 1.0)
        yield info
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running and waiting LoRA adapters (none are served yet).",
            labels=[*LABELS, "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        lora.add_metric([*values, "0", "", ""], time.time())
        yield lora

    def _cost(self, gauge: Any, counter: Any, stats: Any) -> Iterator[Metric]:
        """Cost per 1M tokens since start (api/cost.py), and the dollars spent as a
        counter, so PromQL can price any window: rate(cost) / rate(tokens) * 1e6."""
        per_hour = self._owner.cost_per_hour
        if per_hour <= 0:
            return
        up = time.monotonic() - self._owner.started
        yield gauge("pagefleet:cost_per_hour_dollars", "Configured replica price.", per_hour)
        yield counter("pagefleet:cost_dollars", "Replica cost since start.", per_hour * up / 3600)
        for kind, tokens in (
            ("input", stats.prompt_tokens_total),
            ("output", stats.generation_tokens_total),
        ):
            price = cost_per_million_tokens(per_hour, up, tokens)
            if price is not None:
                yield gauge(
                    f"pagefleet:cost_per_million_{kind}_tokens_dollars",
                    f"Replica cost since start per 1M {kind} tokens it served.",
                    price,
                )


class _Fanout:
    """Histogram children fed the same observations: a vLLM name and its older alias."""

    __slots__ = ("_children",)

    def __init__(self, *children: Any) -> None:
        self._children = children

    def observe(self, value: float) -> None:
        for child in self._children:
            child.observe(value)


class DaemonMetrics:
    """Every metric of one daemon, bound to its labels, in ``self.registry``."""

    def __init__(
        self,
        model_name: str,
        role: str,
        pod: str,
        block_size: int = 16,
        cost_per_hour: float = 0.0,
    ) -> None:
        self.registry = CollectorRegistry()
        self.cost_per_hour = cost_per_hour
        self.started = time.monotonic()
        self.block_size = block_size
        self.label_values = [model_name, role, pod]
        self.latest_stats: Any = None
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(
                *self.label_values
            )

        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Time to first token: arrival to first generated token.",
            _LATENCY_BUCKETS,
        )
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Time per output token after the first, per request (decode time / (tokens-1)).",
            _TOKEN_BUCKETS,
        )
        # vLLM (< 0.11, and dashboards built on it) named this vllm:time_per_output_token_seconds
        # and observed the same per-token gaps under both names; the alias keeps those working.
        self.itl = _Fanout(
            hist(
                "vllm:inter_token_latency_seconds",
                "Time between consecutive tokens of a sequence.",
                _TOKEN_BUCKETS,
            ),
            hist(
                "vllm:time_per_output_token_seconds",
                "Alias of vllm:inter_token_latency_seconds (older vLLM name).",
                _TOKEN_BUCKETS,
            ),
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency inside the engine: arrival to finish.",
            _LATENCY_BUCKETS,
        )
        self.queue_time = hist(
            "vllm:request_queue_time_seconds",
            "Time from arrival to first scheduled.",
            _LATENCY_BUCKETS,
        )
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds",
            "Time from first scheduled to first token (prefill, incl. chunking).",
            _LATENCY_BUCKETS,
        )
        self.inference_time = hist(
            "vllm:request_inference_time_seconds",
            "Time from first scheduled to finish (prefill and decode, as vLLM's RUNNING phase).",
            _LATENCY_BUCKETS,
        )
        self.decode_time = hist(
            "vllm:request_decode_time_seconds",
            "Time from first token to last token.",
            _LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = hist(
            "vllm:request_prompt_tokens",
            "Prompt length of each finished request (per prompt), in tokens.",
            _COUNT_BUCKETS,
        )
        self.request_generation_tokens = hist(
            "vllm:request_generation_tokens",
            "Tokens generated by each finished sequence.",
            _COUNT_BUCKETS,
        )
        self._success = Counter(
            "vllm:request_success",
            "Finished sequences by finish reason (stop, length, abort).",
            [*LABELS, "finished_reason"],
            registry=r,
        )
        self._rejected = Counter(
            "pagefleet:requests_rejected",
            "Requests refused before admission, by reason (queue_full, draining, invalid, "
            "body_budget).",
            [*LABELS, "reason"],
            registry=r,
        )
        self._client_cuts = Counter(
            "pagefleet:client_cuts",
            "Clients cut for not reading, their requests aborted, by reason (write_timeout: "
            "a write waited --client-write-timeout; backlog: a stream fell "
            "--max-stream-backlog-mb behind).",
            [*LABELS, "reason"],
            registry=r,
        )
        self.inflight = Gauge(
            "pagefleet:http_requests_inflight",
            "HTTP generation requests being served (admitted, not yet answered).",
            LABELS,
            registry=r,
        ).labels(*self.label_values)
        self.kv_events_published = Counter(
            "pagefleet:kv_events_published",
            "KV events applied to the global prefix index.",
            LABELS,
            registry=r,
        ).labels(*self.label_values)
        self.index_up = Gauge(
            "pagefleet:kv_index_up",
            "1 while the prefix index is reachable and in sync, else 0.",
            LABELS,
            registry=r,
        ).labels(*self.label_values)
        self.index_resyncs = Counter(
            "pagefleet:kv_index_resyncs",
            "Full block-set resynchronisations sent to the prefix index.",
            LABELS,
            registry=r,
        ).labels(*self.label_values)
        r.register(_EngineStatsCollector(self))

    def update_stats(self, stats: Any) -> None:
        """Remember the latest EngineStats (called on the event loop after each step)."""
        self.latest_stats = stats

    def finished(self, reason: str | None) -> None:
        self._success.labels(*self.label_values, reason or "unknown").inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(*self.label_values, reason).inc()

    def client_cut(self, reason: str) -> None:
        """One client cut (``write_timeout`` or ``backlog``): called once per cut."""
        self._client_cuts.labels(*self.label_values, reason).inc()

    def observe_request(self, m: RequestMetrics, num_output_tokens: int) -> None:
        """Latency histograms of one finished request, from the engine's own timestamps."""
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            if m.first_token_time is not None:
                self.prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        if m.first_token_time is not None and m.last_token_time is not None:
            decode = max(0.0, m.last_token_time - m.first_token_time)
            self.decode_time.observe(decode)
            if num_output_tokens > 1:
                self.tpot.observe(decode / (num_output_tokens - 1))
        if m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
            if m.first_scheduled_time is not None:
                self.inference_time.observe(max(0.0, m.finished_time - m.first_scheduled_time))

    def render(self) -> bytes:
        return generate_latest(self.registry)
