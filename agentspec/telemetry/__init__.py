"""Acceptance records, the per-tenant JSONL sink, reading and reporting them, and Prometheus metrics.

Counters and reporting stay apart (STYLE.md 11), one module a job:

- ``records``: ``AcceptanceRecord`` (one per request) and ``record_from_stats``, which builds one;
- ``sink``: ``TenantLogSink``, the per-tenant log writer (off the hot path) and its rotation;
- ``reader``: ``read_records`` (current and rotated logs) and ``parse_since``;
- ``report``: ``summarize`` / ``summarize_sessions`` and the ``agentspec stats`` tables;
- ``plots``: ``plot_summary`` (matplotlib, imported when called);
- ``metrics``: ``Metrics``, which counts records for Prometheus (prometheus_client, imported when made).

Importing this package loads neither torch nor matplotlib nor prometheus_client.
"""

from .metrics import Metrics
from .reader import ReadReport, parse_since, read_records
from .records import AcceptanceRecord, per_position_counts, record_from_stats, validate_tenant
from .report import summarize, summarize_sessions
from .sink import TenantLogSink

# public as well, though outside __all__ (as in the single module before): the ``agentspec stats``
# tables and plot, and the two limits
from .metrics import MAX_POSITIONS  # noqa: F401
from .plots import plot_summary  # noqa: F401
from .records import TENANT_PATTERN  # noqa: F401
from .report import format_session_table, format_table  # noqa: F401

__all__ = [
    "AcceptanceRecord",
    "Metrics",
    "ReadReport",
    "TenantLogSink",
    "parse_since",
    "per_position_counts",
    "read_records",
    "record_from_stats",
    "summarize",
    "summarize_sessions",
    "validate_tenant",
]
