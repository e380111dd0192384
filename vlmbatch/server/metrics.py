"""``GET /metrics``: the server's state in Prometheus' text format, made by
``prometheus_client`` (one registry per server, so two servers in one process, as in
tests, never share a counter).

Requests are counted by the outermost middleware (``RequestMetrics``: so a 401 or a 413 is
counted too), by endpoint (the route's template, ``/v1/batches/{id}``: a bounded set of
labels whatever the paths asked for) and status, with their latency from the first byte
received to the last sent (a stream's whole life). Everything else is read when scraped
(``EngineCollector``): each engine's queue and the counters its engine thread sends with
every answer (summed over the engine processes, those that died included), the batches by
state (their records on disk), the engine restarts, and the media cache's hits, misses,
evictions and bytes held. The table is in ``docs/server.md``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vlmbatch.server.batches import BatchBook
from vlmbatch.server.media_cache import MediaCacheStats
from vlmbatch.serving.engines import Engines
from vlmbatch.serving.messages import Counters
from vlmbatch.serving.processes import add

if TYPE_CHECKING:
    from vlmbatch.server.ray_batches import RayBatches

STATES = ("validating", "in_progress", "finalizing", "completed", "failed", "cancelling",
          "cancelled")
# seconds: from a cached yes/no answer (~1 ms) to a long text or a queue behind a batch group
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
           30.0, 60.0)
ROUTES = [(re.compile(p), t) for p, t in [
    (r"^/v1/files/[^/]+/content$", "/v1/files/{id}/content"),
    (r"^/v1/files/[^/]+$", "/v1/files/{id}"),
    (r"^/v1/batches/[^/]+/cancel$", "/v1/batches/{id}/cancel"),
    (r"^/v1/batches/[^/]+$", "/v1/batches/{id}"),
    (r"^/v1/models/.+$", "/v1/models/{id}")]]
KNOWN = {"/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/embeddings",
         "/v1/files", "/v1/batches"}


def endpoint_of(path: str) -> str:
    """The route template of ``path`` (``other`` for a path no route has)."""
    if path in KNOWN:
        return path
    for pattern, template in ROUTES:
        if pattern.match(path):
            return template
    return "other"


class EngineCollector:
    """What the engines, the batch records, the media cache and the Ray runner say at
    scrape time."""

    def __init__(self, engines: Engines, book: BatchBook,
                 media: Callable[[], MediaCacheStats] | None = None) -> None:
        self.engines, self.book, self.media = engines, book, media
        self.ray: RayBatches | None = None

    def collect(self) -> Iterator[Metric]:
        views = self.engines.views()
        total = self.engines.base
        for v in views:
            total = add(total, v.stats)
        up = GaugeMetricFamily("vlmbatch_engine_up", "1 while the engine answers", labels=[
            "engine"])
        depth = GaugeMetricFamily("vlmbatch_queue_depth", "requests sent to an engine and not "
                                  "answered (interactive), batches it holds (batches)",
                                  labels=["engine", "queue"])
        for v in views:
            up.add_metric([str(v.index)], int(v.up))
            depth.add_metric([str(v.index), "interactive"], v.outstanding)
            depth.add_metric([str(v.index), "batches"], v.batches)
        yield up
        yield depth
        answered = CounterMetricFamily("vlmbatch_questions_answered", "questions answered "
                                       "(batch: results recorded, embedding inputs included)",
                                       labels=["source"])
        answered.add_metric(["interactive"], total.interactive)
        ray = self.ray.answered if self.ray is not None else 0
        answered.add_metric(["batch"], total.batch + ray)
        yield answered
        yield from self._tokens(total)
        yield CounterMetricFamily("vlmbatch_engine_calls", "engine calls of interactive "
                                  "requests", value=total.calls)
        yield CounterMetricFamily("vlmbatch_engine_restarts", "engine processes started again "
                                  "after one died", value=self.engines.restarts)
        if self.media is not None:
            yield from self._media(self.media())
        yield self._batches()

    def _media(self, m: MediaCacheStats) -> Iterator[Metric]:
        name = "vlmbatch_media_cache"
        yield CounterMetricFamily(f"{name}_hits", "chat requests whose image was served "
                                  "without decoding (cached, or decoded once for them all)",
                                  value=m.hits)
        yield CounterMetricFamily(f"{name}_misses", "chat requests that decoded their image",
                                  value=m.misses)
        yield CounterMetricFamily(f"{name}_evictions", "images dropped to stay within "
                                  "--media-cache-mib", value=m.evictions)
        yield GaugeMetricFamily(f"{name}_bytes", "bytes held: encoded images and their "
                                "prepared arrays", value=m.bytes)
        yield GaugeMetricFamily(f"{name}_images", "images held", value=m.entries)

    def _tokens(self, total: Counters) -> Iterator[Metric]:
        prompt, prefilled = total.prompt_tokens, total.prefill_tokens
        tokens = CounterMetricFamily("vlmbatch_prompt_tokens", "prompt tokens: computed "
                                     "(prefilled) or read from the prefix cache (cached)",
                                     labels=["kind"])
        tokens.add_metric(["prefilled"], prefilled)
        tokens.add_metric(["cached"], max(prompt - prefilled, 0))
        yield tokens
        yield GaugeMetricFamily("vlmbatch_prefix_cache_hit_rate", "cached / all prompt tokens "
                                "so far (0 before any)",
                                value=(prompt - prefilled) / prompt if prompt else 0.0)

    def _batches(self) -> Metric:
        counts = dict.fromkeys(STATES, 0)
        for rec in self.book.all():
            counts[rec.status] = counts.get(rec.status, 0) + 1
        g = GaugeMetricFamily("vlmbatch_batches", "batches by state", labels=["state"])
        for state, n in counts.items():
            g.add_metric([state], n)
        return g


class Metrics:
    """One server's registry: the request counters and the collector."""

    def __init__(self, engines: Engines, book: BatchBook,
                 media: Callable[[], MediaCacheStats] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("vlmbatch_requests", "HTTP requests answered, by endpoint and "
                                "status", ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("vlmbatch_request_duration_seconds", "HTTP request latency, "
                                 "first byte in to last byte out", ["endpoint"],
                                 buckets=BUCKETS, registry=self.registry)
        self.collector = EngineCollector(engines, book, media)
        self._children: dict[tuple[str, int], tuple[Any, Any]] = {}
        self.registry.register(self.collector)  # type: ignore[arg-type]

    def page(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def observe(self, path: str, status: int, seconds: float) -> None:
        key = (path, status)
        children = self._children.get(key)
        if children is None:  # the labelled series, looked up once per (path, status)
            endpoint = endpoint_of(path)
            children = (self.requests.labels(endpoint, str(status)),
                        self.latency.labels(endpoint))
            if len(self._children) < 4096:  # paths of unknown routes: bounded
                self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)


class RequestMetrics:
    """ASGI middleware (the outermost): each HTTP request's status and latency."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500  # unless a response starts

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            self.metrics.observe(scope["path"], status, time.perf_counter() - t0)
