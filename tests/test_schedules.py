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
    with pytest.raises(ValueError, match=r"steps must be in \[1, 2147483647\], got 0"):
        schedules.linear(1.0, 0.0, 0)
    for make in (schedules.linear, schedules.cosine, schedules.exponential):
        # the schedule compares steps with it inside jit, as an int32 (it failed at the call)
        with pytest.raises(ValueError, match=r"steps must be in \[1, 2147483647\], got 2147483648"):
            make(1.0, 0.5, 2**31)
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


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: schedules.constant(1e39), "value"),
        (lambda: schedules.linear(1e39, 0.0, 10), "init_value"),
        (lambda: schedules.cosine(0.0, -1e39, 10), "end_value"),
        (lambda: schedules.exponential(1e-300, 1e300, 10), "end_value"),
        (lambda: schedules.warmup_cosine(0.0, 4e38, 0.0, 2, 10), "peak_value"),
    ],
)
def test_values_beyond_float32_are_refused_by_name(make, name):
    with pytest.raises(ValueError, match=f"{name} must be finite in float32"):
        make()


def test_an_int_beyond_float_is_refused_by_name():
    """It raised Python's OverflowError: int too large to convert to float."""
    with pytest.raises(ValueError, match="value must be a finite number"):
        schedules.constant(10**400)
    with pytest.raises(ValueError, match="search_fraction must be a finite number"):
        schedules.freeze_step(10, search_fraction=10**400)


@pytest.mark.parametrize("init, end", [(1e-60, 1.0), (1.0, 1e-40)])
def test_exponential_refuses_values_below_float32_normals(init, end):
    name = "init_value" if init < end else "end_value"
    with pytest.raises(ValueError, match=f"exponential needs {name} > 0, at least"):
        schedules.exponential(init, end, 10)


F32_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize(
    "schedule, init, end",
    [
        (schedules.linear(-F32_MAX, F32_MAX, 10), -F32_MAX, F32_MAX),
        (schedules.cosine(3e38, -3e38, 10), 3e38, -3e38),
        (schedules.exponential(1e-30, 1e10, 10), 1e-30, 1e10),
        (schedules.exponential(F32_MAX, 1.2e-38, 10), F32_MAX, 1.2e-38),
        (schedules.exponential(1.2e-38, F32_MAX, 7), 1.2e-38, F32_MAX),
        (schedules.warmup_cosine(0.0, 3e38, -3e38, 3, 10), -3e38, 3e38),
    ],
)
@pytest.mark.parametrize("jit", [False, True])
def test_extreme_accepted_values_stay_finite_between_the_ends(schedule, init, end, jit):
    v = values(jax.jit(schedule) if jit else schedule, np.arange(-2, 14))
    assert np.all(np.isfinite(v))
    assert np.all(v >= np.float32(min(init, end))) and np.all(v <= np.float32(max(init, end)))


@pytest.mark.parametrize("name", ["linear", "cosine", "exponential"])
@pytest.mark.parametrize("jit", [False, True])
def test_the_end_value_is_held_exactly(name, jit):
    s = schedules.by_name(name, init_value=1.0, end_value=0.1, steps=8)
    s = jax.jit(s) if jit else s
    np.testing.assert_array_equal(values(s, [8, 9, 10**6]), np.float32(0.1))
    assert float(jax.jit(schedules.linear(1.0, 0.0, 10))(10)) == 0.0


@pytest.mark.parametrize(
    "step",
    [np.int64(2**32 + 3), 2**70, np.uint64(2**63), np.array([2**40, 2**32 + 3]), [2**33]],
)
def test_steps_beyond_int32_hold_the_end_value(step):
    out = np.asarray(schedules.cosine(1.0, 0.0, 10)(step))
    assert out.shape == np.shape(step)
    np.testing.assert_array_equal(out, 0.0)


def test_steps_before_zero_give_the_init_value():
    np.testing.assert_array_equal(schedules.cosine(1.0, 0.0, 10)(np.int64(-(2**40))), 1.0)
    np.testing.assert_array_equal(values(schedules.linear(2.0, 0.0, 10), [-3]), 2.0)


@pytest.mark.parametrize("step", [None, "3", 3.0, True, np.array([1.5]), jnp.float32(2)])
def test_a_step_that_is_not_an_integer_is_refused(step):
    with pytest.raises(TypeError, match="step must be an integer"):
        schedules.linear(1.0, 0.0, 10)(step)
    with pytest.raises(TypeError, match="step must be an integer"):
        schedules.constant(1.0)(step)


def test_a_traced_float_step_is_refused():
    with pytest.raises(TypeError, match="step must be an integer .* dtype float32"):
        jax.jit(schedules.cosine(1.0, 0.0, 10))(jnp.float32(3))
