"""Issue 35, item 10: ``pfl plugins`` fits 100 columns, the partition picture labels clients
with integer ids, ``label_counts()`` has one entry per class."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from tiny import tiny_raw

from pfl_core import registry
from pfl_core.cli.cli import main
from pfl_core.engine import Engine, resolve
from pfl_core.registry.docgen import listing_lines
from pfl_core.tracking import plots


def rows_of(lines: list[str]) -> dict[str, list[str]]:
    """``pfl plugins``' rows, a wrapped last column joined back: {name: [kind, package, version, hooks]}."""
    rows: dict[str, list[str]] = {}
    last = None
    for line in lines[1:]:
        if line.startswith(" "):
            rows[last][-1] += " " + line.strip()
        else:
            name, *rest = line.split(None, 4)
            rows[name] = rest + [""] * (4 - len(rest))
            last = name
    return rows


def test_pfl_plugins_fits_100_columns_and_keeps_every_hook(capsys):
    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "kind", "package", "version", "hooks"]
    assert max(len(line) for line in lines) <= 100
    rows = rows_of(lines)
    for name in ("apfl", "fedavg", "corrupted_clients"):
        hooks = [h.strip() for h in rows[name][3].split(",")]
        assert hooks == registry.implemented_hooks(registry.plugin_class(name)), name
    assert rows["fedavg"][:3] == ["algorithm", "pfl", registry.discovered()["fedavg"].version]


def test_listing_wraps_a_long_error_and_puts_the_last_column_below_very_long_names():
    error = "plugin 'x' (x_pkg:X) failed to import: " + "No module named 'a_missing_dependency' " * 6
    lines = listing_lines(("name", "kind", "hooks"), [("x", "broken", error), ("fedavg", "algorithm", "setup")])
    assert max(len(line) for line in lines) <= 100 and len(lines) > 3
    indent = lines[0].index("hooks")
    assert " ".join([lines[1][indent:], *(line.strip() for line in lines[2:-1])]) == error.strip()
    assert lines[-1].split() == ["fedavg", "algorithm", "setup"]
    assert all(line[:indent].strip() == "" for line in lines[2:-1])  # continuations under the column

    long_name = "a_plugin_name_" * 6
    lines = listing_lines(("name", "kind", "hooks"), [(long_name, "algorithm", "check_spec, setup")], width=100)
    assert lines == [f"{'name'.ljust(len(long_name))}  kind", "    hooks",
                     f"{long_name}  algorithm", "    check_spec, setup"]


@pytest.mark.parametrize("clients", [3, 10, 18, 25, 100])  # 3 and 18 were labelled 0.5 and 2.5 steps
def test_partition_picture_labels_clients_with_integer_ids(clients):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no class names: an empty legend
        fig = plots.partition_figure(np.ones((clients, 3), dtype=int))
    fig.canvas.draw()
    ax = fig.axes[0]
    low, high = ax.get_xlim()
    shown = [(label.get_position()[0], label.get_text()) for label in ax.get_xticklabels()
             if low <= label.get_position()[0] <= high]
    assert len(shown) >= 2
    for position, text in shown:
        assert float(position).is_integer() and 0 <= position <= clients - 1, (position, text)
        assert text == str(int(position)), text
    if clients <= 20:
        assert [text for _, text in shown] == [str(i) for i in range(clients)]
    plots.pyplot().close(fig)


def test_label_counts_has_one_entry_per_class_even_for_a_client_without_the_last_classes():
    data = Engine(resolve(tiny_raw()), progress=False).prepare().data  # synthetic devices: skewed labels
    short = [c for c in data.clients if int(c.train_y.max()) < data.num_classes - 1]
    assert short, "the test needs a client without the last class"
    for client in data.clients:
        counts = client.label_counts()
        assert counts.shape == (data.num_classes,)
        assert np.array_equal(counts, np.bincount(client.train_y.numpy(), minlength=data.num_classes))
        assert counts.sum() == client.num_train
        assert client.label_counts("test").shape == (data.num_classes,)
        assert np.array_equal(client.label_counts("train", data.num_classes), counts)
