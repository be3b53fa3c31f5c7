"""The CUDA kernels on a real GPU (marker ``gpu``, skipped without one); run by gpu_check.sh.

Every op form - element and block diagonals (tensor-core and CUDA-core paths), tall/wide/square,
forward and both gradients - in every dtype against a float64 reference; a >= 400k-row batch; the
batch sharded over all local GPUs; and what ``impl="auto"`` compiles to. The tests marked
``large`` (the 400k rows) are left out of the compute-sanitizer runs, which are slow.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import dynadiag_jax as dd
from dynadiag_jax.layout import geometry
from dynadiag_jax.ops import auto

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        jax.default_backend() != "gpu" or not dd.has_cuda_kernels(),
        reason="needs a CUDA GPU and dynadiag-jax built with the CUDA kernels",
    ),
]

TOL = {jnp.float32: 2e-3, jnp.bfloat16: 3e-2, jnp.float16: 5e-3}  # relative to max |reference|
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
SHAPES = [(64, 256), (256, 64), (128, 128), (48, 80)]


def case(rng, rows, in_f, out_f, b, k, dtype):
    geo = geometry(in_f, out_f, b)
    offsets = rng.choice(geo.num_candidates, size=k, replace=k > geo.num_candidates)
    x = rng.standard_normal((rows, in_f))
    values = rng.standard_normal((k, *geo.values_shape)) / np.sqrt(k * b)
    dy = rng.standard_normal((rows, out_f))
    return [jnp.asarray(a, dtype) for a in (x, values, dy)] + [jnp.asarray(offsets, jnp.int32)]


def reference(x, values, dy, offsets, out_f):
    """float64 y, dx, dvalues, on the host."""
    in_f = x.shape[-1]
    w = np.asarray(
        dd.diag_to_dense(
            jnp.asarray(values, jnp.float32), offsets, in_features=in_f, out_features=out_f
        ),
        np.float64,
    )
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    dw = jnp.asarray(dy64.T @ x64, jnp.float32)
    # dvalues: dW gathered at the stored positions, via the transpose of diag_to_dense
    _, gather = jax.vjp(
        lambda v: dd.diag_to_dense(v, offsets, in_features=in_f, out_features=out_f),
        jnp.asarray(values, jnp.float32),
    )
    return x64 @ w.T, dy64 @ w, np.asarray(gather(dw)[0], np.float64)


def run(impl, x, values, dy, offsets, out_f):
    def loss(x, v):
        y = dd.diag_matmul(x, v, offsets, out_features=out_f, impl=impl)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    (_, y), (gx, gv) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, values)
    return y, gx, gv


def assert_matches(got, want, dtype, what):
    for name, g, w in zip(("y", "dx", "dvalues"), got, want):
        g = np.asarray(g, np.float64)
        scale = max(1e-6, float(np.max(np.abs(w))))
        err = float(np.max(np.abs(g - w)))
        assert err <= TOL[dtype] * scale, f"{what} {name}: {err:.3g} > {TOL[dtype] * scale:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("in_f,out_f", SHAPES)
@pytest.mark.parametrize("layout", ["scattered", "band"])
def test_element_diagonals_match_the_reference(layout, in_f, out_f, dtype, rng):
    p = max(in_f, out_f)
    x, values, dy, _ = case(rng, 300, in_f, out_f, 1, 24, dtype)
    offsets = rng.choice(p, 24, replace=False) if layout == "scattered" else np.arange(24) + 5
    offsets = jnp.asarray(offsets % p, jnp.int32)
    got = run("ffi", x, values, dy, offsets, out_f)
    assert_matches(
        got, reference(x, values, dy, offsets, out_f), dtype, f"{layout} {in_f}->{out_f}"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("in_f,out_f", SHAPES)
@pytest.mark.parametrize("b", [8, 16, 32])
def test_block_diagonals_match_the_reference(b, in_f, out_f, dtype, rng):
    if in_f % b or out_f % b:
        pytest.skip(f"b = {b} does not divide {in_f} -> {out_f}")
    k = geometry(in_f, out_f, b).num_candidates
    for kk in sorted({1, k}):  # K = 1 and K = P_b
        x, values, dy, offsets = case(rng, 300, in_f, out_f, b, kk, dtype)
        got = run("ffi", x, values, dy, offsets, out_f)
        want = reference(x, values, dy, offsets, out_f)
        assert_matches(got, want, dtype, f"b={b} K={kk} {in_f}->{out_f}")


@pytest.mark.large
@pytest.mark.parametrize("b", [1, 16])
def test_more_than_400k_rows(b, rng):
    rows, in_f, out_f = 403_456, 64, 256
    x, values, dy, offsets = case(rng, rows, in_f, out_f, b, 3, jnp.bfloat16)
    got = run("ffi", x, values, dy, offsets, out_f)
    want = run("dense", x, values, dy, offsets, out_f)  # XLA's dot in the same dtype
    for name, g, w in zip(("y", "dx", "dvalues"), got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all(), name
        assert np.max(np.abs(g - w)) <= 3e-2 * np.max(np.abs(w)), name


@pytest.mark.parametrize("b", [1, 16])
def test_batch_sharded_over_all_local_gpus(b, rng):
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("rows",))
    rows = 256 * len(devices)
    x, values, dy, offsets = case(rng, rows, 64, 256, b, 3, jnp.bfloat16)
    xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec("rows", None)))
    dys = jax.device_put(dy, NamedSharding(mesh, PartitionSpec("rows", None)))
    got = run("ffi", xs, values, dys, offsets, 256)
    # no gather of x or y (on one device a split over an axis of size 1 reads as replicated)
    split = NamedSharding(mesh, PartitionSpec("rows", None))
    assert got[0].sharding.is_equivalent_to(split, got[0].ndim)
    assert_matches(got, reference(x, values, dy, offsets, 256), jnp.bfloat16, f"sharded b={b}")


@pytest.mark.parametrize("b,sparsity", [(1, 0.9), (16, 0.9), (16, 0.5)])
def test_auto_compiles_to_what_the_cost_model_decides(b, sparsity, rng):
    rows, in_f, out_f = 4096, 768, 3072
    k = dd.num_diagonals(in_f, out_f, sparsity, block_size=b)
    x, values, _, offsets = case(rng, rows, in_f, out_f, b, k, jnp.bfloat16)
    decision = auto.decide_for_gpu(rows, in_f, out_f, jnp.bfloat16, k, b)
    f = jax.jit(lambda x, v: dd.diag_matmul(x, v, offsets, out_features=out_f))
    text = f.lower(x, values).compile().as_text()
    assert ("dynadiag_diag_matmul" in text) == (decision.impl == "ffi"), decision.reason
