"""dd.export: frozen models serialize with jax.export and run in a fresh process.

The custom-call targets carry an ABI version in their names; dd.export allows exactly those.
"""

import re
import shutil
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd
from dynadiag_jax import _extension
from dynadiag_jax.ops import cuda

VERSIONED = re.compile(
    r"^dynadiag_((emu_)?diag_matmul_(permuted_)?v\d+_(fwd|dx|dvalues|bwd)|gate_rank_v\d+)$"
)


def custom_call_targets(module_text):
    return set(re.findall(r"stablehlo\.custom_call @([A-Za-z0-9_]+)\(", module_text))


def frozen_model(rng):
    """A frozen element DiagonalDense 24 -> 40, and block diagonals 32 -> 16 (b = 8) after it."""
    layer = dd.nn.DiagonalDense(40, sparsity=0.8)
    variables = layer.init(jax.random.key(0), jnp.ones((1, 24)), strength=1.0)
    frozen_layer, frozen = dd.freeze(layer, variables)
    block_values = jnp.asarray(rng.standard_normal((2, 4, 8, 8)), jnp.float32)
    block_offsets = jnp.asarray([0, 1], jnp.int32)

    def model(x, params):
        h = frozen_layer.apply(params["dense"], x)[:, :32]
        y = dd.diag_matmul(h, params["block"], block_offsets, out_features=16, impl="ffi")
        return jnp.tanh(y)

    params = {"dense": frozen, "block": block_values}
    return model, params


def trainable_gradient(model, x, params, loss=lambda y: jnp.sum(y.astype(jnp.float32) ** 2)):
    """Gradient in the floating parameters (the frozen offsets are integer variables)."""

    def of(trainable):
        dense, block = trainable
        return loss(model(x, {"dense": {**params["dense"], "params": dense}, "block": block}))

    return jax.grad(of)((params["dense"]["params"], params["block"]))


def test_target_names_carry_the_abi_version():
    names = _extension.custom_call_targets()
    assert names and all(VERSIONED.match(n) for n in names), names
    for module in (_extension._cpu_ext, _extension._cuda_ext, _extension._emu_ext):
        if module is not None:  # what the built modules register is in the list
            assert set(module.registrations()) <= set(names), module.__name__
    if _extension._emu_ext is not None:  # and the emulation's names are exactly its own
        emulated = {n for n in names if n.startswith(cuda.EMULATED_PREFIX)}
        assert set(_extension._emu_ext.registrations()) == emulated


def test_plain_jax_export_refuses_our_targets_and_dd_export_allows_them(rng):
    model, params = frozen_model(rng)
    x = jnp.ones((3, 24), jnp.float32)
    with pytest.raises(ValueError, match="Cannot serialize code with custom calls"):
        jax.export.export(jax.jit(model))(x, params)
    exported = dd.export(jax.jit(model))(x, params)
    targets = custom_call_targets(exported.mlir_module())
    assert targets and all(VERSIONED.match(t) for t in targets), targets
    assert "dynadiag_diag_matmul_v2_fwd" in targets
    # a plain callable is jitted for the caller, as jax.export requires
    assert dd.export(model)(x, params).out_avals == exported.out_avals


CHILD = textwrap.dedent("""
    import sys
    import jax, numpy as np
    import dynadiag_jax  # registers the custom-call targets
    data = dict(np.load(sys.argv[1] + "/inputs.npz"))
    for name in ("forward", "gradient"):
        exported = jax.export.deserialize(bytearray(open(f"{sys.argv[1]}/{name}.bin", "rb").read()))
        args = jax.tree.unflatten(exported.in_tree, [data[f"arg{i}"] for i in range(len(data))])
        out = exported.call(*args[0], **args[1])
        np.savez(f"{sys.argv[1]}/{name}_out.npz", *jax.tree.leaves(out))
""")


def test_serialized_frozen_model_runs_in_a_fresh_process(rng, tmp_path, run_python):
    model, params = frozen_model(rng)
    x = jnp.asarray(rng.standard_normal((5, 24)), jnp.float32)

    def gradient(x, params):
        return trainable_gradient(model, x, params)

    expected = {}  # the same program compiled here: the same numbers, bit for bit
    for name, fn in (("forward", model), ("gradient", gradient)):
        expected[name] = jax.jit(fn)(x, params)
        exported = dd.export(jax.jit(fn))(x, params)
        (tmp_path / f"{name}.bin").write_bytes(exported.serialize())
    texts = dd.export(jax.jit(gradient))(x, params).mlir_module()
    assert "dynadiag_diag_matmul_v2_bwd" in custom_call_targets(texts)  # the fused backward
    leaves = jax.tree.leaves(((x, params), {}))
    np.savez(tmp_path / "inputs.npz", **{f"arg{i}": np.asarray(a) for i, a in enumerate(leaves)})
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    run_python([str(script), str(tmp_path)])
    for name, want in expected.items():
        got = np.load(tmp_path / f"{name}_out.npz")
        want = jax.tree.leaves(want)
        assert len(got.files) == len(want), name
        for i, w in enumerate(want):
            np.testing.assert_array_equal(got[f"arr_{i}"], np.asarray(w), err_msg=name)


