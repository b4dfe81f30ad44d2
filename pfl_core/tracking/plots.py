"""Figures logged as run artifacts (matplotlib, headless). matplotlib is imported on the first
figure, not with this module: it is slow to import and a run without tracking draws nothing."""

from __future__ import annotations

import numpy as np


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def __getattr__(name: str):
    if name == "plt":  # ``plots.plt`` for plugins drawing their own figures
        return pyplot()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def partition_figure(table: np.ndarray, class_names=None, title: str = "partition"):
    """Client x class sample counts as a stacked bar chart (one bar per client)."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator
    clients, classes = table.shape
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * clients + 2), 4))
    bottom = np.zeros(clients)
    cmap = plt.get_cmap("tab20" if classes > 10 else "tab10")
    for c in range(classes):
        label = class_names[c] if class_names is not None and classes <= 20 else None
        ax.bar(np.arange(clients), table[:, c], bottom=bottom, color=cmap(c % cmap.N), label=label, width=0.85)
        bottom += table[:, c]
    ax.set_xlabel("client")
    if clients <= 20:  # client ids are integers (never 2.5): up to 20 all labelled, else a subset
        ax.set_xticks(np.arange(clients))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(-0.6, clients - 0.4)
    ax.set_ylabel("samples")
    ax.set_title(title)
    if classes <= 20:
        ax.legend(fontsize=7, ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    return fig


CLIENT_LABEL = "client"
COLDSTART_LABEL = "cold-start client"


def accuracy_distribution_figure(groups: list[tuple[str, list[float], list[bool]]], title: str):
    """Final accuracy per client, one column per run: a box over its training clients with
    every client drawn as a jittered point over it; cold-start clients (held out of training,
    personalised at the end) as orange triangles beside them, outside the box.

    ``groups``: ``(label, accuracies, is_coldstart)`` per run, in the order drawn."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(4.5, 1.1 * len(groups) + 2.5), 4))
    rng = np.random.default_rng(0)  # the same jitter every time: figures compare across runs
    positions = np.arange(1, len(groups) + 1)
    boxes = [([a for a, cold in zip(accs, colds) if not cold], x) for (_l, accs, colds), x in zip(groups, positions)]
    boxes = [(values, x) for values, x in boxes if values]
    if boxes:
        ax.boxplot([v for v, _ in boxes], positions=[x for _, x in boxes], widths=0.5, showfliers=False,
                   medianprops={"color": "black", "gid": "median"})
    labelled = set()
    for (_label, accs, colds), x in zip(groups, positions):
        accs, colds = np.asarray(accs, dtype=float), np.asarray(colds, dtype=bool)
        jitter = x + rng.uniform(-0.15, 0.15, len(accs))
        for mask, label, style in ((~colds, CLIENT_LABEL, {"color": "tab:blue", "marker": "o", "s": 14, "alpha": 0.6}),
                                   (colds, COLDSTART_LABEL, {"color": "tab:orange", "marker": "^", "s": 30})):
            if mask.any():
                ax.scatter(jitter[mask], accs[mask], label=None if label in labelled else label, zorder=3, **style)
                labelled.add(label)
    ax.set_xticks(positions, [g[0] for g in groups], rotation=20 if len(groups) > 3 else 0,
                  ha="right" if len(groups) > 3 else "center")
    ax.set_xlim(0.4, len(groups) + 0.6)
    ax.set_ylabel("final accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    if labelled:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# A study's methods, in its planned order: matplotlib's qualitative tab10, then tab20's lighter
# shades, so up to 20 methods never share a colour. The MLflow study view colours each run the
# same way (``study.method_colours``).
METHOD_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                  "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
                  "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5")


def method_colour(index: int) -> str:
    """The colour of a study's ``index``-th method (0-based), as ``#rrggbb``."""
    return METHOD_COLOURS[index % len(METHOD_COLOURS)]


def mean_curves_figure(curves: list[tuple[str, list[float], list[float], list[float]]], metric: str, title: str,
                       colours: list[str] | None = None):
    """One line per method: ``metric``'s mean over seeds by round, with its 95% interval as a
    band (none where a method ran one seed: nan half-widths).

    ``curves``: ``(label, rounds, means, ci95 half-widths)`` per method, in the legend's order;
    ``colours``: each one's (default: ``method_colour`` in that order)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colours = colours or [method_colour(i) for i in range(len(curves))]
    for (label, rounds, means, half), colour in zip(curves, colours):
        x, mean, half = np.asarray(rounds, float), np.asarray(means, float), np.asarray(half, float)
        ax.plot(x, mean, marker="o", markersize=3, label=label, color=colour)
        if np.isfinite(half).any():
            ax.fill_between(x, mean - half, mean + half, color=colour, alpha=0.2, linewidth=0)
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(pyplot().MaxNLocator(integer=True))
    ax.set_ylabel(f"{metric} (mean over seeds, 95% interval)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def final_means_figure(rows: list[tuple[str, float, float]], metric: str, title: str):
    """Each method's final ``metric`` as its mean over seeds with the 95% interval as an error
    bar. ``rows``: ``(label, mean, ci95 half-width)`` per method, drawn in that order."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(4.5, 1.1 * len(rows) + 2.5), 4))
    x = np.arange(len(rows))
    means = np.asarray([r[1] for r in rows], float)
    half = np.asarray([r[2] for r in rows], float)
    ax.errorbar(x, means, yerr=np.where(np.isfinite(half), half, 0.0), fmt="o", capsize=6, color="tab:blue")
    for xi, mean in zip(x, means):
        ax.annotate(f"{mean:.4f}", (xi, mean), textcoords="offset points", xytext=(8, 0), fontsize=8, va="center")
    ax.set_xticks(x, [r[0] for r in rows], rotation=20 if len(rows) > 3 else 0, ha="right" if len(rows) > 3 else "center")
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_ylabel(f"final {metric} (mean, 95% interval)")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def close(fig) -> None:
    pyplot().close(fig)
