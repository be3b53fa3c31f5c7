"""impl="auto": the decision from static facts per platform, and what a CUDA lowering contains."""

import re

import jax
import jax.numpy as jnp
import pytest

import dynadiag_jax as dd
from dynadiag_jax.ops import auto, ffi

VIT = 2048 * 197
BF16 = jnp.bfloat16


def decide(platform, in_f=768, out_f=3072, sparsity=0.9, b=1, available=True, dtype=BF16):
    k = dd.num_diagonals(in_f, out_f, sparsity, block_size=b)
    return auto.decide(
        platform,
        rows=VIT,
        in_features=in_f,
        out_features=out_f,
        dtype=dtype,
        num_diagonals=k,
        block_size=b,
        kernel_available=available,
    )


def test_cpu_runs_the_kernels_where_built_else_jax():
    assert decide("cpu").impl == "ffi"
    assert decide("cpu", available=False).impl == "jax"


@pytest.mark.parametrize("platform", ["tpu", "rocm"])
def test_platforms_without_kernels_build_w_and_call_the_dot(platform):
    d = decide(platform, b=16)
    assert d.impl == "dense" and platform in d.reason


def test_cuda_follows_the_cost_model():
    for in_f, out_f in [(768, 3072), (3072, 768), (768, 2304), (768, 768)]:
        d = decide("cuda", in_f, out_f)
        assert d.impl == "dense" and d.prediction is not None, (in_f, out_f, d.reason)
    assert decide("cuda", sparsity=0.9, b=16).impl == "ffi"
    assert decide("cuda", sparsity=0.9, b=32).impl == "ffi"
    assert decide("cuda", sparsity=0.5, b=16).impl == "dense"  # too many blocks to pay
    assert decide("cuda", b=16, available=False).impl == "dense"


def test_the_decision_never_picks_a_path_predicted_slower():
    for b in (1, 16, 32, 64):
        for s in (0.5, 0.8, 0.9, 0.95, 0.98):
            d = decide("cuda", sparsity=s, b=b)
            fwd, step = d.prediction.speedup("kernel", "dense")
            assert (d.impl == "ffi") == (fwd > 1 and step > 1), (b, s, d.reason)


def lowered_for_cuda(monkeypatch, values_shape, dtype=BF16, rows=VIT, in_f=768, out_f=3072):
    monkeypatch.setattr(ffi, "platform_of_default_backend", lambda: "cuda")
    x = jax.ShapeDtypeStruct((rows, in_f), dtype)
    v = jax.ShapeDtypeStruct(values_shape, dtype)
    o = jax.ShapeDtypeStruct((values_shape[0],), jnp.int32)

    def loss(x, v, o):
        y = dd.diag_matmul(x, v, o, out_features=out_f)
        return jnp.sum(y.astype(jnp.float32))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return grad.trace(x, v, o).lower(lowering_platforms=("cuda",)).as_text()


def test_cuda_lowering_of_scattered_element_diagonals_is_the_dense_dot(monkeypatch):
    k = dd.num_diagonals(768, 3072, 0.9)
    text = lowered_for_cuda(monkeypatch, (k, 768))
    assert "custom_call @dynadiag" not in text
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 3  # y, dx and dW
    # every dot multiplies bfloat16 operands (the backward does not fall back to float32 inputs)
    for d in dots:
        operands = re.search(r": \((tensor<[^>]*>), (tensor<[^>]*>)\)", d).groups()
        assert all(t.endswith("xbf16>") for t in operands), d


def test_cuda_lowering_of_block_diagonals_at_90_percent_calls_the_kernels(monkeypatch):
    if not dd.has_cuda_kernels():
        pytest.skip("CUDA targets not built (no nvcc at install time)")
    k = dd.num_diagonals(768, 3072, 0.9, block_size=16)
    text = lowered_for_cuda(monkeypatch, (k, 192, 16, 16))
    assert "stablehlo.dot_general" not in text
    for kind in ("fwd", "dx", "dvalues"):
        assert f"custom_call @dynadiag_diag_matmul_v2_{kind}(" in text, kind


@pytest.mark.parametrize("shape", [(5, 192), (2, 12, 16, 16)], ids=["element", "block"])
def test_dense_path_backward_runs_dots_in_the_input_dtype(shape):
    # The dense path's backward is dy @ W and dy^T x in bfloat16 (XLA sums in float32 inside),
    # never float32 GEMMs on bfloat16 data; and it stays differentiable in every mode.
    x = jnp.ones((8, 192), BF16)
    values = jnp.ones(shape, BF16)
    offsets = jnp.arange(shape[0], dtype=jnp.int32)

    def loss(x, v):
        return dd.diag_matmul(x, v, offsets, out_features=192, impl="dense").sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, values)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3, jaxpr
    for e in dots:
        assert [v.aval.dtype for v in e.invars] == [BF16, BF16], e
        assert e.outvars[0].aval.dtype == BF16, e
    jax.jvp(lambda x: loss(x, values), (x,), (x,))
