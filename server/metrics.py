"""`/metrics`: the wrapper's series in Prometheus text format (prometheus-client), vLLM's own appended.

The wrapper's series (each app has a registry of its own: replicas in one process, and tests, share nothing):

  edge_plans_served_total{endpoint}              plans answered (a batch counts each device it planned)
  edge_plan_request_duration_seconds{endpoint}   how long an answered planning request took (histogram)
  edge_planning_errors_total{kind}               planning requests, or batch devices, refused: input (a device
                                                 or model the planner refused, 422), request (a body the schema
                                                 refused, 422), store (calibration store unavailable, 503),
                                                 internal (a bug, 500)
  edge_engine_state{state}                       1 for the engine's state now, 0 for the others
  edge_engine_restarts_total{reason}             restarts, by why the engine stopped serving
  edge_engine_probe_failures_total{probe}        failed liveness probes: health, generation, traffic (a forwarded
                                                 request that timed out, broke off or got a 5xx), stopped (a
                                                 process of the engine in state T), stall (requests waiting on
                                                 an engine that uses no CPU)
  edge_engine_last_ready_timestamp_seconds       when the engine last became ready (Unix time)
  edge_engine_info{served_model_name,weight_path}
  edge_engine_metrics_up                         1 when the engine's own metrics were read for this scrape
  edge_engine_requests_waited_total              /v1 requests that waited for the engine (starting or restarting)
  edge_engine_requests_served_after_wait_total   of them, answered by the engine (not a 5xx)
  edge_engine_requests_refused_total{reason}     of them, refused with 503: queue_full (restart_queue requests
                                                 waited already), deadline (not ready within restart_wait_s or
                                                 the client's X-Edge-Max-Wait), stopping (the server stops)
  edge_engine_requests_abandoned_total           of them, given up by their client while they waited
  edge_engine_requests_waiting                   /v1 requests waiting for the engine now

The engine's series follow, as its `/metrics` wrote them: vLLM's `vllm:*`, and `process_*` / `python_*` of
vLLM's API server process (the wrapper registers no process collector, so no name appears twice).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from server.supervisor.status import ENGINE_STATES
from server.supervisor.supervisor import EngineSupervisor

log = logging.getLogger("edge.metrics")

# Text format 0.0.4: what vLLM's exposition is read as (Accept: text/plain), so the two parts are one document.
# (prometheus-client >= 0.22 calls version 1.0.0 "latest"; for names without UTF-8 the two are the same text.)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENGINE_METRICS_TIMEOUT_S = 5.0
ERROR_KINDS = ("input", "request", "store", "internal")
RESTART_REASONS = ("exited", "exited-before-ready", "not-ready-in-time", "unresponsive", "could-not-start",
                   "socket-taken")  # fmt: skip
WAIT_REFUSALS = ("queue_full", "deadline", "stopping")
# A plan takes ~1-50 ms here (a batch of 256 devices, seconds): buckets from 1 ms to 10 s.
PLAN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EngineCollector(Collector):
    """The supervisor's state, read at scrape time."""

    def __init__(self, supervisor: EngineSupervisor, weight_path: str | None) -> None:
        self.supervisor = supervisor
        self.weight_path = weight_path
        self.engine_metrics_up = 0

    def collect(self) -> Iterator[Metric]:
        status = self.supervisor.status()
        state = GaugeMetricFamily(
            "edge_engine_state", "1 for the engine's state now, 0 for the others.", labels=["state"]
        )
        for name in ENGINE_STATES:
            state.add_metric([name], 1.0 if status.state == name else 0.0)
        yield state
        restarts = CounterMetricFamily(
            "edge_engine_restarts", "Engine restarts, by why it stopped serving.", labels=["reason"]
        )
        for reason in sorted({*RESTART_REASONS, *status.restart_reasons}):
            restarts.add_metric([reason], status.restart_reasons.get(reason, 0))
        yield restarts
        probes = CounterMetricFamily(
            "edge_engine_probe_failures", "Failed liveness probes of the ready engine.", labels=["probe"]
        )
        for probe in ("health", "generation", "traffic", "stopped", "stall"):
            probes.add_metric([probe], self.supervisor.probes_failed.get(probe, 0))
        yield probes
        if status.last_ready_at is not None:
            yield GaugeMetricFamily(
                "edge_engine_last_ready_timestamp_seconds",
                "When the engine last became ready (Unix time).",
                value=status.last_ready_at,
            )
        info = InfoMetricFamily("edge_engine", "What the engine serves.")
        info.add_metric(
            [], {"served_model_name": status.served_model_name or "", "weight_path": self.weight_path or ""}
        )
        yield info
        yield GaugeMetricFamily(
            "edge_engine_metrics_up",
            "1 when the engine's own metrics were read for this scrape.",
            value=self.engine_metrics_up,
        )


