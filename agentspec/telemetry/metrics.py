"""Prometheus metrics (``GET /metrics``); prometheus_client is imported when ``Metrics`` is made."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .records import AcceptanceRecord

MAX_POSITIONS = 64  # per-position Prometheus series per tenant (deeper positions are not exported)
# the ``tenant`` label of the tenants past ``max_tenants``: not a tenant name (those are
# [A-Za-z0-9._-], records.TENANT_PATTERN), so no tenant's own series is ever the combined one
OVERFLOW_TENANT = "(other)"


class Metrics:
    """Prometheus metrics on a private registry, named after vLLM's with an ``agentspec:`` prefix,
    without ``_created`` series.

    Every series has a ``tenant`` label; the first ``max_tenants`` tenants seen keep their name,
    later ones are counted together as ``"(other)"`` (``OVERFLOW_TENANT``: no tenant can be
    named that). ``..._per_pos`` series have a ``position`` label,
    0-based as in vLLM (position p = draft depth p + 1), for the first ``max_positions`` positions.
    """

    def __init__(self, *, max_tenants: int = 32, max_positions: int = MAX_POSITIONS) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        # no ``_created`` twin per series (a timestamp per counter and histogram: half the lines,
        # no information a scraper needs); prometheus_client's switch is process-wide, set here so
        # it holds whatever $PROMETHEUS_DISABLE_CREATED_SERIES says
        disable_created_metrics()

        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        if max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {max_positions}")
        self.max_tenants = max_tenants
        self.max_positions = max_positions
        self._tenants: set[str] = set()
        self._lock = threading.Lock()
        self.registry = CollectorRegistry()
        p, reg, t = "agentspec:", self.registry, ["tenant"]
        self.num_drafts = Counter(p + "spec_decode_num_drafts", "Steps that verified a draft.", t, registry=reg)
        self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified.", t, registry=reg)
        self.num_accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", t,
                                           registry=reg)
        self.num_draft_tokens_per_pos = Counter(
            p + "spec_decode_num_draft_tokens_per_pos", "Steps whose draft reached each position.",
            ["tenant", "position"], registry=reg)
        self.num_accepted_tokens_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens at each position.",
            ["tenant", "position"], registry=reg)
        self.request_success = Counter(p + "request_success", "Finished requests by finish reason.",
                                       ["tenant", "finish_reason"], registry=reg)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed.", t, registry=reg)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", t, registry=reg)
        self.time_to_first_token = Histogram(
            p + "time_to_first_token_seconds", "Time to first token.", t, registry=reg,
            buckets=[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0])
        self.e2e_request_latency = Histogram(
            p + "e2e_request_latency_seconds", "Request arrival to last token.", t, registry=reg,
            buckets=[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                     240.0, 480.0, 960.0, 1920.0, 7680.0])
        self.num_requests_running = Gauge(p + "num_requests_running", "Requests in flight.", t, registry=reg)

    def tenant_label(self, tenant: str) -> str:
        """``tenant``, or ``OVERFLOW_TENANT`` once ``max_tenants`` other tenants have been seen."""
        with self._lock:
            if tenant in self._tenants:
                return tenant
            if len(self._tenants) < self.max_tenants:
                self._tenants.add(tenant)
                return tenant
            return OVERFLOW_TENANT

    def request_started(self, tenant: str) -> None:
        self.num_requests_running.labels(self.tenant_label(tenant)).inc()

    def request_finished(self, tenant: str) -> None:
        self.num_requests_running.labels(self.tenant_label(tenant)).dec()

    @contextmanager
    def running(self, tenant: str) -> Iterator[None]:
        """Counts a request in ``num_requests_running`` while the block runs."""
        self.request_started(tenant)
        try:
            yield
        finally:
            self.request_finished(tenant)

    def observe(self, record: AcceptanceRecord) -> None:
        """Counts one finished request (``record`` as written to the log)."""
        t = self.tenant_label(record.tenant)
        self.request_success.labels(t, record.finish_reason).inc()
        self.prompt_tokens.labels(t).inc(record.prompt_tokens)
        self.generation_tokens.labels(t).inc(record.completion_tokens)
        self.time_to_first_token.labels(t).observe(record.ttft_ms / 1e3)
        self.e2e_request_latency.labels(t).observe(record.e2e_ms / 1e3)
        self.num_drafts.labels(t).inc(record.drafts)
        self.num_draft_tokens.labels(t).inc(record.draft_tokens)
        self.num_accepted_tokens.labels(t).inc(record.accepted_tokens)
        for i, n in enumerate(record.drafted_per_pos[: self.max_positions]):
            self.num_draft_tokens_per_pos.labels(t, str(i)).inc(n)
        for i, n in enumerate(record.accepted_per_pos[: self.max_positions]):
            self.num_accepted_tokens_per_pos.labels(t, str(i)).inc(n)

    def watch_log_sink(self, sink: Any) -> None:
        """Export ``sink.failed`` (records the acceptance log could not write: disk full,
        permissions) as the counter ``agentspec:log_write_errors_total``; once per Metrics."""
        if getattr(self, "_log_sink", None) is not None:
            self._log_sink = sink
            return
        from prometheus_client.core import CounterMetricFamily

        self._log_sink = sink
        metrics = self

        class _LogErrors:
            def collect(self):
                yield CounterMetricFamily("agentspec:log_write_errors",
                                          "Acceptance-log records that could not be written (lost).",
                                          value=getattr(metrics._log_sink, "failed", 0))

        self.registry.register(_LogErrors())

    def render(self, tenant: str | None = None) -> tuple[bytes, str]:
        """``(body, content_type)`` for ``GET /metrics``: every series, or with ``tenant`` only
        that tenant's (the samples labelled with it; a tenant past ``max_tenants``, counted under
        ``OVERFLOW_TENANT``, gets none: that series is several tenants')."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if tenant is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        with self._lock:
            label = tenant if tenant in self._tenants else None
        return generate_latest(_OneTenant(self.registry, label)), CONTENT_TYPE_LATEST


class _OneTenant:
    """A registry view holding only the samples whose ``tenant`` label is ``label`` (None: none)."""

    def __init__(self, registry, label: str | None) -> None:
        self.registry, self.label = registry, label

    def collect(self):
        import copy

        for family in self.registry.collect():
            if not any("tenant" in s.labels for s in family.samples):
                continue   # not per tenant (the server's own counters): an operator's
            kept = [s for s in family.samples if self.label is not None and s.labels.get("tenant") == self.label]
            out = copy.copy(family)
            out.samples = kept
            yield out
