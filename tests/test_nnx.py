"""dd.nnx: the NNX layer over the linen layer's functional core, used as an NNX user would."""

import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx, traverse_util

import dynadiag_jax as dd


class MLP(nnx.Module):
    def __init__(self, *, block_size=1, gate="sparse_topk", rngs):
        self.fc1 = dd.nnx.DiagonalDense(
            64, 128, sparsity=0.8, block_size=block_size, gate=gate, rngs=rngs
        )
        self.fc2 = nnx.Linear(128, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


def linen_variables(layer):
    """The linen layer's variables holding the NNX layer's values (same names)."""
    params = {
        n: getattr(layer, n).get_value() for n in ("alpha", "values", "bias") if hasattr(layer, n)
    }
    variables = {"params": params, "diagonals": {"in_features": layer.in_features.get_value()}}
    if layer.frozen:
        variables["diagonals"]["offsets"] = layer.offsets.get_value()
    else:
        name = layer.spec.hyper_name
        variables["dynadiag"] = {
            name: getattr(layer, name).get_value(),
            "topk": layer.topk.get_value(),
            "score": layer.score.get_value(),
        }
    return variables


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (64, 64)], ids=["tall", "wide", "square"])
def test_same_numbers_as_the_linen_layer_in_both_phases(block_size, shape):
    n_in, n_out = shape
    layer = dd.nnx.DiagonalDense(n_in, n_out, sparsity=0.8, block_size=block_size, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (5, n_in))
    linen = dd.nn.DiagonalDense(n_out, sparsity=0.8, block_size=block_size)
    np.testing.assert_allclose(
        layer(x, strength=0.3), linen.apply(linen_variables(layer), x, strength=0.3), rtol=1e-6
    )
    frozen_layer = dd.nnx.freeze(layer)
    assert frozen_layer.frozen and not layer.frozen
    k = dd.num_diagonals(n_in, n_out, 0.8, block_size=block_size)
    assert (
        frozen_layer.values.get_value().shape[0] == k == frozen_layer.offsets.get_value().shape[0]
    )
    np.testing.assert_array_equal(
        frozen_layer.offsets.get_value(), dd.select_diagonals(layer.alpha.get_value(), k)
    )
    np.testing.assert_allclose(
        frozen_layer(x), linen.apply(linen_variables(frozen_layer), x), rtol=1e-6
    )
    # at a strength of 0 the search-phase gate is the hard top-K: the frozen layer's product
    np.testing.assert_allclose(layer(x, strength=0.0), frozen_layer(x), rtol=1e-5, atol=1e-6)


@pytest.fixture
def standard_promotion():
    # nnx.Optimizer hands optax's Adam its count as int32 beside float hyper-parameters, which the
    # suite's strict promotion rejects inside optax (not in our code).
    with jax.numpy_dtype_promotion("standard"):
        yield


