"""dd.kernel_stats: the CUDA kernels' tile structure and path rules, applied on the host.

(tests/test_cuda_emulated.py checks the per-block structure against what the device plan kernel
writes; tests/test_gpu_cost.py the predicted times.) Also model_paths: what impl="auto" runs per
layer of a model.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd
from dynadiag_jax import gpu_cost, launch_plan
from dynadiag_jax.kernel_stats import describe_paths, model_paths


def test_random_offsets_at_90_percent_touch_most_tiles_at_a_tenth_fill(rng):
    # docs/design.md section 6: 768x768, K=77 random -> ~94% of 16x16 tiles touched, ~10% full.
    # Packed once per call, such a tile is cheaper on tensor cores than its ~26 entries walked
    # on CUDA cores (the rule takes tensor cores from 1/16 fill).
    offsets = rng.choice(768, dd.num_diagonals(768, 768, 0.9), replace=False)
    s = dd.kernel_stats(offsets, 768, 768)
    assert s.nonzeros == 77 * 768 and s.tiles_total == 48 * 48
    assert 0.9 < s.tiles_touched / s.tiles_total < 0.97
    assert 0.08 < s.forward.fill < 0.13
    assert s.path == "tensor_core"


def test_sparse_scattered_offsets_take_the_diagonal_path(rng):
    const = launch_plan.constants()
    # at 98% the touched tiles are ~2% full: below the 1/16 threshold
    offsets = rng.choice(768, dd.num_diagonals(768, 768, 0.98), replace=False)
    s = dd.kernel_stats(offsets, 768, 768)
    assert s.forward.fill * const.TILE_COST < const.ENTRY_COST
    assert s.path == "diagonal" and s.forward.tensor_core_blocks == 0


def test_the_fill_threshold_is_the_cost_models_ratio():
    const = launch_plan.constants()
    assert const.TILE_COST / const.ENTRY_COST == round(gpu_cost.tile_cost_ratio())
    assert gpu_cost.tile_cost_ratio("A100") == gpu_cost.tile_cost_ratio(gpu_cost.A100)


def test_contiguous_offsets_take_tensor_cores():
    s = dd.kernel_stats(np.arange(77), 768, 768, dtype=jnp.float16)
    assert s.tiles_touched == 6 * 48  # each 16-row block meets 6 tiles of a 77-wide band
    assert s.forward.fill == pytest.approx(77 * 768 / (6 * 48 * 256))
    assert s.path == "tensor_core" and s.forward.diagonal_blocks == 0


def test_float32_has_no_tensor_core_path():
    s = dd.kernel_stats(np.arange(77), 768, 768, dtype=jnp.float32)
    assert s.path == "diagonal" and s.forward.tensor_core_blocks + s.dx.tensor_core_blocks == 0


def test_rectangular_products_count_their_own_output_blocks(rng):
    s = dd.kernel_stats(rng.choice(3072, 308, replace=False), 768, 3072)
    assert s.forward.output_blocks == 3072 // 16 and s.dx.output_blocks == 768 // 16
    assert s.forward.tiles == s.dx.tiles == s.tiles_touched


def test_mixed_structure_reports_mixed():
    # tall 32 -> 256: a band fills output rows 0..62, a lone diagonal rows 200..231 (1/16 full,
    # then 1/32 in its second tile row)
    offsets = np.concatenate([np.arange(32), [200]])
    s = dd.kernel_stats(offsets, 32, 256)
    assert s.path == "mixed"
    assert s.forward.tensor_core_blocks > 0 and s.forward.diagonal_blocks > 0


@pytest.mark.parametrize(
    "dtype,b,path",
    [(jnp.bfloat16, 16, "tensor_core"), (jnp.float16, 32, "tensor_core"),
     (jnp.bfloat16, 8, "cuda_core"), (jnp.float32, 16, "cuda_core")],
)  # fmt: skip
def test_block_diagonals_are_full_tiles(dtype, b, path):
    offsets = np.array([0, 3, 3])  # a repeat counts twice in the work, once in the density
    s = dd.kernel_stats(offsets, 128, 256, dtype=dtype, block_size=b)
    n_in, n_out = 128 // b, 256 // b
    assert s.block_size == b and s.path == path
    assert s.tiles_total == n_in * n_out and s.tiles_touched == 2 * n_out
    assert s.nonzeros == 3 * 256 * b and s.density == pytest.approx(2 * 256 * b / (128 * 256))
    assert s.forward.output_blocks == n_out and s.dx.output_blocks == n_in
    assert s.forward.tiles == s.dx.tiles == 3 * n_out and s.forward.fill == 1.0
    on_tc = path == "tensor_core"
    assert s.forward.tensor_core_blocks == (n_out if on_tc else 0)
    assert s.dx.diagonal_blocks == (0 if on_tc else n_in)


def test_rows_add_the_predicted_times_of_each_path(rng):
    s = dd.kernel_stats(np.array([1, 4]), 768, 3072, block_size=16, rows=4096)
    assert s.cost is not None and s.cost.structure == "offsets"
    assert set(s.cost.seconds) == {"kernel", "dense", "dense_layer"}
    assert s.cost.num_diagonals == 2 and s.cost.device == "H100"
    assert dd.kernel_stats(np.array([1, 4]), 768, 3072, block_size=16).cost is None
    a100 = dd.kernel_stats(np.array([1, 4]), 768, 3072, block_size=16, rows=4096, device="A100")
    assert a100.cost.seconds["dense_layer"][0] > s.cost.seconds["dense_layer"][0]


def test_bad_offsets_are_rejected():
    with pytest.raises(ValueError, match=r"\[0, P\) = \[0, 48\)"):
        dd.kernel_stats(np.array([0, 48]), 48, 20)
    with pytest.raises(ValueError, match=r"\[0, P_b\) = \[0, 4\)"):
        dd.kernel_stats(np.array([4]), 64, 256, block_size=16)
    with pytest.raises(TypeError, match="1-D integer"):
        dd.kernel_stats(np.array([0.5]), 48, 20)
    with pytest.raises(TypeError, match="concrete offsets"):
        jax.jit(lambda o: dd.kernel_stats(o, 48, 20).nonzeros)(jnp.arange(3))


@pytest.mark.parametrize(
    "rows, error, message",
    [
        (-5, ValueError, "rows must be >= 1, got -5"),
        (0, ValueError, "rows must be >= 1"),
        (3.5, TypeError, "rows must be an int, got float"),
        (True, TypeError, "rows must be an int"),
    ],
)
def test_bad_rows_are_rejected_by_name(rows, error, message):
    with pytest.raises(error, match=message):
        dd.kernel_stats(np.array([0, 3]), 8, 12, rows=rows)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float64, "int8", "no-such-dtype", None])
@pytest.mark.parametrize("block_size", [1, 8])
def test_dtypes_the_kernels_do_not_take_are_rejected_by_name(dtype, block_size):
    with pytest.raises(TypeError, match=r"dtype must be one .*\(float32, bfloat16, float16\)"):
        dd.kernel_stats(np.array([0]), 16, 24, dtype=dtype, block_size=block_size, rows=4)


@pytest.mark.parametrize("block_size", [2, 3, 4, 48])
def test_block_sizes_no_kernel_runs_are_rejected(block_size):
    # geometry alone accepts them (the pure-JAX path runs any b dividing both widths)
    with pytest.raises(ValueError, match=r"block_size must be 1 .* \(8, 16, 32, 64, 128\), got"):
        dd.kernel_stats(np.array([0]), 96, 192, block_size=block_size)


@pytest.mark.parametrize("rows", [None, 8])
def test_an_unknown_device_is_rejected_with_or_without_rows(rows):
    with pytest.raises(ValueError, match=r"device must be one of \('H100', 'A100'"):
        dd.kernel_stats(np.array([0]), 64, 128, rows=rows, device="Z80")


class _TwoLayers(nn.Module):
    """A tall element layer in bfloat16 and a wide block layer without a bias, in float32."""

    @nn.compact
    def __call__(self, x):
        x = dd.nn.DiagonalDense(3072, sparsity=0.9, dtype=jnp.bfloat16, name="up")(x)
        return dd.nn.DiagonalDense(768, sparsity=0.9, block_size=16, use_bias=False)(x)


def test_model_paths_say_what_auto_runs_per_layer_and_platform():
    x = jax.ShapeDtypeStruct((2048, 197, 768), jnp.float32)
    cpu, cuda_ = (
        model_paths(_TwoLayers(), jax.random.key(0), x, platform=p) for p in ("cpu", "cuda")
    )
    down, up = cuda_  # sorted by module path
    assert (up.path, up.in_features, up.out_features, up.block_size) == ("up", 768, 3072, 1)
    assert (down.in_features, down.out_features, down.block_size) == (3072, 768, 16)
    assert (up.num_diagonals, down.num_diagonals) == (308, 5)
    # on a GPU both take the dense path; the numbers are the cost model's for each layer's rows
    # (2048 x 197) and computation dtype
    for p, dtype in ((up, jnp.bfloat16), (down, jnp.float32)):
        pred = gpu_cost.predict(
            2048 * 197, p.in_features, p.out_features, dtype, p.num_diagonals,
            block_size=p.block_size,
        )  # fmt: skip
        assert p.impl == "dense" and p.kernel_speedup == pred.speedup("kernel", "dense_layer")
        assert p.path_speedup == pred.speedup("dense", "dense_layer")
    assert [p.impl for p in cpu] == (["ffi", "ffi"] if dd.has_cpu_kernels() else ["jax", "jax"])
    assert all(p.kernel_speedup is None for p in cpu)
    lines = describe_paths([up, up, down])  # repeated layers are counted on one line
    assert len(lines) == 2 and lines[0].startswith("2 x 768->3072, element diagonals, K=308")
    assert "W built + XLA's dot" in lines[0] and f"{up.kernel_speedup[1]:.2f}x" in lines[0]


@pytest.mark.parametrize("platform", ["gpu", "CUDA", "cdua"])
def test_model_paths_refuse_a_platform_no_lowering_has(platform):
    """Each was silently a platform without kernels: "W built + XLA's dot", no prediction."""
    x = jax.ShapeDtypeStruct((8, 768), jnp.float32)
    with pytest.raises(ValueError, match="platform must be one of cpu, cuda, rocm, tpu"):
        model_paths(_TwoLayers(), jax.random.key(0), x, platform=platform)


def test_model_paths_of_frozen_layers():
    # the static-diagonals baseline: frozen from init, values [K, D] leave a wide layer's input
    # width open; the call gives it
    layer = dd.nn.DiagonalDense(768, sparsity=0.9, init_phase="frozen")
    x = jax.ShapeDtypeStruct((2048, 197, 3072), jnp.float32)
    (p,) = model_paths(layer, jax.random.key(0), x, platform="cuda")
    assert (p.in_features, p.out_features, p.num_diagonals, p.impl) == (3072, 768, 308, "dense")


@pytest.mark.parametrize("phase", ["search", "frozen"])
def test_model_paths_count_the_layers_of_a_scanned_stack(phase):
    """Three layers under nn.scan share one module path: described as "1 x" until the stack's
    leading axis was counted."""

    class Cell(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            layer = dd.nn.DiagonalDense(32, sparsity=0.75, init_phase=phase, name="fc")
            return jnp.tanh(layer(x)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(Cell, variable_axes={True: 0}, split_rngs={"params": True}, length=3)
            return scan(name="layers")(x, None)[0]

    (path,) = model_paths(Stack(), jax.random.key(0), jnp.ones((4, 32)), platform="cpu")
    assert (path.path, path.copies, path.num_diagonals) == ("layers/fc", 3, 8)
    assert describe_paths([path])[0].startswith("3 x 32->32, element diagonals, K=8 (layers/fc)")
