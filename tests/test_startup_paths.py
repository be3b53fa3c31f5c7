"""The training scripts' start-up lines: which path impl="auto" takes for each sparse layer."""

import flax.linen as nn
import jax
import jax.numpy as jnp

import dynadiag_jax as dd
from train import baselines, common


class _Net(nn.Module):
    sparse: bool

    @nn.compact
    def __call__(self, x, *, train=False):
        layer = dd.nn.DiagonalDense if self.sparse else nn.Dense
        kwargs = {"sparsity": 0.9, "block_size": 16} if self.sparse else {}
        for i in range(3):
            x = layer(256, name=f"fc{i}", **kwargs)(x)
        return x


def _lines(model, example):
    """The start-up lines of a run of ``model`` whose sparse updates are not scaled."""
    return common.startup_lines(None, baselines.Method("x", model, *[None] * 4, ()), example)


def test_one_line_per_sparse_layer_shape_and_none_for_a_dense_model():
    example = jax.ShapeDtypeStruct((64 * jax.device_count(), 128), jnp.float32)
    lines = _lines(_Net(sparse=True), example)
    # fc1 and fc2 are both 256 -> 256: one line for the two
    assert len(lines) == 2 and all(line.startswith("sparse layers: ") for line in lines)
    assert lines[0].startswith("sparse layers: 1 x 128->256, blocks of 16, K=")
    assert lines[1].startswith("sparse layers: 2 x 256->256, blocks of 16, K=")
    kernels = "the C++ kernels" if dd.has_cpu_kernels() else "the pure-JAX path"
    assert all(f"on cpu: {kernels}" in line for line in lines)
    assert _lines(_Net(sparse=False), example) == []