def test_train_with_nnx_jit_grad_optimizer_then_freeze_and_continue(standard_promotion):
    model = MLP(rngs=nnx.Rngs(0))
    teacher = MLP(rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (32, 64))
    y = teacher(x)
    strength = dd.schedules.exponential(1.0, 1e-3, 60)
    optimizer = nnx.Optimizer(
        model, dd.optim.diag_optimizer(1e-2, alpha_learning_rate=1e-2), wrt=nnx.Param
    )

    @nnx.jit
    def step(model, optimizer, i):
        dd.nnx.set_gate(model, strength=strength(i))

        def loss(model):
            return jnp.mean((model(x) - y) ** 2)

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    losses = [float(step(model, optimizer, i)) for i in range(60)]
    assert all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses
    assert float(model.fc1.strength.get_value()) == pytest.approx(float(strength(59)), rel=1e-5)
    np.testing.assert_array_equal(  # topk follows alpha on every call
        model.fc1.topk.get_value(),
        dd.select_diagonals(model.fc1.alpha.get_value(), model.fc1.spec.k),
    )
    frozen = dd.nnx.freeze(model)
    frozen_opt = nnx.Optimizer(frozen, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def frozen_step(model, optimizer):
        value, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return value

    first = float(frozen_step(frozen, frozen_opt))
    for _ in range(10):
        last = float(frozen_step(frozen, frozen_opt))
    assert np.isfinite(first) and last < first


@pytest.mark.parametrize("phase", ["search", "frozen"])
def test_orbax_round_trip_of_nnx_state(tmp_path, phase):
    def make():
        m = MLP(block_size=16, rngs=nnx.Rngs(0))
        return dd.nnx.freeze(m) if phase == "frozen" else m

    model = make()
    if phase == "search":
        dd.nnx.set_gate(model, strength=0.25)
    x = jax.random.normal(jax.random.key(3), (4, 64))
    expected = model(x)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", nnx.state(model))
    abstract = nnx.eval_shape(lambda: MLP(block_size=16, rngs=nnx.Rngs(9)))
    if phase == "frozen":  # the README's form (freezing abstract state used to raise)
        abstract = dd.nnx.freeze(abstract)
    graphdef, abstract_state = nnx.split(abstract)
    with ocp.StandardCheckpointer() as ckpt:
        state = ckpt.restore(tmp_path / "ckpt", abstract_state)
    restored = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(restored(x), expected)
    if phase == "search":
        assert float(restored.fc1.strength.get_value()) == 0.25


def test_set_gate_errors_name_the_gates_present():
    model = MLP(gate="softmax", rngs=nnx.Rngs(0))
    with pytest.raises(
        ValueError, match=r"set_gate\(strength=...\) matches no layer.*temperature="
    ):
        dd.nnx.set_gate(model, strength=0.5)
    dd.nnx.set_gate(model, temperature=0.5)
    assert float(model.fc1.temperature.get_value()) == 0.5
    with pytest.raises(ValueError, match="no layer.*none"):
        dd.nnx.set_gate(dd.nnx.freeze(model), temperature=0.5)
    with pytest.raises(ValueError, match="needs strength="):
        dd.nnx.set_gate(model)
    with pytest.raises(ValueError, match="temperature"):
        dd.nnx.set_gate(model, temperature=-1.0)


def test_errors_name_the_argument():
    layer = dd.nnx.DiagonalDense(64, 32, sparsity=0.9, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="x has width 63, the layer expects 64"):
        layer(jnp.ones((2, 63)))
    with pytest.raises(ValueError, match="takes strength="):
        layer(jnp.ones((2, 64)), temperature=1.0)
    with pytest.raises(ValueError, match="block_size must be 1"):
        dd.nnx.DiagonalDense(64, 32, sparsity=0.9, block_size=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="divide"):
        dd.nnx.DiagonalDense(72, 32, sparsity=0.9, block_size=16, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="sparsity"):
        dd.nnx.DiagonalDense(64, 32, sparsity=1.5, rngs=nnx.Rngs(0))
    model = MLP(rngs=nnx.Rngs(0))
    model.fc1.alpha.set_value(model.fc1.alpha.get_value().at[3].set(jnp.nan))
    with pytest.raises(ValueError, match="fc1.*non-finite"):
        dd.nnx.freeze(model)
    # Inside nnx.jit alpha cannot be read: the layer's frozen values are NaN.
    frozen = nnx.jit(dd.nnx.freeze)(model)
    assert np.all(np.isnan(frozen.fc1.values.get_value()))
    assert np.all(np.isnan(frozen(jnp.ones((2, 64)))))


def test_a_traced_nan_strength_gives_nan_outputs():
    """Eagerly a NaN strength raises; inside nnx.jit the outputs are NaN."""
    model = MLP(rngs=nnx.Rngs(0))
    x = jnp.ones((2, 64))
    with pytest.raises(ValueError, match="strength must be >= 0"):
        dd.nnx.set_gate(model, strength=float("nan"))

    @nnx.jit
    def run(model, strength):
        dd.nnx.set_gate(model, strength=strength)
        return model(x)

    assert np.all(np.isnan(run(model, jnp.nan)))
    assert np.all(np.isfinite(run(model, -1.0)))  # a traced negative strength acts as 0
    np.testing.assert_array_equal(run(model, -1.0), run(model, 0.0))


def test_freeze_opt_state_carries_the_optimizer_over(standard_promotion):
    """The README once made a fresh optimizer after dd.nnx.freeze and lost Adam's
    moments; dd.nnx.freeze_opt_state keeps them (the kept diagonals' rows) and the step count."""
    model = MLP(rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (16, 64))
    tx = dd.optim.diag_optimizer(1e-2, alpha_learning_rate=1e-2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)

    for _ in range(3):
        step(model, optimizer)
    frozen = dd.nnx.freeze(model)
    continued = dd.nnx.freeze_opt_state(optimizer, model, frozen)
    old = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(optimizer)))
    new = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(continued)))
    offsets = np.asarray(frozen.fc1.offsets.get_value())
    assert set(new) == {path for path in old if path[-1] != "alpha"}
    moments = 0
    for path, value in new.items():
        if path[-2:] == ("fc1", "values") and hasattr(value, "shape"):
            np.testing.assert_array_equal(value, np.asarray(old[path])[offsets])
            moments += 1
        else:
            np.testing.assert_array_equal(np.asarray(value), np.asarray(old[path]), str(path))
    assert moments == 2 and int(new[("step",)]) == 3  # Adam's mu and nu
    step(frozen, continued)  # and training goes on
    assert int(continued.step.get_value()) == 4 and int(optimizer.step.get_value()) == 3


