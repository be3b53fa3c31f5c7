"""Every autodiff mode and order of diag_matmul runs through the sparse products.

diag_matmul is bilinear in x and values; its primitives carry JVP and transpose rules, so jvp,
jacfwd, jacrev, hessian and grad of grad work for every impl, element and block diagonals, and
none of them builds a dense W.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import dynadiag_jax as dd

# (in, out, block size): element tall and wide, block tall and wide
FORMS = [(5, 8, 1), (8, 5, 1), (8, 16, 8), (16, 8, 8)]
CASES = [
    (impl, *form)
    for form in FORMS
    for impl in dd.available_impls(block_size=form[2])
    if impl not in ("auto", "dense")
]


# exact comparisons with the dense impl: element tall and block wide
JAC_CASES = [c for c in CASES if c[1:] in (FORMS[0], FORMS[3])]


def make_case(rng, in_f, out_f, b, dtype, k=3):
    p = max(in_f, out_f) if b == 1 else min(in_f, out_f) // b
    vshape = (k, min(in_f, out_f)) if b == 1 else (k, max(in_f, out_f) // b, b, b)
    x = jnp.asarray(rng.standard_normal((2, in_f)), dtype)
    values = jnp.asarray(rng.standard_normal(vshape) / np.sqrt(k * b), dtype)
    offsets = jnp.asarray(np.concatenate([rng.integers(0, p, k - 1), [0]]), jnp.int32)
    return x, values, offsets


def ids(case):
    impl, in_f, out_f, b = case
    return f"{impl}-{in_f}x{out_f}-b{b}"


@pytest.mark.parametrize("impl,in_f,out_f,b", CASES, ids=map(ids, CASES))
def test_check_grads_second_order_forward_and_reverse(impl, in_f, out_f, b, rng):
    float64 = impl == "jax"  # the kernels run float32 and bfloat16 only
    with jax.enable_x64(float64):
        x, values, offsets = make_case(rng, in_f, out_f, b, jnp.float64 if float64 else jnp.float32)

        def f(x, v):
            return jnp.sin(dd.diag_matmul(x, v, offsets, out_features=out_f, impl=impl))

        tol = {} if float64 else dict(eps=1e-3, atol=1e-2, rtol=1e-2)
        check_grads(f, (x, values), order=2, modes=("fwd", "rev"), **tol)


@pytest.mark.parametrize("impl,in_f,out_f,b", JAC_CASES, ids=map(ids, JAC_CASES))
def test_jacfwd_hessian_and_grad_of_grad_match_dense(impl, in_f, out_f, b, rng):
    x, values, offsets = make_case(rng, in_f, out_f, b, jnp.float32)

    def y(impl, x, v):
        return jnp.sin(dd.diag_matmul(x, v, offsets, out_features=out_f, impl=impl))

    def f(impl, x, v):
        return jnp.sum(y(impl, x, v))

    def transforms(impl):
        def grad_of_grad(x, v):
            return jnp.sum(jax.grad(f, argnums=(1, 2))(impl, x, v)[0] ** 2)

        fns = {
            "jacfwd": jax.jacfwd(lambda x, v: y(impl, x, v), argnums=(0, 1)),
            "hessian": jax.hessian(lambda x, v: f(impl, x, v), argnums=(0, 1)),
            "grad of grad": jax.grad(grad_of_grad, argnums=(0, 1)),
        }
        return {name: jax.jit(fn)(x, values) for name, fn in fns.items()}

    got, expected = transforms(impl), transforms("dense")
    for name in got:
        for a, e in zip(jax.tree.leaves(got[name]), jax.tree.leaves(expected[name])):
            np.testing.assert_allclose(a, e, atol=2e-5, rtol=2e-5, err_msg=f"{impl} {name}")


def dense_shapes(jaxpr_text, in_f, out_f):
    """Array types of shape [out, in] or [in, out] in a jaxpr's text."""
    return re.findall(rf"\[(?:{out_f},{in_f}|{in_f},{out_f})\]", jaxpr_text)


@pytest.mark.parametrize(
    "impl", ["jax", *[i for i in dd.available_impls() if i not in ("auto", "dense", "jax")]]
)
@pytest.mark.parametrize("in_f,out_f,b", [(16, 48, 1), (48, 16, 8)])
def test_no_dense_matrix_in_any_derivative(impl, in_f, out_f, b, rng):
    if impl not in dd.available_impls(block_size=b):
        pytest.skip(f"{impl} does not run b = {b} here")
    x, values, offsets = make_case(rng, in_f, out_f, b, jnp.float32)
    x = jnp.ones((7, in_f), jnp.float32)  # batch 7: no [in, out] shape can hide in the rows

    def f(x, v):
        return jnp.sum(jnp.sin(dd.diag_matmul(x, v, offsets, out_features=out_f, impl=impl)))

    derivatives = {
        "jit(grad)": jax.jit(jax.grad(f, argnums=(0, 1))),
        "jvp": lambda x, v: jax.jvp(f, (x, v), (x, v)),
        "hessian in values": lambda x, v: jax.hessian(f, argnums=1)(x, v),
        "grad of grad": jax.grad(lambda x, v: jnp.sum(jax.grad(f)(x, v) ** 2), argnums=(0, 1)),
    }
    for name, fn in derivatives.items():
        text = str(jax.make_jaxpr(fn)(x, values))
        assert "diag_matmul_" in text, name
        assert not dense_shapes(text, in_f, out_f), f"{impl} {name}: dense W in the jaxpr"
    # the dense impl does build W, when its products are lowered: the check above can fail
    text = (
        jax.jit(
            jax.grad(
                lambda x, v: jnp.sum(
                    dd.diag_matmul(x, v, offsets, out_features=out_f, impl="dense")
                )
            )
        )
        .lower(x, values)
        .as_text()
    )
    assert re.search(rf"tensor<{out_f}x{in_f}x", text)


def test_reverse_mode_uses_one_fused_backward_primitive(rng):
    x, values, offsets = make_case(rng, 8, 16, 1, jnp.float32)

    def loss(x, v):
        return jnp.sum(dd.diag_matmul(x, v, offsets, out_features=16, impl="jax") ** 2)

    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, values))
    assert text.count("diag_matmul_bwd") == 1
    assert "diag_matmul_dx" not in text and "diag_matmul_dvalues" not in text
    # only x: the dx product alone
    text = str(jax.make_jaxpr(jax.grad(loss))(x, values))
    assert "diag_matmul_dx" in text and "diag_matmul_bwd" not in text
