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
