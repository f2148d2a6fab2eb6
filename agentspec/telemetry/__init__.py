"""Acceptance records, the per-tenant JSONL sink and Prometheus metrics (all in ``sink`` until the split by job)."""

from .sink import *  # noqa: F401,F403
from .sink import MAX_POSITIONS, TENANT_PATTERN, __all__, format_session_table, format_table, plot_summary  # noqa: F401
