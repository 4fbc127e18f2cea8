"""``GET /metrics``: the server in Prometheus' text format (docs/server.md, "Metrics").

Counters and histograms come from what the requests themselves measured: each
generation's final ``GenerationStats`` (tokens, time to first token, prompt
cache, speculation) and, for inter-token latency, the times its results reached
the server. Gauges (queue depth, busy rows, state and memory per model) are
read from the host when scraped. Every app has its own registry, so several
apps in one process (tests, a host embedding two servers) never mix counts.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, Summary, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from mlx_engine import GenerationResult, GenerationStats

logger = logging.getLogger(__name__)

__all__ = ["CONTENT_TYPE_LATEST", "Metrics", "RequestCounter", "label_request"]

# The model a request was served by, for the requests counter: the middleware
# puts a dict here, ``label_request`` (called by ModelHost.kit_for) fills it.
# A dict, not the value, so the handler's writes reach the middleware whatever
# context copies sit between them.
_REQUEST_LABELS: ContextVar[dict | None] = ContextVar("mlx_engine_request_labels", default=None)
MAX_POSITIONS = 32  # draft positions reported one by one; later ones are rare and would add series

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_LOAD_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def label_request(model: str) -> None:
    """Record that the current HTTP request is served by ``model``."""
    labels = _REQUEST_LABELS.get()
    if labels is not None:
        labels["model"] = model


class Metrics:
    """The app's metrics (one registry per app); ``host`` is read at scrape time."""

    def __init__(self, host):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "mlx_engine_requests",
            "HTTP requests by route, model and status",
            ["endpoint", "model", "status"],
            registry=r,
        )
        self.generations = Counter(
            "mlx_engine_generations", "Generations ended, by stop reason", ["model", "stop_reason"], registry=r
        )
        self.prompt_tokens = Counter("mlx_engine_prompt_tokens", "Prompt tokens of requests", ["model"], registry=r)
        self.generated_tokens = Counter("mlx_engine_generated_tokens", "Tokens generated", ["model"], registry=r)
        self.ttft = Histogram(
            "mlx_engine_time_to_first_token_seconds",
            "Time to first token per generation",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "mlx_engine_inter_token_latency_seconds",
            "Time between tokens of a generation",
            ["model"],
            buckets=_TOKEN_GAP_BUCKETS,
            registry=r,
        )
        self.cache_hits = Counter(
            "mlx_engine_prompt_cache_hits", "Requests that reused cached prompt tokens", ["model", "source"], registry=r
        )
        self.cache_tokens = Counter(
            "mlx_engine_prompt_cache_reused_tokens", "Prompt tokens reused from the cache", ["model"], registry=r
        )
        self._speculation(r)
        self._embeddings(r)
        self.loads = Counter("mlx_engine_model_loads", "Model loads by result", ["model", "result"], registry=r)
        self.unloads = Counter("mlx_engine_model_unloads", "Model unloads by reason", ["model", "reason"], registry=r)
        self.load_seconds = Histogram(
            "mlx_engine_model_load_seconds", "Time to load a model", ["model"], buckets=_LOAD_BUCKETS, registry=r
        )
        r.register(_HostCollector(host))

    def _speculation(self, r: CollectorRegistry) -> None:
        self.modes = Counter(
            "mlx_engine_decoding_mode", "Generations by the decoding mode chosen", ["model", "mode"], registry=r
        )
        self.switches = Counter(
            "mlx_engine_router_switches",
            "Mode switches of auto decoding",
            ["model", "from_mode", "to_mode"],
            registry=r,
        )
        self.drafted = Counter("mlx_engine_speculation_drafted_tokens", "Tokens drafted", ["model", "mode"], registry=r)
        self.accepted = Counter(
            "mlx_engine_speculation_accepted_tokens", "Drafted tokens accepted", ["model", "mode"], registry=r
        )
        self.rounds = Counter(
            "mlx_engine_speculation_verify_rounds", "Verification passes", ["model", "mode"], registry=r
        )
        self.by_position = Summary(
            "mlx_engine_speculation_acceptance_by_position",
            "Per generation, the share of drafts accepted at each draft position (sum/count: the mean)",
            ["model", "mode", "position"],
            registry=r,
        )

    def _embeddings(self, r: CollectorRegistry) -> None:
        self.embedding_inputs = Counter("mlx_engine_embedding_inputs", "Inputs embedded", ["model"], registry=r)
        self.embedding_tokens = Counter(
            "mlx_engine_embedding_tokens", "Tokens of the inputs embedded", ["model"], registry=r
        )
        self.embedding_seconds = Histogram(
            "mlx_engine_embedding_seconds",
            "Time to embed one request's inputs",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def embedded(self, model: str, inputs: int, tokens: int, seconds: float) -> None:
        """One ``/v1/embeddings`` request's inputs, tokens and embedding time."""
        self.embedding_inputs.labels(model).inc(inputs)
        self.embedding_tokens.labels(model).inc(tokens)
        self.embedding_seconds.labels(model).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def event(self, kind: str, model: str, **values) -> None:
        """The host's load and unload events (ModelHost.events)."""
        if kind == "load":
            self.loads.labels(model, "ok" if values["ok"] else "failed").inc()
            if values.get("seconds") is not None:
                self.load_seconds.labels(model).observe(values["seconds"])
        elif kind == "unload":
            self.unloads.labels(model, values["reason"]).inc()

    def observer(self, model: str) -> "RunObserver":
        return RunObserver(self, model)

    def final(self, model: str, index: int, s: GenerationStats, stop_reason: str | None) -> None:
        """One generation's final statistics. The prompt and its cache are
        counted for choice 0 only, as the request's usage counts them."""
        if index == 0:
            self.prompt_tokens.labels(model).inc(s.prompt_tokens)
            self.cache_tokens.labels(model).inc(s.cached_tokens)
            if s.cached_tokens:
                self.cache_hits.labels(model, s.cache_source).inc()
        self.generated_tokens.labels(model).inc(s.generated_tokens)
        self.generations.labels(model, stop_reason or "unknown").inc()
        self.ttft.labels(model).observe(s.time_to_first_token)
        self.modes.labels(model, s.decoding_mode).inc()
        for switch in s.mode_switches:  # "previous -> mode: why"
            moves, _, _ = switch.partition(":")
            before, _, after = moves.partition(" -> ")
            self.switches.labels(model, before.strip(), after.strip()).inc()
        if s.drafted_tokens or s.verify_rounds:
            mode = s.decoding_mode
            self.drafted.labels(model, mode).inc(s.drafted_tokens)
            self.accepted.labels(model, mode).inc(s.accepted_tokens)
            self.rounds.labels(model, mode).inc(s.verify_rounds)
            for i, rate in enumerate(s.acceptance_by_position[:MAX_POSITIONS]):
                self.by_position.labels(model, mode, str(i)).observe(rate)


class RunObserver:
    """Sees every result of one request's generations (on their pump threads):
    the gaps between tokens, and each generation's final statistics."""

    def __init__(self, metrics: Metrics, model: str):
        self.metrics, self.model = metrics, model
        self.last: dict[int, float] = {}  # choice -> when its last tokens arrived (each choice: one thread)

    def __call__(self, index: int, result: GenerationResult) -> None:
        try:
            self._see(index, result)
        except Exception:  # a metrics fault never ends a generation
            logger.exception("metrics: could not record a result of %s", self.model)

    def _see(self, index: int, result: GenerationResult) -> None:
        now, n = time.perf_counter(), len(result.tokens)
        if n:
            before = self.last.get(index)
            if before is not None:  # a chunk of n tokens (speculation): n gaps of equal share
                gap, itl = (now - before) / n, self.metrics.itl.labels(self.model)
                for _ in range(n):
                    itl.observe(gap)
            self.last[index] = now
        if result.stats is not None:
            reason = result.stop_condition.stop_reason if result.stop_condition is not None else None
            self.metrics.final(self.model, index, result.stats, reason)


class _HostCollector:
    """Gauges read from the host at scrape time."""

    def __init__(self, host):
        self.host = host

    def collect(self):
        queue_depth = GaugeMetricFamily("mlx_engine_queue_depth", "Requests waiting for rows", labels=["model"])
        busy = GaugeMetricFamily("mlx_engine_busy_rows", "Rows generating", labels=["model"])
        rows = GaugeMetricFamily("mlx_engine_rows", "Rows (parallel generations) of the model", labels=["model"])
        memory = GaugeMetricFamily("mlx_engine_model_memory_bytes", "Bytes a loaded model holds", labels=["model"])
        state = GaugeMetricFamily("mlx_engine_model_state", "1 for the model's state", labels=["model", "state"])
        for info in [self.host.describe(e) for e in list(self.host.entries.values())]:
            m, ext = info["id"], info["mlx_engine"]
            state.add_metric([m, info["state"]], 1)
            if info["state"] == "loaded":
                queue_depth.add_metric([m], ext["waiting"])
                busy.add_metric([m], ext["running"])
                rows.add_metric([m], ext["max_parallel"])
                memory.add_metric([m], ext["memory_bytes"])
        budget = GaugeMetricFamily("mlx_engine_memory_budget_bytes", "Memory budget for loaded models")
        budget.add_metric([], self.host.limits.budget)
        yield from (queue_depth, busy, rows, memory, state, budget)


class RequestCounter:
    """ASGI middleware counting requests by route template, model and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        labels: dict = {}
        token = _REQUEST_LABELS.set(labels)
        status = 500  # an exception before any answer

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            _REQUEST_LABELS.reset(token)
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"  # templates only: bounded label values
            self.metrics.requests.labels(endpoint, labels.get("model", ""), str(status)).inc()