def test_export_lowers_to_the_versioned_cuda_targets_without_a_gpu(rng):
    if not dd.has_cuda_kernels():
        # with a CUDA compiler at hand a missing build is a CI failure, not a reason to skip
        if shutil.which("nvcc") is not None:
            pytest.fail("nvcc is on PATH but dynadiag_jax was installed without the CUDA kernels")
        pytest.skip("CUDA targets not built (no nvcc on PATH)")
    model, params = frozen_model(rng)
    x = jnp.ones((3, 24), jnp.float32)

    def step(x, params):  # dx of the element layer too
        return trainable_gradient(model, x, params), jax.grad(lambda x: jnp.sum(model(x, params)))(
            x
        )

    exported = dd.export(jax.jit(step), platforms=("cuda",))(x, params)
    assert exported.platforms == ("cuda",)
    targets = custom_call_targets(exported.mlir_module())
    for kind in ("fwd", "dx", "dvalues"):
        assert f"dynadiag_diag_matmul_v2_{kind}" in targets, targets
    if not cuda.KERNELS.block_diagonals:  # the block product lowers to the pure-JAX path there
        calls = [line for line in exported.mlir_module().splitlines() if "custom_call @dyn" in line]
        assert not any("x8x8xf32>" in line for line in calls)
    # both platforms in one serialized artifact
    both = dd.export(jax.jit(model), platforms=("cpu", "cuda"))(x, params)
    assert jax.export.deserialize(both.serialize()).platforms == ("cpu", "cuda")


SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import dynadiag_jax as dd

    mesh = jax.make_mesh((4,), ("data",))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 3, 8, 8)), jnp.float32)
    off = jnp.asarray([0, 1], jnp.int32)

    def step(x, v):
        return jax.value_and_grad(
            lambda x, v: jnp.sum(jnp.sin(dd.diag_matmul(x, v, off, out_features=24))),
            argnums=(0, 1))(x, v)

    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    vs = jax.device_put(v, NamedSharding(mesh, P()))
    blob = dd.export(jax.jit(step))(xs, vs).serialize()
    got = jax.export.deserialize(blob).call(xs, vs)
    want = jax.jit(step)(x, v)
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    print(err)
""")


def test_a_sharded_program_exports_and_runs(run_python):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    err = float(run_python(["-c", SHARDED], env=env).stdout.strip().splitlines()[-1])
    assert err <= 1e-5


def test_search_phase_layer_exports_with_its_ranking_call():
    layer = dd.nn.DiagonalDense(32, sparsity=0.8)
    x = jnp.ones((4, 48), jnp.float32)
    variables = layer.init(jax.random.key(0), x)
    exported = dd.export(jax.jit(layer.apply))(variables, x)
    targets = custom_call_targets(exported.mlir_module())
    if _extension.has_cpu_kernels():
        assert "dynadiag_gate_rank_v1" in targets
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_allclose(restored.call(variables, x), layer.apply(variables, x), rtol=1e-6)


# --- a symbolic batch: one program for every batch size ----------------------------------------

BATCHES = (1, 3, 130)


def assert_close_f32(got, want, what):
    got, want = (np.asarray(a, np.float64) for a in (got, want))
    scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale, err_msg=what)


def frozen_layer(features, x, **kwargs):
    """``dd.freeze`` of a fresh DiagonalDense at 75% sparsity, initialised on ``x``."""
    layer = dd.nn.DiagonalDense(features, sparsity=0.75, **kwargs)
    return dd.freeze(layer, layer.init(jax.random.key(0), x))


def params_gradient(apply, frozen):
    """The gradient of a loss in the floating parameters of ``frozen`` (a training step's)."""

    def gradient(x, frozen):
        def loss(params):
            return jnp.sum(jnp.sin(apply({**frozen, "params": params}, x)))

        return jax.grad(loss)(frozen["params"])

    return gradient


@pytest.mark.parametrize(
    "kwargs", [{}, {"block_size": 16}, {"permutation": "random"}], ids=["element", "b16", "perm"]
)
def test_frozen_layer_exports_once_for_every_batch_size(kwargs, rng):
    layer, frozen = frozen_layer(128, jnp.ones((1, 784), jnp.float32), **kwargs)
    (b,) = jax.export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b, 784), jnp.float32)
    gradient = params_gradient(layer.apply, frozen)
    forward = jax.export.deserialize(dd.export(jax.jit(layer.apply))(frozen, spec).serialize())
    step = dd.export(jax.jit(gradient))(spec, frozen)
    if jax.default_backend() == "cpu" and _extension.has_cpu_kernels():
        # impl="auto" keeps the kernels for a symbolic batch
        prefix = "permuted_v1" if "perm" in frozen["diagonals"] else "v2"
        assert f"dynadiag_diag_matmul_{prefix}_dvalues" in custom_call_targets(step.mlir_module())
    step = jax.export.deserialize(step.serialize())
    for n in BATCHES:
        x = jnp.asarray(rng.standard_normal((n, 784)), jnp.float32)
        assert_close_f32(forward.call(frozen, x), layer.apply(frozen, x), f"y, {n} rows")
        got, want = step.call(x, frozen), gradient(x, frozen)
        for name in want:
            assert_close_f32(got[name], want[name], f"d{name}, {n} rows")


