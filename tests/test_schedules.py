"""Schedules step -> value and the freeze step."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynadiag_jax import schedules

TOL = 1e-6


def values(schedule, steps):
    return np.asarray(jax.vmap(schedule)(jnp.asarray(steps)))


def test_constant():
    np.testing.assert_allclose(values(schedules.constant(0.3), [0, 5, 10**6]), 0.3, rtol=TOL)


@pytest.mark.parametrize("name", ["linear", "cosine", "exponential"])
def test_endpoints_monotone_and_hold(name):
    s = schedules.by_name(name, init_value=5.0, end_value=0.05, steps=100)
    v = values(s, np.arange(0, 150))
    assert v[0] == pytest.approx(5.0, rel=TOL) and v[100] == pytest.approx(0.05, rel=1e-5)
    assert np.all(np.diff(v) <= 1e-6)
    np.testing.assert_allclose(v[100:], 0.05, rtol=1e-5)


def test_midpoints():
    assert float(schedules.linear(1.0, 3.0, 10)(5)) == pytest.approx(2.0)
    assert float(schedules.cosine(1.0, 3.0, 10)(5)) == pytest.approx(2.0)
    assert float(schedules.cosine(0.0, 1.0, 10)(2)) == pytest.approx(
        0.5 * (1 - math.cos(math.pi * 0.2)), rel=1e-5
    )
    assert float(schedules.exponential(5.0, 0.05, 10)(5)) == pytest.approx(
        math.sqrt(0.25), rel=1e-5
    )


def test_warmup_cosine():
    s = schedules.warmup_cosine(0.0, 1.0, 0.1, warmup_steps=10, steps=110)
    assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5)
    assert float(s(10)) == pytest.approx(1.0) and float(s(60)) == pytest.approx(0.55, rel=1e-5)
    assert float(s(110)) == pytest.approx(0.1, rel=1e-5) and float(s(500)) == pytest.approx(0.1)
    no_warmup = schedules.warmup_cosine(0.0, 1.0, 0.1, warmup_steps=0, steps=10)
    assert float(no_warmup(0)) == pytest.approx(1.0)


def test_jittable_with_traced_step_and_dtype():
    s = schedules.cosine(5.0, 0.05, 30)
    out = jax.jit(s)(jnp.int32(7))
    assert out.dtype == jnp.float32 and out.shape == ()
    assert float(out) == pytest.approx(float(s(7)))


def test_freeze_step():
    assert schedules.freeze_step(1000, search_fraction=0.3) == 300
    assert schedules.freeze_step(7, search_fraction=0.0) == 0
    assert schedules.freeze_step(7, search_fraction=1.0) == 7


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown schedule"):
        schedules.by_name("step", init_value=1.0)
    with pytest.raises(TypeError, match="end_value"):
        schedules.by_name("cosine", init_value=1.0)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        schedules.linear(1.0, 0.0, 0)
    with pytest.raises(TypeError, match="steps must be an int, got float"):
        schedules.linear(1.0, 0.0, 10.0)
    with pytest.raises(TypeError, match="init_value must be a number, got str"):
        schedules.cosine("1", 0.0, 10)
    with pytest.raises(ValueError, match="end_value > 0"):
        schedules.exponential(1.0, 0.0, 10)
    with pytest.raises(ValueError, match="finite number"):
        schedules.constant(float("nan"))
    with pytest.raises(ValueError, match="warmup_steps"):
        schedules.warmup_cosine(0.0, 1.0, 0.0, warmup_steps=10, steps=10)
    with pytest.raises(ValueError, match="search_fraction"):
        schedules.freeze_step(100, search_fraction=1.5)
