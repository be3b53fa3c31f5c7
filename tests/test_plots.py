"""The diagonal figure: each selection snapshot is drawn from its step on."""

import json

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import QuadMesh

from train import plots


def test_selection_columns_start_at_their_steps(tmp_path, monkeypatch):
    # Snapshots every 10 steps, the last interval shorter: the freeze comes at step 25.
    steps = [0, 10, 20, 25]
    offsets = [[0, 1], [1, 3], [2, 3], [3, 5]]
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for step, kept in zip(steps, offsets):
            f.write(json.dumps({"step": step, "kind": "selection", "offsets": {"h": kept}}) + "\n")
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at
    png = plots.plot_diagonals(
        tmp_path / "metrics.jsonl",
        {"h": np.array([3, 5])},
        {"h": (6, 6)},
        tmp_path / "d.png",
        freeze_step=25,
    )
    assert png.stat().st_size > 0
    evolution = figures[0].axes[1]
    (mesh,) = [c for c in evolution.collections if isinstance(c, QuadMesh)]
    x_edges = mesh.get_coordinates()[0, :, 0]
    np.testing.assert_array_equal(x_edges, [0, 10, 20, 25, 30])
    grid = np.asarray(mesh.get_array()).reshape(6, len(steps))
    for j, kept in enumerate(offsets):
        assert np.flatnonzero(grid[:, j]).tolist() == kept
    assert [line.get_xdata()[0] for line in evolution.get_lines()] == [25]  # the freeze line
