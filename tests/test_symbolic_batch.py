"""diag_matmul with a symbolic (shape-polymorphic) row count: one exported program for every batch.

Only the leading dimensions of ``x`` may be symbolic. Every impl that takes them is compared with
the pure-JAX reference at concrete row counts, forward and derivatives; ``impl="auto"`` follows
the rule of ``ops/auto.py`` for a symbolic row count; the CUDA kernels, whose workspaces are sized
for a concrete row count, are refused as an explicit impl and left for ``"dense"`` by ``"auto"``.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd
from dynadiag_jax import gpu_cost
from dynadiag_jax.layout import geometry
from dynadiag_jax.ops import auto

B, T = jax.export.symbolic_shape("b, t")
ROWS = (1, 3, 130)
# "ffi" takes symbolic rows where it lowers to the CPU kernels (the CUDA ones need concrete rows)
CPU_FFI = "ffi" in dd.available_impls() and auto.current_platform() == "cpu"
IMPLS = ["jax", "dense", "auto", *(["ffi"] if CPU_FFI else [])]
FORMS = {  # (in, out, block size, offsets)
    "tall": (8, 12, 1, (0, 5, 11)),
    "wide": (20, 12, 1, (3, 19)),
    "block": (32, 16, 8, (1, 0)),
}
F32_TOL = 2e-5


def _problem(form, rng, dtype=jnp.float32):
    in_f, out_f, b, offsets = FORMS[form]
    geo = geometry(in_f, out_f, b)
    values = rng.standard_normal((len(offsets), *geo.values_shape))
    return in_f, out_f, jnp.asarray(values, dtype), jnp.asarray(offsets, jnp.int32)


def _assert_close(got, want, what, tol=F32_TOL):
    got, want = (np.asarray(a, np.float64) for a in (got, want))
    scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=what)


def _restored(fun, *args, platforms=None):
    exported = dd.export(jax.jit(fun), platforms=platforms)(*args)
    return jax.export.deserialize(exported.serialize())


def _step(impl, out_f):
    """``(y, (dx, dvalues))`` of ``sum(sin(y))``."""

    def step(x, values, offsets):
        def loss(x, values):
            y = dd.diag_matmul(x, values, offsets, out_features=out_f, impl=impl)
            return jnp.sum(jnp.sin(y)), y

        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, values)
        return y, grads

    return step


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("impl", IMPLS)
def test_one_program_matches_the_reference_at_every_row_count(impl, form, rng):
    in_f, out_f, values, offsets = _problem(form, rng)
    spec = jax.ShapeDtypeStruct((B, in_f), jnp.float32)
    restored = _restored(_step(impl, out_f), spec, values, offsets)
    assert str(restored.out_avals[0].shape) == f"(b, {out_f})"
    for n in ROWS:
        x = jnp.asarray(rng.standard_normal((n, in_f)), jnp.float32)
        got = restored.call(x, values, offsets)
        want = _step("jax", out_f)(x, values, offsets)
        for g, w, what in zip(jax.tree.leaves(got), jax.tree.leaves(want), ("y", "dx", "dv")):
            _assert_close(g, w, f"{impl} {form} {n} rows: {what}")


@pytest.mark.parametrize("impl", IMPLS)
def test_several_symbolic_leading_dimensions(impl, rng):
    in_f, out_f, values, offsets = _problem("block", rng)
    spec = jax.ShapeDtypeStruct((B, T, in_f), jnp.float32)
    restored = _restored(_step(impl, out_f), spec, values, offsets)
    assert str(restored.out_avals[0].shape) == f"(b, t, {out_f})"
    for lead in ((1, 1), (3, 7), (130, 2)):
        x = jnp.asarray(rng.standard_normal((*lead, in_f)), jnp.float32)
        got = restored.call(x, values, offsets)
        want = _step("jax", out_f)(x, values, offsets)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            _assert_close(g, w, f"{impl} {lead}")


def _transformed(impl, offsets, out_f):
    """Forward mode, grad of grad and vmap (of rows, and of values) of the product."""

    def f(x, v):
        return dd.diag_matmul(x, v, offsets, out_features=out_f, impl=impl)

    def jvp(x, v):
        return jax.jvp(f, (x, v), (jnp.cos(x), jnp.sin(v)))

    def grad_of_grad(x, v):
        inner = jax.grad(lambda x, v: jnp.sum(jnp.sin(f(x, v))), argnums=(0, 1))
        return jax.grad(lambda x, v: sum(jnp.sum(g**2) for g in inner(x, v)))(x, v)

    def mapped(xs, vs):  # xs[2, rows, in], vs[2, K, D]
        return jax.vmap(f, in_axes=(0, None))(xs, vs[0]), jax.vmap(f, in_axes=(None, 0))(xs[0], vs)

    return {"jvp": (jvp, False), "grad_of_grad": (grad_of_grad, False), "vmap": (mapped, True)}


@pytest.mark.parametrize("impl", IMPLS)
def test_forward_mode_grad_of_grad_and_vmap(impl, rng):
    in_f, out_f, values, offsets = _problem("tall", rng)
    want = _transformed("jax", offsets, out_f)
    for name, (fun, stacked) in _transformed(impl, offsets, out_f).items():
        lead = (2,) if stacked else ()
        v = jnp.stack([values, 2 * values]) if stacked else values
        restored = _restored(fun, jax.ShapeDtypeStruct((*lead, B, in_f), jnp.float32), v)
        for n in (1, 130):
            x = jnp.asarray(rng.standard_normal((*lead, n, in_f)), jnp.float32)
            got, expected = restored.call(x, v), want[name][0](x, v)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
                _assert_close(g, w, f"{impl} {name} {n} rows")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_low_precision_gives_what_a_concrete_batch_gives(impl, dtype, rng):
    in_f, out_f, values, offsets = _problem("block", rng, dtype)
    step = _step(impl, out_f)
    restored = _restored(step, jax.ShapeDtypeStruct((B, in_f), dtype), values, offsets)
    tol = float(jnp.finfo(dtype).eps)
    for n in ROWS:
        x = jnp.asarray(rng.standard_normal((n, in_f)), dtype)
        got, want = restored.call(x, values, offsets), jax.jit(step)(x, values, offsets)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            _assert_close(g, w, f"{impl} {jnp.dtype(dtype).name} {n} rows", tol)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("impl", IMPLS)
def test_a_traced_offset_out_of_range_poisons_as_with_concrete_rows(impl, form, rng):
    in_f, out_f, values, offsets = _problem(form, rng)
    bad = offsets.at[0].set(geometry(in_f, out_f, FORMS[form][2]).num_candidates)
    w = jnp.asarray(rng.standard_normal((out_f,)), jnp.float32)

    def step(x, values, offsets):
        def loss(x, values):
            y = dd.diag_matmul(x, values, offsets, out_features=out_f, impl=impl)
            return jnp.sum(y * w[None]), y

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(x, values)

    restored = _restored(step, jax.ShapeDtypeStruct((B, in_f), jnp.float32), values, bad)
    for n in (1, 130):
        x = jnp.asarray(rng.standard_normal((n, in_f)), jnp.float32)
        (dx, dv), y = restored.call(x, values, bad)
        assert np.all(np.isnan(y)) and np.all(np.isnan(dx)), f"{impl} {n} rows"
        assert np.all(np.isnan(dv[0])), f"{impl} {n} rows: the bad offset's dvalues"
        # the other rows: what the same call with the bad offset at 0 gives
        (_, want), _ = jax.jit(step)(x, values, bad.at[0].set(0))
        _assert_close(dv[1:], want[1:], f"{impl} {n} rows: good dvalues")


# --- impl="auto" -----------------------------------------------------------------------------


def _decisions(platform, rows, in_f, out_f, k, b, available):
    shape = {"in_features": in_f, "out_features": out_f, "num_diagonals": k, "block_size": b}
    spec = gpu_cost.DEVICES[gpu_cost.DEFAULT_DEVICE]
    return auto.decide(
        platform, rows=rows, dtype=jnp.bfloat16, kernel_available=available, spec=spec, **shape
    )


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
def test_auto_takes_a_sparse_path_for_symbolic_rows_only_where_both_ends_do(platform):
    seen = set()
    for in_f, out_f, b in ((768, 3072, 1), (768, 3072, 16), (1024, 1024, 64), (96, 48, 1)):
        p = geometry(in_f, out_f, b).num_candidates
        for k in sorted({1, max(1, p // 50), p // 4, (3 * p) // 4, p}):
            for available in (True, False):
                ends = [
                    _decisions(platform, r, in_f, out_f, k, b, available).impl
                    for r in auto.SYMBOLIC_ROWS
                ]
                got = _decisions(platform, None, in_f, out_f, k, b, available)
                want = ends[0] if ends[0] == ends[1] else "dense"
                if platform == "cuda" and available:
                    want = "dense"  # its workspaces are sized for concrete rows
                assert got.impl == want, (in_f, out_f, b, k, available, ends, got)
                assert "symbolic row count" in got.reason
                seen.add((got.impl, ends[0] == ends[1]))
    expected = {
        "cpu": {("ffi", True), ("jax", True), ("dense", False)},  # dense past 75% density
        "cuda": {("dense", True), ("dense", False)},
        "tpu": {("dense", True)},
    }[platform]
    assert expected <= seen, seen


def test_auto_on_cpu_keeps_the_kernels_for_a_symbolic_batch(rng):
    in_f, out_f, values, offsets = _problem("wide", rng)
    spec = jax.ShapeDtypeStruct((B, in_f), jnp.float32)
    exported = dd.export(jax.jit(_step("auto", out_f)), platforms=("cpu",))(spec, values, offsets)
    targets = set(re.findall(r"custom_call @(dynadiag\w+)\(", exported.mlir_module()))
    if dd.has_cpu_kernels():
        assert {"dynadiag_diag_matmul_v2_fwd", "dynadiag_diag_matmul_v2_bwd"} <= targets
    # element diagonals at every candidate: "dense" on CPU from 1024 rows, so "dense" for any
    dense = jnp.asarray(rng.standard_normal((20, 12)), jnp.float32)
    every = jnp.arange(20, dtype=jnp.int32)
    exported = dd.export(jax.jit(_step("auto", out_f)), platforms=("cpu",))(spec, dense, every)
    assert not re.search(r"custom_call @dynadiag", exported.mlir_module())


# --- CUDA: lowered here, never run ------------------------------------------------------------

needs_cuda_targets = pytest.mark.skipif(
    not dd.has_cuda_kernels(), reason="CUDA targets not built (no nvcc at install time)"
)


def _block_model(impl):
    def model(x, values, offsets):
        return jnp.tanh(dd.diag_matmul(x, values, offsets, out_features=16, impl=impl))

    return model


def test_auto_exports_for_cpu_and_cuda_with_a_symbolic_batch(rng):
    _, out_f, values, offsets = _problem("block", rng)
    spec = jax.ShapeDtypeStruct((B, 32), jnp.float32)
    cuda_only = dd.export(jax.jit(_step("auto", out_f)), platforms=("cuda",))(spec, values, offsets)
    assert not re.search(r"custom_call @dynadiag", cuda_only.mlir_module())  # "dense"
    restored = _restored(_step("auto", out_f), spec, values, offsets, platforms=("cpu", "cuda"))
    assert restored.platforms == ("cpu", "cuda")
    for n in ROWS:
        x = jnp.asarray(rng.standard_normal((n, 32)), jnp.float32)
        got, want = restored.call(x, values, offsets), _step("jax", out_f)(x, values, offsets)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            _assert_close(g, w, f"{n} rows")


@pytest.mark.parametrize(
    "impl,platforms",
    [
        pytest.param("ffi", ("cuda",), marks=needs_cuda_targets),
        pytest.param("ffi", ("cpu", "cuda"), marks=needs_cuda_targets),
        pytest.param(
            "cuda_emulated",
            None,
            marks=pytest.mark.skipif(
                "cuda_emulated" not in dd.available_impls(), reason="no CUDA emulation built"
            ),
        ),
    ],
)
def test_an_explicit_cuda_impl_refuses_a_symbolic_batch(impl, platforms, rng):
    _, out_f, values, offsets = _problem("block", rng)
    spec = jax.ShapeDtypeStruct((B, 32), jnp.float32)
    with pytest.raises(
        ValueError,
        match=r"the CUDA kernels' dynadiag_(emu_)?diag_matmul_v2_fwd needs a concrete number of "
        r"rows.*symbolic shape \(b, 32\); impl='auto' takes 'dense' on CUDA",
    ):
        dd.export(jax.jit(_block_model(impl)), platforms=platforms)(spec, values, offsets)