# vLLM's speculative-decoding counters (vllm/v1/spec_decode/metrics.py), by the names /status gives them
DRAFT_SERIES = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "drafted_tokens",
                "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}  # fmt: skip


def drafting_counts(text: str) -> dict[str, float] | None:
    """The drafting counters in an engine's Prometheus text (samples `<series>_total`, summed over their labels);
    None when it has none (an engine that does not draft registers none)."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (name := DRAFT_SERIES.get(sample.name.removesuffix("_total"))) and sample.name.endswith("_total"):
                counts[name] = counts.get(name, 0.0) + sample.value
    return counts if len(counts) == len(DRAFT_SERIES) else None


class ServiceMetrics:
    """The wrapper's metrics: planning counted by the app's handlers, the engine read at scrape time."""

    def __init__(self, supervisor: EngineSupervisor | None = None, weight_path: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.supervisor = supervisor
        self.plans = Counter(
            "edge_plans_served",
            "Plans answered (a batch counts each device it planned).",
            ["endpoint"],
            registry=self.registry,
        )
        self.plan_seconds = Histogram(
            "edge_plan_request_duration_seconds",
            "How long an answered planning request took.",
            ["endpoint"],
            buckets=PLAN_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "edge_planning_errors",
            "Planning requests or batch devices refused, by kind.",
            ["kind"],
            registry=self.registry,
        )
        for kind in ERROR_KINDS:
            self.errors.labels(kind)  # present at 0 from the start: a rate needs a first sample
        if supervisor is not None:  # a planning-only server has no engine, and no requests wait for one
            self._wait_series()
        self.engine = EngineCollector(supervisor, weight_path) if supervisor is not None else None
        if self.engine is not None:
            self.registry.register(self.engine)

    def _wait_series(self) -> None:
        """The series of /v1 requests waiting for the engine (server/routes/proxy.EngineWaits)."""
        self.waited = Counter(
            "edge_engine_requests_waited", "/v1 requests that waited for the engine.", registry=self.registry
        )
        self.served_after_wait = Counter(
            "edge_engine_requests_served_after_wait",
            "/v1 requests that waited for the engine and were answered by it.",
            registry=self.registry,
        )
        self.refused = Counter(
            "edge_engine_requests_refused",
            "/v1 requests that waited for the engine and were refused (503), by why.",
            ["reason"],
            registry=self.registry,
        )
        for reason in WAIT_REFUSALS:
            self.refused.labels(reason)
        self.abandoned = Counter(
            "edge_engine_requests_abandoned",
            "/v1 requests whose client went away while they waited for the engine.",
            registry=self.registry,
        )
        self.waiting = Gauge(
            "edge_engine_requests_waiting", "/v1 requests waiting for the engine now.", registry=self.registry
        )

    @contextmanager
    def planning(self, endpoint: str, plans: int = 1) -> Iterator[list[int]]:
        """Time one planning request; counted as served only if it returns. The caller may set the number of
        plans it made (a batch) in the yielded list."""
        made = [plans]
        started = time.perf_counter()
        yield made
        self.plan_seconds.labels(endpoint).observe(time.perf_counter() - started)
        self.plans.labels(endpoint).inc(made[0])

    def planning_error(self, kind: str, count: int = 1) -> None:
        assert kind in ERROR_KINDS, f"planning error kind {kind!r} not one of {ERROR_KINDS}"
        if count:
            self.errors.labels(kind).inc(count)

    async def exposition(self, client: httpx.AsyncClient) -> bytes:
        """The wrapper's series, then the engine's (when it is ready and answers within a few seconds)."""
        engine_text = await self._engine_text(client)
        if self.engine is not None:
            self.engine.engine_metrics_up = int(engine_text is not None)
        own = generate_latest(self.registry)
        if not engine_text:
            return own
        return own + engine_text.encode() + (b"" if engine_text.endswith("\n") else b"\n")

    async def drafting(self, client: httpx.AsyncClient | None) -> dict[str, float] | None:
        """vLLM's drafting counters since the engine started (DRAFT_SERIES), read from its /metrics; None when it
        drafts nothing or is not ready."""
        text = await self._engine_text(client) if client is not None else None
        return None if text is None else drafting_counts(text)

    async def _engine_text(self, client: httpx.AsyncClient) -> str | None:
        if self.supervisor is None or not self.supervisor.is_ready:
            return None
        try:
            response = await client.get(
                f"{self.supervisor.engine_url}/metrics",
                headers={"Accept": "text/plain"},
                timeout=ENGINE_METRICS_TIMEOUT_S,
            )
        except httpx.HTTPError as exc:
            log.warning("engine metrics not read: %s: %s", type(exc).__name__, exc)
            return None
        if response.status_code != 200:
            log.warning("engine metrics not read: %d", response.status_code)
            return None
        text = response.text.rstrip()
        return text.removesuffix("# EOF").rstrip() + "\n"  # an OpenMetrics end marker would end ours too