def test_sequence_model_exports_with_symbolic_leading_dimensions(rng):
    """Two frozen layers on ``[batch, time, 64]``: a symbolic batch, then batch and time."""
    x = jnp.ones((1, 7, 64), jnp.float32)
    first, first_vars = frozen_layer(96, x)
    second, second_vars = frozen_layer(64, jnp.ones((1, 7, 96), jnp.float32), block_size=16)
    frozen = {"first": first_vars, "second": second_vars}

    def model(frozen, x):
        return second.apply(frozen["second"], jnp.tanh(first.apply(frozen["first"], x)))

    b, t = jax.export.symbolic_shape("b, t")
    for shape, leads in (((b, 7, 64), ((1, 7), (3, 7), (130, 7))), ((b, t, 64), ((1, 1), (3, 5)))):
        spec = jax.ShapeDtypeStruct(shape, jnp.float32)
        restored = jax.export.deserialize(dd.export(jax.jit(model))(frozen, spec).serialize())
        for lead in leads:
            x = jnp.asarray(rng.standard_normal((*lead, 64)), jnp.float32)
            assert_close_f32(restored.call(frozen, x), model(frozen, x), f"{shape} at {lead}")


def test_search_phase_layer_exports_once_for_every_batch_size(rng):
    """A layer still searching (gate, ranking call, bucketed product) with a symbolic batch."""
    layer = dd.nn.DiagonalDense(64, sparsity=0.9)
    variables = layer.init(jax.random.key(0), jnp.ones((1, 96), jnp.float32))
    (b,) = jax.export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b, 96), jnp.float32)
    exported = dd.export(jax.jit(layer.apply))(variables, spec)
    restored = jax.export.deserialize(exported.serialize())
    for n in BATCHES:
        x = jnp.asarray(rng.standard_normal((n, 96)), jnp.float32)
        assert_close_f32(restored.call(variables, x), layer.apply(variables, x), f"y, {n} rows")


@pytest.mark.parametrize("platforms", [("tpu",), ("cpu", "rocm")])
def test_ffi_for_a_platform_without_kernels_is_refused_by_name(platforms):
    x, values, offsets = jnp.ones((4, 16)), jnp.ones((2, 16)), np.array([0, 3], np.int32)

    def loss(impl):
        return lambda x, v: jnp.sum(dd.diag_matmul(x, v, offsets, out_features=16, impl=impl))

    refusal = f"impl='ffi' has kernels for .*not for {platforms[-1]}"
    with pytest.raises(NotImplementedError, match=refusal):
        dd.export(jax.grad(loss("ffi"), argnums=(0, 1)), platforms=platforms)(x, values)
    exported = dd.export(jax.grad(loss("auto"), argnums=(0, 1)), platforms=platforms)(x, values)
    assert exported.platforms == platforms


def test_one_platform_name_is_one_platform():
    """A string was exported for ('c', 'p', 'u'), refused only when called."""
    x, values, offsets = jnp.ones((4, 16)), jnp.ones((2, 16)), np.array([0, 3], np.int32)
    exported = dd.export(
        lambda x, v: dd.diag_matmul(x, v, offsets, out_features=16), platforms="cpu"
    )(x, values)
    assert exported.platforms == ("cpu",)
    np.testing.assert_allclose(
        exported.call(x, values), dd.diag_matmul(x, values, offsets, out_features=16)
    )