def test_static_diagonals_and_lazy_import():
    import importlib
    import sys

    sys.modules.pop("dynadiag_jax.nnx", None)
    fresh = importlib.reload(importlib.import_module("dynadiag_jax"))
    assert "dynadiag_jax.nnx" not in sys.modules
    layer = fresh.nnx.DiagonalDense(64, 64, k=3, init_phase="frozen", rngs=nnx.Rngs(0))
    assert layer.frozen and layer.offsets.get_value().shape == (3,)
    assert len(set(np.asarray(layer.offsets.get_value()).tolist())) == 3


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_buckets=0), ValueError, "num_buckets must be >= 1, got 0"),
        (dict(num_buckets=-3), ValueError, "num_buckets must be >= 1, got -3"),
        (dict(num_buckets=2.5), TypeError, "num_buckets must be an int, got float"),
        (dict(rngs=None), TypeError, "rngs must be an nnx.Rngs.*got NoneType"),
    ],
)
def test_constructor_checks_num_buckets_and_rngs(kwargs, error, match):
    """num_buckets 0 and -3 were accepted and 2.5 truncated (the linen layer raised); rngs=None
    gave an AttributeError."""
    kwargs = {"rngs": nnx.Rngs(0), **kwargs}
    with pytest.raises(error, match=match):
        dd.nnx.DiagonalDense(16, 32, sparsity=0.5, **kwargs)


def test_a_state_of_the_other_phase_names_the_layer():
    """A search-phase state loaded into a frozen layer failed in diag_matmul with "offsets must
    have shape [K] = [32] to match values (32, 16)", naming no layer."""
    layer = dd.nnx.DiagonalDense(16, 32, sparsity=0.5, rngs=nnx.Rngs(0))
    frozen = dd.nnx.freeze(layer)
    nnx.update(frozen, nnx.state(layer))
    with pytest.raises(
        ValueError, match=r"DiagonalDense\(16 -> 32\): values has shape \[32, 16\].*frozen layer"
    ):
        frozen(jnp.ones((2, 16)))
    general = dd.nnx.DiagonalDenseGeneral(
        (4, 4), (32,), sparsity=0.5, path="blocks/0/fc", rngs=nnx.Rngs(0)
    )
    general.values.set_value(general.values.get_value()[:8])
    with pytest.raises(ValueError, match=r"blocks/0/fc: values has shape \[8, 16\]"):
        general(jnp.ones((2, 4, 4)))


