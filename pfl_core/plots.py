"""Figures logged as run artifacts (matplotlib, headless)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def partition_figure(table: np.ndarray, class_names=None, title: str = "partition"):
    """Client x class sample counts as a stacked bar chart (one bar per client)."""
    clients, classes = table.shape
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * clients + 2), 4))
    bottom = np.zeros(clients)
    cmap = plt.get_cmap("tab20" if classes > 10 else "tab10")
    for c in range(classes):
        label = class_names[c] if class_names is not None and classes <= 20 else None
        ax.bar(np.arange(clients), table[:, c], bottom=bottom, color=cmap(c % cmap.N), label=label, width=0.85)
        bottom += table[:, c]
    ax.set_xlabel("client")
    ax.set_ylabel("samples")
    ax.set_title(title)
    if classes <= 20:
        ax.legend(fontsize=7, ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    return fig


def curves_figure(history: list[dict], keys: list[str], ylabel: str, title: str):
    """Metric(s) by round from the run's evaluation history."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in keys:
        points = [(h["round"], h[key]) for h in history if key in h]
        if points:
            rounds, values = zip(*points)
            ax.plot(rounds, values, marker="o", markersize=3, label=key)
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def close(fig) -> None:
    plt.close(fig)
