"""``agentspec stats --plot``: ``summarize``'s output drawn with matplotlib (imported when called)."""

from __future__ import annotations

import os
from typing import Any


def plot_summary(summary: dict[str, list[dict[str, Any]]], path: str | os.PathLike | None) -> Any:
    """Draw ``summarize``'s output: acceptance rate by draft position (a line per tenant, each
    point labelled with its n: the steps whose draft reached that depth, so a depth seen twice
    does not pass for a measured 1.0) and MAT by route (a bar per tenant and route, labelled with
    its number of requests). Saves a PNG to ``path`` (None: no file) and returns the matplotlib
    ``Figure``: its axes hold the plotted series (lines and bar containers labelled by tenant)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ImportError("agentspec stats --plot needs matplotlib: pip install matplotlib") from None

    tenants = sorted({t["tenant"] for t in summary["tenants"]} | {r["tenant"] for r in summary["routes"]})
    color = {t: f"C{i % 10}" for i, t in enumerate(tenants)}   # one colour per tenant in both panels
    fig = Figure(figsize=(12, 4.6), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    for t in summary["tenants"]:
        per = t["acceptance_per_pos"]
        counts = t.get("drafted_per_pos") or [None] * len(per)
        if not per:
            continue
        xs = list(range(1, len(per) + 1))
        ax1.plot(xs, per, marker="o", markersize=3, label=t["tenant"], color=color[t["tenant"]])
        for x, y, n in zip(xs, per, counts):
            if n is not None:
                ax1.annotate(str(n), (x, y), textcoords="offset points", ha="center", fontsize=6,
                             xytext=(0, 4 + 7 * (tenants.index(t["tenant"]) % 3)),   # tenants' labels apart
                             color=color[t["tenant"]])
    ax1.set(title="Acceptance rate by draft position (labels: n drafted)", xlabel="draft position (depth)",
            ylabel="accepted / drafted", ylim=(0, 1.1))
    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax1.lines:
        ax1.legend(fontsize="small", title="tenant", title_fontsize="small")
    else:
        ax1.text(0.5, 0.5, "no per-position data", ha="center", va="center", transform=ax1.transAxes)
    rows = summary["routes"]   # per (tenant, route): one bar each, grouped by route
    routes = sorted({r["route"] for r in rows})
    width = 0.8 / max(len(tenants), 1)
    for k, tenant in enumerate(tenants):
        mine = [r for r in rows if r["tenant"] == tenant]
        if not mine:
            continue
        xs = [routes.index(r["route"]) - 0.4 + width * (k + 0.5) for r in mine]
        bars = ax2.bar(xs, [r["mat"] for r in mine], width, label=tenant, color=color[tenant])
        ax2.bar_label(bars, labels=[f"n={r['requests']}" for r in mine], fontsize=7, padding=2)
    ax2.set_xticks(range(len(routes)), routes)
    ax2.set(title="MAT by route and tenant (labels: n requests)", xlabel="route", ylabel="mean acceptance length")
    if ax2.containers:
        ax2.margins(y=0.12)   # room for the labels above the bars
        ax2.legend(fontsize="small", title="tenant", title_fontsize="small")
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