@pytest.mark.parametrize("phase", ["search", "frozen"])
def test_a_state_of_swapped_widths_names_the_layer(phase):
    """A 32 -> 16 layer's state loaded into a 16 -> 32 one (equal shapes) ran silently; inside
    jit, where the stored width is traced, the outputs are NaN (as the linen layer's)."""

    def make(n_in, n_out, seed):
        layer = dd.nnx.DiagonalDense(n_in, n_out, sparsity=0.5, use_bias=False, rngs=nnx.Rngs(seed))
        return dd.nnx.freeze(layer) if phase == "frozen" else layer

    layer = make(16, 32, 0)
    nnx.update(layer, nnx.state(make(32, 16, 1)))
    x = jnp.ones((2, 16))
    with pytest.raises(ValueError, match=r"16 -> 32\): its state was made for inputs of width 32"):
        layer(x)
    graph, state = nnx.split(layer)
    y = jax.jit(lambda state: nnx.merge(graph, state)(x))(state)
    assert np.isnan(np.asarray(y)).all()
    good = make(16, 32, 0)
    graph, state = nnx.split(good)
    assert np.isfinite(np.asarray(jax.jit(lambda state: nnx.merge(graph, state)(x))(state))).all()


def test_permutation_variables_that_do_not_match_the_layer_name_it():
    """A permutation added or reshaped by nnx.update gave NaN outputs, an einsum error naming no
    layer, or silently permuted the inputs of a permutation=None layer."""
    x = jnp.ones((2, 16))
    none = dd.nnx.DiagonalDense(16, 8, sparsity=0.5, rngs=nnx.Rngs(0))
    nnx.update(
        none,
        nnx.state(
            dd.nnx.DiagonalDense(16, 8, sparsity=0.5, permutation="random", rngs=nnx.Rngs(0))
        ),
    )
    with pytest.raises(
        ValueError,
        match=r"holds perm, but a search-phase layer with "
        r"permutation=None holds no permutation",
    ):
        none(x)
    blocks = dd.nnx.DiagonalDense(
        16,
        8,
        sparsity=0.5,
        permutation="learned",
        permutation_relaxation="blocks",
        rngs=nnx.Rngs(0),
    )
    blocks.perm_soft.set_value(jnp.ones((2, 6, 6)))
    with pytest.raises(
        ValueError, match=r"perm_soft must have shape \[1, 16, 16\].*got \[2, 6, 6\]"
    ):
        blocks(x)
    learned = dd.nnx.DiagonalDense(16, 8, sparsity=0.5, permutation="learned", rngs=nnx.Rngs(0))
    learned.perm_soft.set_value(jnp.ones((8, 8)))
    with pytest.raises(ValueError, match=r"perm_soft must have shape \[16, 16\]"):
        learned(x)
    frozen = dd.nnx.freeze(
        dd.nnx.DiagonalDense(16, 8, sparsity=0.5, permutation="random", rngs=nnx.Rngs(0))
    )
    frozen.perm.set_value(jnp.arange(8, dtype=jnp.int32))
    with pytest.raises(ValueError, match=r"perm must be an integer array \[in\] = \[16\]"):
        frozen(x)
    del frozen.perm
    with pytest.raises(
        ValueError,
        match=r"holds neither, but a frozen layer with "
        r"permutation='random' holds perm",
    ):
        frozen(x)


