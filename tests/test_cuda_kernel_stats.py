"""dd.kernel_stats: the CUDA kernel's tile structure and path rule, applied on the host.

(tests/test_cuda_emulated.py checks the per-block structure against what the device kernels write.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd


def test_random_offsets_at_90_percent_take_the_diagonal_path(rng):
    # docs/design.md section 6: 768x768, K=77 random -> ~94% of 16x16 tiles touched, ~10% full
    offsets = rng.choice(768, dd.num_diagonals(768, 768, 0.9), replace=False)
    s = dd.kernel_stats(offsets, 768, 768)
    assert s.nonzeros == 77 * 768 and s.tiles_total == 48 * 48
    assert 0.9 < s.tiles_touched / s.tiles_total < 0.97
    assert 0.08 < s.forward.fill < 0.13
    assert s.path == "diagonal" and s.forward.tensor_core_blocks == 0


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
    # tall 32 -> 256: a band fills output rows 0..62, a lone diagonal rows 200..231 (1/16 full)
    offsets = np.concatenate([np.arange(32), [200]])
    s = dd.kernel_stats(offsets, 32, 256)
    assert s.path == "mixed"
    assert s.forward.tensor_core_blocks > 0 and s.forward.diagonal_blocks > 0


def test_bad_offsets_are_rejected():
    with pytest.raises(ValueError, match=r"\[0, P\) = \[0, 48\)"):
        dd.kernel_stats(np.array([0, 48]), 48, 20)
    with pytest.raises(TypeError, match="1-D integer"):
        dd.kernel_stats(np.array([0.5]), 48, 20)
    with pytest.raises(TypeError, match="concrete offsets"):
        jax.jit(lambda o: dd.kernel_stats(o, 48, 20).nonzeros)(jnp.arange(3))
