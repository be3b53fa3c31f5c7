"""CompileAhead: a program compiled on the worker thread is found by the real call's jit cache."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from training_helpers import CompileCounter

from dynadiag_jax.training.ahead import CompileAhead


def _program():
    # a fresh function each time: nothing compiled by another test can be found in the cache
    # donating x as the training step donates its state
    return jax.jit(lambda x, y: {"x": jnp.sin(x) + jnp.sum(y), "n": jnp.sum(y)}, donate_argnums=0)


def test_a_program_compiled_ahead_is_not_compiled_again_by_its_first_call():
    fn = _program()
    x, y = jnp.ones((8, 4), jnp.float32), jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3)
    with CompileAhead() as ahead:
        ahead.submit("f", fn, jax.ShapeDtypeStruct(x.shape, x.dtype), lambda: y)
        assert ahead.pending() == ("f",)
        ahead.wait("f")
        assert ahead.pending() == ()
        with CompileCounter() as seen:
            out = fn(x, y)
    assert seen.on_caller == []
    np.testing.assert_allclose(out["x"], np.sin(np.ones((8, 4))) + 66.0, rtol=1e-6)


def test_the_sharding_of_an_abstract_argument_must_match_the_array_it_stands_for():
    # A committed array's sharding is part of jit's key: an abstract argument without it
    # compiles a program the real call does not find.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec())
    x = jax.device_put(jnp.ones((8, 4), jnp.float32), sharding)
    y = jax.device_put(jnp.ones((4, 3), jnp.float32), sharding)
    for with_sharding, compiles in ((False, 1), (True, 0)):
        fn = _program()
        kw = dict(sharding=sharding) if with_sharding else {}
        abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, **kw) for a in (x, y)]
        with CompileAhead() as ahead:
            ahead.submit("f", fn, *abstract)
            ahead.wait("f")
        copy = jnp.array(x, device=sharding)  # x is donated
        with CompileCounter() as seen:
            fn(copy, y)
        assert len(seen.on_caller) == compiles, with_sharding


def test_a_failing_compile_is_left_to_the_real_call_to_raise():
    fn = jax.jit(lambda x: x @ x)  # a (2, 3) operand cannot be multiplied by itself
    x = jnp.ones((2, 3), jnp.float32)
    with CompileAhead() as ahead:
        ahead.submit("bad", fn, x)
        ahead.wait("bad")
        with pytest.raises(TypeError, match="dot_general"):
            fn(x)


def test_a_name_pending_is_not_submitted_twice_and_waiting_twice_or_for_nothing_is_a_no_op():
    calls = []

    def counted():
        calls.append(1)
        return jnp.ones((2,), jnp.float32)

    fn = jax.jit(jnp.sin)
    with CompileAhead() as ahead:
        ahead.submit("f", fn, counted)
        ahead.submit("f", fn, counted)
        assert ahead.pending() == ("f",)
        ahead.wait("f")
        assert calls == [1]
        ahead.wait("f")
        ahead.wait("never submitted")
        ahead.submit("f", fn, counted)  # submitted again once waited for
        ahead.wait("f")
    assert calls == [1, 1]


def _blocking_argument():
    """``(started, release, fn)``: an argument builder that holds a compile on the worker thread
    (``started`` set) until ``release`` is set."""
    started, release = threading.Event(), threading.Event()

    def blocking():
        started.set()
        release.wait(10)
        return jnp.ones((2,), jnp.float32)

    return started, release, blocking


def test_close_drops_the_compiles_not_started():
    started, release, blocking = _blocking_argument()
    calls = []

    def counted():
        calls.append(1)
        return jnp.ones((2,), jnp.float32)

    ahead = CompileAhead()
    ahead.submit("first", jax.jit(jnp.sin), blocking)
    ahead.submit("second", jax.jit(jnp.cos), counted)
    assert started.wait(10)
    closer = threading.Thread(target=ahead.close)
    closer.start()
    release.set()
    closer.join(10)
    assert not closer.is_alive()
    assert ahead.pending() == ()
    assert calls == []


def test_busy_since_says_whether_a_compile_ran_in_an_interval():
    started, release, blocking = _blocking_argument()

    times = iter([5.0])  # the clock read when the compile ends
    with CompileAhead(clock=lambda: next(times)) as ahead:
        assert not ahead.busy_since(-1e9)  # nothing has run
        ahead.submit("f", jax.jit(jnp.sin), blocking)
        assert started.wait(10)
        assert ahead.busy_since(1e9)  # running now: any interval up to now saw it
        release.set()
        ahead.wait("f")
        assert ahead.busy_since(4.0)  # it ended at 5.0, inside an interval begun at 4.0
        assert not ahead.busy_since(5.0)  # an interval begun when it ended saw nothing


def test_close_without_waiting_leaves_the_running_compile_to_finish_on_its_own():
    """What an interrupt does: a compile can take minutes, and XLA cannot cancel it."""
    started, release, blocking = _blocking_argument()

    ahead = CompileAhead()
    ahead.submit("slow", jax.jit(jnp.sin), blocking)
    assert started.wait(10)
    closer = threading.Thread(target=ahead.close, kwargs={"wait": False})
    closer.start()
    closer.join(5)
    assert not closer.is_alive() and ahead.pending() == ()
    ahead.close()  # a second close is a no-op: it does not wait either
    assert not release.is_set()
    release.set()