def test_linen_functions_given_nnx_objects_name_the_nnx_ones(standard_promotion):
    """They failed with "freeze expects a DiagonalDense, got DiagonalDense", a bare AssertionError
    inside flax, "a frozen or dense model has no gate" of a searching model, or an
    AttributeError."""
    kernel_stats = importlib.import_module(
        "dynadiag_jax.kernel_stats"
    )  # dd.kernel_stats: a function
    model = dd.nnx.DiagonalDense(16, 32, sparsity=0.5, rngs=nnx.Rngs(0))
    frozen = dd.nnx.freeze(dd.nnx.DiagonalDense(16, 32, sparsity=0.5, rngs=nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    for call, use in [
        (lambda: dd.freeze(model, nnx.state(model)), r"dd\.nnx\.freeze\(model\)"),
        (lambda: dd.freeze_tree(nnx.state(model)), r"the functions of dd\.nnx"),
        (
            lambda: dd.freeze_opt_state({}, params, nnx.state(frozen, nnx.Param)),
            r"dd\.nnx\.freeze_opt_state",
        ),
        (lambda: dd.nn.set_gate(nnx.state(model), strength=0.5), r"dd\.nnx\.set_gate"),
    ]:
        with pytest.raises(TypeError, match=f"is an NNX .*; for an NNX model use {use}"):
            call()
    with pytest.raises(TypeError, match="model_paths takes a linen module"):
        kernel_stats.model_paths(model, jax.random.key(0), jnp.ones((2, 16)))


def test_a_partitioned_kernel_init_gives_the_plain_draw():
    """nn.with_partitioning / nnx.with_partitioning initializers failed with "'Partitioned'
    object has no attribute 'T'"; the values are the plain initializer's draw."""
    init = nnx.initializers.lecun_normal()
    plain = dd.nnx.DiagonalDense(8, 8, sparsity=0.5, kernel_init=init, rngs=nnx.Rngs(0))
    boxed = dd.nnx.DiagonalDense(
        8, 8, sparsity=0.5, kernel_init=nnx.with_partitioning(init, (None, "m")), rngs=nnx.Rngs(0)
    )
    np.testing.assert_array_equal(boxed.values.get_value(), plain.values.get_value())
    key, x = jax.random.key(0), jnp.ones((1, 8))
    linen = dd.nn.DiagonalDense(8, sparsity=0.5, kernel_init=init).init(key, x)
    partitioned = dd.nn.DiagonalDense(
        8, sparsity=0.5, kernel_init=nn.with_partitioning(init, (None, "m"))
    ).init(key, x)
    np.testing.assert_array_equal(partitioned["params"]["values"], linen["params"]["values"])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(rank=0), ValueError, "rank must be >= 1, got 0"),
        (dict(rank=2.5), TypeError, "rank must be an int"),
        (dict(scale=float("nan")), ValueError, "scale must be a finite number"),
        (dict(scale=0.0), ValueError, "scale=0 scales the adapter to nothing"),
        (dict(param_dtype=jnp.int32), TypeError, "param_dtype must be a floating dtype"),
        (dict(base="dropout"), TypeError, "base must be an nnx.Linear or a dd.nnx.DiagonalDense"),
    ],
)
def test_lora_fa_class_checks_its_arguments(kwargs, error, match):
    """rank=0 built a do-nothing adapter, -1 an MLIRError, scale=nan NaN outputs, a Dropout base
    an AttributeError."""
    base = dd.nnx.DiagonalDense(16, 8, sparsity=0.5, rngs=nnx.Rngs(0))
    if kwargs.get("base") == "dropout":
        kwargs["base"] = nnx.Dropout(0.1)
    kwargs = {"base": base, "rank": 2, "scale": 1.0, **kwargs}
    with pytest.raises(error, match=f"dd.nnx.LoRAFA: {match}"):
        dd.nnx.LoRAFA(kwargs.pop("base"), rngs=nnx.Rngs(1), **kwargs)


def test_diagonal_dense_general_takes_ints_and_refuses_bad_sizes():
    """An int in_shape/out_shape/axis (nnx.LinearGeneral takes them) failed with "'int' object
    is not iterable"; (-2, -4) passed as 8 and failed at the first call."""
    layer = dd.nnx.DiagonalDenseGeneral(16, (2, 4), axis=-1, sparsity=0.5, rngs=nnx.Rngs(0))
    assert (layer.in_shape, layer.out_shape, layer.axis) == ((16,), (2, 4), (-1,))
    assert layer(jnp.ones((3, 16))).shape == (3, 2, 4)
    for shapes, match in [
        (((16,), (-2, -4)), r"out_shape\[0\] must be >= 1, got -2"),
        (((16, 0), 8), r"in_shape\[1\] must be >= 1, got 0"),
        (((), 8), r"in_shape must name at least one axis"),
    ]:
        with pytest.raises(ValueError, match=match):
            dd.nnx.DiagonalDenseGeneral(*shapes, sparsity=0.5, rngs=nnx.Rngs(0))


