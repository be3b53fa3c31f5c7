"""The diagonal figure: each selection snapshot is drawn from its step on."""

import json

import matplotlib.pyplot as plt
import numpy as np
import pytest
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


def test_block_layers_are_drawn_as_blocks(tmp_path, monkeypatch):
    # 16 -> 32 with b = 8: P_b = 2 candidate chains of L_b = 4 blocks; offset 1 kept.
    mask = plots.support_mask([1], 16, 32, block_size=8)
    blocks = mask.reshape(4, 8, 2, 8).transpose(0, 2, 1, 3)  # [block row, block col, 8, 8]
    full = blocks.all(axis=(2, 3))
    assert np.array_equal(full, blocks.any(axis=(2, 3)))  # every touched block is full
    assert full.tolist() == [[0, 1], [1, 0], [0, 1], [1, 0]]  # block (t, (t + 1) % 2)
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for step, kept in ((0, [0]), (10, [1])):
            f.write(json.dumps({"step": step, "kind": "selection", "offsets": {"h": kept}}) + "\n")
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plots.plot_diagonals(
        tmp_path / "metrics.jsonl",
        {"h": np.array([1])},
        {"h": (16, 32)},
        tmp_path / "d.png",
        block_size=8,
    )
    support, evolution = figures[0].axes[:2]
    np.testing.assert_array_equal(support.get_images()[0].get_array(), mask)
    assert "1 of 2 block diagonals" in support.get_title()
    (mesh,) = [c for c in evolution.collections if isinstance(c, QuadMesh)]
    assert np.asarray(mesh.get_array()).size == 2 * 2  # P_b offsets x 2 snapshots


def test_the_path_returned_is_the_file_written(tmp_path):
    """matplotlib adds ".png" to a path without a suffix; the path returned did not exist."""
    (tmp_path / "metrics.jsonl").write_text("")
    png = plots.plot_diagonals(
        tmp_path / "metrics.jsonl", {"h": np.array([1])}, {"h": (6, 8)}, tmp_path / "noext"
    )
    assert png == tmp_path / "noext.png" and png.stat().st_size > 0
    with pytest.raises(ValueError, match="kept names no layer"):
        plots.plot_diagonals(tmp_path / "metrics.jsonl", {}, {}, tmp_path / "d.png")
    with pytest.raises(ValueError, match=r"no shape for h \(shapes: \['g'\]\)"):
        plots.plot_diagonals(
            tmp_path / "metrics.jsonl", {"h": np.array([1])}, {"g": (6, 8)}, tmp_path / "d.png"
        )