def test_freeze_opt_state_checks_its_arguments(standard_promotion):
    """freeze_opt_state(optimizer, frozen, model) silently returned an optimizer for the
    search-phase model."""
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    frozen = dd.nnx.freeze(model)
    with pytest.raises(ValueError, match="fc1 of frozen is in the search phase.*swapped"):
        dd.nnx.freeze_opt_state(optimizer, frozen, model)
    with pytest.raises(ValueError, match="fc1 of frozen is in the search phase"):
        dd.nnx.freeze_opt_state(optimizer, model, model)
    with pytest.raises(ValueError, match="frozen must be dd.nnx.freeze\\(model\\).*none"):
        dd.nnx.freeze_opt_state(optimizer, model, nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match="optimizer must be an nnx.Optimizer"):
        dd.nnx.freeze_opt_state(None, model, frozen)
    with pytest.raises(TypeError, match="frozen must be an nnx.Module"):
        dd.nnx.freeze_opt_state(optimizer, model, {"fc1": 1})
    for not_a_model in ("hello", {"fc1": 1}):  # freeze returned them unchanged
        with pytest.raises(TypeError, match="dd.nnx.freeze: model must be an nnx.Module"):
            dd.nnx.freeze(not_a_model)
    assert dd.nnx.freeze_opt_state(optimizer, model, frozen).step.get_value() == 0
    root = dd.nnx.DiagonalDense(8, 8, sparsity=0.5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"DiagonalDense at \(root\) of frozen is in the search"):
        dd.nnx.freeze_opt_state(nnx.Optimizer(root, optax.adam(1e-3), wrt=nnx.Param), root, root)


@pytest.mark.parametrize("block_size", [1, 8])
def test_alpha_from_values_restarts_every_searching_layer_in_place(block_size):
    """NNX had no restart of alpha (the linen function asserted on an ``nnx.State``)."""
    model = MLP(block_size=block_size, rngs=nnx.Rngs(0))
    values = model.fc1.values.get_value()
    model.fc1.values.set_value(
        values * jnp.linspace(0.5, 2.0, values.shape[0]).reshape((-1,) + (1,) * (values.ndim - 1))
    )
    want = dd.nn.alpha_from_values(
        {"alpha": model.fc1.alpha.get_value(), "values": model.fc1.values.get_value()}, 0.3
    )["alpha"]
    nnx.jit(lambda m: dd.nnx.alpha_from_values(m, 0.3))(model)
    np.testing.assert_array_equal(model.fc1.alpha.get_value(), want)
    alpha = model.fc1.alpha.get_value()
    assert alpha[-1] > alpha[0]  # the values scaled up 4x rank first
    with pytest.raises(ValueError, match="scale"):
        dd.nnx.alpha_from_values(model, 0.0)
    with pytest.raises(ValueError, match="no search-phase DiagonalDense"):
        dd.nnx.alpha_from_values(dd.nnx.freeze(model), 0.3)
    with pytest.raises(TypeError, match=r"got State; .*dd.nnx.alpha_from_values\(model"):
        dd.nn.alpha_from_values(nnx.state(model, nnx.Param), 0.3)


def test_freeze_opt_state_of_abstract_arguments_is_a_restore_template(standard_promotion):
    """A frozen model and optimizer are restored into ``dd.nnx.freeze`` and
    ``dd.nnx.freeze_opt_state`` of ``nnx.eval_shape``-made ones (the second raised a TypeError
    from inside the ranking)."""
    tx = optax.adam(1e-3)
    model = nnx.eval_shape(lambda: MLP(rngs=nnx.Rngs(0)))
    optimizer = nnx.eval_shape(lambda: nnx.Optimizer(MLP(rngs=nnx.Rngs(0)), tx, wrt=nnx.Param))
    template = dd.nnx.freeze_opt_state(optimizer, model, dd.nnx.freeze(model))
    real_model = MLP(rngs=nnx.Rngs(0))
    real = nnx.Optimizer(real_model, tx, wrt=nnx.Param)
    want = dd.nnx.freeze_opt_state(real, real_model, dd.nnx.freeze(real_model))
    shapes = [
        jax.tree.map(lambda a: (a.shape, a.dtype), nnx.to_pure_dict(nnx.state(o)))
        for o in (template, want)
    ]
    assert shapes[0] == shapes[1]
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(nnx.state(template)))


@pytest.mark.parametrize("block_size", [1, 8])
def test_a_stacked_ensemble_sets_its_gates_and_freezes_per_member(block_size):
    """``nnx.vmap`` builds three layers in one: set_gate once made their gate a scalar (the next
    vmapped call failed) and freeze gathered the kept values across the stacked axis."""

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return dd.nnx.DiagonalDense(32, 32, sparsity=0.75, block_size=block_size, rngs=rngs)

    forward = nnx.vmap(lambda m, x: m(x), in_axes=(0, None))
    x = jax.random.normal(jax.random.key(1), (4, 32))
    ensemble = make(nnx.Rngs(0))
    dd.nnx.set_gate(ensemble, strength=0.3, score=True)
    assert ensemble.strength.get_value().shape == (3,) and ensemble.score.get_value().shape == (3,)
    np.testing.assert_array_equal(ensemble.strength.get_value(), np.full(3, 0.3, np.float32))
    searched = forward(ensemble, x)
    assert searched.shape == (3, 4, 32)
    frozen = dd.nnx.freeze(ensemble)
    each = nnx.vmap(dd.nnx.freeze)(ensemble)  # one member at a time
    for name in ("values", "offsets"):
        np.testing.assert_array_equal(
            getattr(frozen, name).get_value(), getattr(each, name).get_value()
        )
    assert frozen.offsets.get_value().shape == (3, 8 if block_size == 1 else 1)
    np.testing.assert_allclose(forward(frozen, x), forward(each, x), rtol=1e-6)


def test_lora_fa_adapts_the_layer_sparsify_made_of_a_linear_general():
    """It listed "(none)" for the DiagonalDenseGeneral at the pattern's path (linen tells users to
    sparsify such layers first, then adapt them)."""

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.LinearGeneral((4, 4), (2, 4), axis=(-2, -1), rngs=rngs)

        def __call__(self, x):
            return self.fc(x)

    model = dd.nnx.sparsify(Model(nnx.Rngs(0)), [("fc", {"sparsity": 0.5})], rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (3, 4, 4))
    before = model(x)
    dd.nnx.lora_fa(model, ["fc"], rank=2, alpha=4.0, rngs=nnx.Rngs(3))
    np.testing.assert_allclose(model(x), before, rtol=1e-6)  # B starts at zero
    a, b = model.fc.lora_a.get_value(), model.fc.lora_b
    b.set_value(jax.random.normal(jax.random.key(4), b.get_value().shape))
    low_rank = 2.0 * (x.reshape(3, 16) @ a.T) @ b.get_value().T
    np.testing.assert_allclose(model(x), before + low_rank.reshape(3, 2, 4), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 8])
@pytest.mark.parametrize("phase", ["search", "frozen"])
def test_lora_fa_gives_each_member_of_a_stacked_layer_its_own_adapter(block_size, phase):
    """Adapters of one layer beside stacked weights once failed at the next nnx.vmap call (then
    they were refused): each member now gets its own A and B, and the stacked model computes
    what its members would, one at a time."""

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        layer = dd.nnx.DiagonalDense(32, 16, sparsity=0.75, block_size=block_size, rngs=rngs)
        return dd.nnx.freeze(layer) if phase == "frozen" else layer

    class Model(nnx.Module):
        def __init__(self):
            self.layers = make(nnx.Rngs(0))
            self.head = nnx.Linear(16, 4, rngs=nnx.Rngs(1))

        def __call__(self, x):
            members = nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(self.layers, x)
            return self.head(members.sum(0))

    model = Model()
    x = jax.random.normal(jax.random.key(1), (5, 32))
    before = model(x)
    dd.nnx.lora_fa(model, ["head", "layers"], rank=4, alpha=8.0, rngs=nnx.Rngs(2))
    a, b = model.layers.lora_a.get_value(), model.layers.lora_b
    assert a.shape == (3, 4, 32) and b.get_value().shape == (3, 16, 4)
    assert not np.allclose(a[0], a[1])  # each member draws its own A
    np.testing.assert_allclose(model(x), before, rtol=1e-6)  # B starts at zero
    b.set_value(jax.random.normal(jax.random.key(3), b.get_value().shape))
    members = nnx.vmap(lambda m, x: m.base(x), in_axes=(0, None))(model.layers, x)
    low_rank = jnp.stack([2.0 * (x @ a[i].T) @ b.get_value()[i].T for i in range(3)])
    adapted = nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(model.layers, x)
    np.testing.assert_allclose(adapted, members + low_rank, rtol=1e-5, atol=1e-5)
    # B of every member trains; A does not
    b_before = b.get_value()
    trained = nnx.All(nnx.Param, nnx.PathContains("lora_b"))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=trained)
    loss = lambda m: (m(x) ** 2).mean()  # noqa: E731
    optimizer.update(model, nnx.grad(loss, argnums=nnx.DiffState(0, trained))(model))
    assert np.all(np.abs(model.layers.lora_b.get_value() - b_before).sum((1, 2)) > 0)
    np.testing.assert_array_equal(model.layers.lora_a.get_value(), a)


def test_the_readme_nnx_export_round_trips_through_a_plain_dict():
    """serialize() refuses nnx.State leaves; the README passes the state as a pure dict."""
    model = dd.nnx.freeze(dd.nnx.DiagonalDense(64, 32, sparsity=0.75, rngs=nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (5, 64))
    graphdef, state = nnx.split(model)

    def apply(pure, x):
        state_now = nnx.State(state)
        nnx.replace_by_pure_dict(state_now, pure)
        return nnx.merge(graphdef, state_now)(x)

    pure = nnx.to_pure_dict(state)
    blob = dd.export(jax.jit(apply))(pure, x).serialize()
    np.testing.assert_allclose(jax.export.deserialize(blob).call(pure, x), model(x), rtol=1e-6)
    assert not isinstance(model.values.get_value(), jax.core.Tracer)  # no tracer leaked into it


def test_a_misspelt_impl_is_refused_when_either_layer_is_made():
    """It was accepted and first refused at the layer's first call."""
    with pytest.raises(ValueError, match="impl must be one of .*got 'bogus'"):
        dd.nn.DiagonalDense(8, sparsity=0.5, impl="bogus")
    with pytest.raises(ValueError, match="impl must be one of .*got 'bogus'"):
        dd.nnx.DiagonalDense(8, 8, sparsity=0.5, impl="bogus", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="impl must be a str"):
        dd.nnx.DiagonalDense(8, 8, sparsity=0.5, impl=None, rngs=nnx.Rngs(0))


def test_sparsify_names_the_layer_of_a_type_error_and_the_penalty_takes_modules_only():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(16, 8, rngs=rngs)

    with pytest.raises(TypeError, match="dd.nnx.sparsify: fc: k must be an int"):
        dd.nnx.sparsify(Model(nnx.Rngs(0)), [("fc", {"k": 2.5})], rngs=nnx.Rngs(1))
    with pytest.raises(TypeError, match="permutation_penalty takes an NNX module, got dict"):
        dd.nnx.permutation_penalty({"a": 1})
