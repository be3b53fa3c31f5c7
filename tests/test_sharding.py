"""diag_matmul under jit on a batch-sharded x over 4 CPU devices: same result, no gather of x."""

import json
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, re, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import dynadiag_jax as dd
    from dynadiag_jax.ops.products import _BACKENDS

    assert jax.device_count() == 4
    # Block diagonals: until the kernels declare block support, only compile (the lowering and
    # the partitioning are ours); run them once they do.
    RUN_BLOCKS = "ffi" in dd.available_impls(block_size=8)
    _BACKENDS["ffi"] = _BACKENDS["ffi"]._replace(block_size_ok=lambda b: b in (1, 8))
    # rows of the per-device custom call of the forward kernel
    FWD_CALL = (r"f32\\[(\\d+),\\d+\\]\\{1,0\\} custom-call\\([^)]*\\), "
                r"custom_call_target=\\"dynadiag_diag_matmul_v2_fwd")
    # rows of dx in the per-device fused backward call: (dx, dvalues) = bwd(dy, x, values, offsets)
    BWD_CALL = (r"\\(f32\\[(\\d+),\\d+\\]\\{1,0\\}, f32\\[[\\d,]+\\]\\{[\\d,]+\\}\\) "
                r"custom-call\\([^)]*\\), "
                r"custom_call_target=\\"dynadiag_diag_matmul_v2_bwd")
    MOVES = r"\\b(all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\\("
    # the array shapes that cross devices in an all-reduce (result of "... all-reduce(")
    REDUCED = r"= \\(?([^=]*?)\\)? all-reduce(?:-start)?\\("
    rng = np.random.default_rng(0)
    out = {}
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((4,), ("data",), axis_types=(axis_type,))
        for lead, in_f, out_f, b in [
            ((64,), 32, 48, 1), ((8, 12), 40, 24, 1), ((64,), 16, 48, 8), ((8, 12), 48, 32, 8)
        ]:
            x = jnp.asarray(rng.standard_normal(lead + (in_f,)), jnp.float32)
            if b == 1:
                k = 7
                vshape = (k, min(in_f, out_f))
                off = rng.choice(max(in_f, out_f), k, replace=False)
            else:
                k = 3
                vshape = (k, max(in_f, out_f) // b, b, b)
                off = rng.integers(0, min(in_f, out_f) // b, k)
            v = jnp.asarray(rng.standard_normal(vshape), jnp.float32)
            off = jnp.asarray(off, jnp.int32)

            def loss(x, v):
                y = dd.diag_matmul(x, v, off, out_features=out_f, impl="ffi")
                return jnp.sum(jnp.sin(y)), y

            step = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
            (_, y1), (dx1, dv1) = jax.jit(step)(x, v)  # one device
            xs = jax.device_put(x, NamedSharding(mesh, P("data")))
            vs = jax.device_put(v, NamedSharding(mesh, P()))
            sharded = jax.jit(step)
            hlo = sharded.lower(xs, vs).compile().as_text()
            key = f"{axis_type}-{lead}-b{b}"
            shapes = dict(
                moves=len(re.findall(MOVES, hlo)),
                reduced=sorted(set(
                    shape for m in re.findall(REDUCED, hlo)
                    for shape in re.findall(r"f32\\[[\\d,]+\\]", m))),
                kernel_rows=sorted(set(int(m) for m in re.findall(FWD_CALL, hlo))),
                bwd_rows=sorted(set(int(m) for m in re.findall(BWD_CALL, hlo))),
                dvalues_shape="f32[" + ",".join(map(str, vshape)) + "]")
            if b > 1 and not RUN_BLOCKS:
                out[key] = shapes
                continue
            (_, y4), (dx4, dv4) = sharded(xs, vs)

            def err(a, ref):  # relative to the largest entry: the sums run in another order
                ref = np.asarray(ref)
                return float(np.max(np.abs(np.asarray(a) - ref)) / max(1.0, np.max(np.abs(ref))))

            out[key] = dict(
                shapes,
                y=err(y4, y1),
                dx=err(dx4, dx1),
                dv=err(dv4, dv1),
                y_spec=str(y4.sharding.spec), dv_spec=str(dv4.sharding.spec))
    print(json.dumps(out))
""")


@pytest.fixture
def sharded_results(run_python):
    proc = run_python(["-c", SCRIPT], env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sharded_run_matches_one_device_and_never_gathers_x(sharded_results):
    assert len(sharded_results) == 8  # both axis types x (two element, two block cases)
    for key, r in sharded_results.items():
        if "y" not in r:  # block diagonals compiled only: no block kernels in this build yet
            assert key.endswith("-b8"), key
        for name in ("y", "dx", "dv"):
            assert r.get(name, 0.0) <= 1e-5, f"{key}: {name} differs by {r[name]}"
        assert r["moves"] == 0, f"{key}: data moved between devices"
        # only the partial dvalues sums (and the scalar loss) are all-reduced, never rows of x
        assert r["reduced"] == [r["dvalues_shape"]], f"{key}: all-reduced {r['reduced']}"
        rows = 64 if "(64,)" in key else 8 * 12
        for call in ("kernel_rows", "bwd_rows"):
            assert r[call] and max(r[call]) * 4 <= rows, f"{key}: {call} {r[call]}"
        assert "data" in r.get("y_spec", "data"), key


def test_a_jax_without_the_private_lowering_hook_warns_instead_of_failing(monkeypatch):
    from jax._src import dispatch
    from jax.extend.core import Primitive

    from dynadiag_jax.ops import products

    monkeypatch.delattr(dispatch, "prim_requires_devices_during_lowering")
    with pytest.warns(RuntimeWarning, match="replicated"):
        products.require_devices_during_lowering(Primitive("probe"))


SHARD_MAP = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import dynadiag_jax as dd

    mesh = Mesh(np.array(jax.devices()), ("data",))
    x = jax.random.normal(jax.random.key(1), (16, 32))
    out = {}
    for impl in dd.available_impls(block_size=8):
        for b in (1, 8):
            layer = dd.nn.DiagonalDense(48, sparsity=0.75, block_size=b, impl=impl)
            search = layer.init(jax.random.key(0), x)
            for phase, v in (("search", search), ("frozen", dd.freeze_tree(search))):
                def loss(p, x):
                    y = layer.apply({**v, "params": p}, x, mutable=False)
                    return jnp.mean(jnp.sin(y) ** 2)

                # data parallel: each shard's loss, averaged over the shards
                sharded = jax.shard_map(
                    lambda p, x: jax.lax.pmean(loss(p, x), "data"),
                    mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
                got = jax.jit(jax.grad(sharded, argnums=(0, 1)))(v["params"], x)
                want = jax.jit(jax.grad(loss, argnums=(0, 1)))(v["params"], x)
                err = jax.tree.map(
                    lambda a, r: float(jnp.max(jnp.abs(a - r)) / jnp.max(jnp.abs(r))), got, want)
                # traced, not run: the type and the out_specs check are decided while tracing
                typed = []
                jax.eval_shape(jax.shard_map(
                    lambda p, x: typed.append(str(jax.typeof(layer.apply({**v, "params": p}, x))))
                    or x, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")),
                    v["params"], x)
                try:  # a per-shard output declared replicated
                    jax.eval_shape(jax.shard_map(lambda p, x: layer.apply({**v, "params": p}, x),
                                   mesh=mesh, in_specs=(P(), P("data")), out_specs=P()),
                                   v["params"], x)
                    refused = False
                except ValueError as e:
                    refused = "out_specs" in str(e)
                out[f"{impl}-b{b}-{phase}"] = dict(
                    err=max(jax.tree.leaves(err)), typed=typed[0], refused=refused)
    print(json.dumps(out))
""")


def test_shard_map_data_parallel_gradients_match_one_device(run_python):
    """Inside ``jax.shard_map`` a product's result varies along the mesh axes its operands vary
    along: typed as replicated, the per-shard output passed ``out_specs=P()`` and the gradients
    of the replicated parameters came back wrong (relative errors of 1-2), with no error."""
    proc = run_python(
        ["-c", SHARD_MAP], env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    )
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {k.split("-")[0] for k in results} >= {"auto", "jax", "dense"}
    for key, r in results.items():
        assert r["err"] <= 1e-5, f"{key}: gradients differ by {r['err']}"
        assert r["typed"] == "float32[4,48]{V:data}", f"{key}: {r['typed']}"
        assert r["refused"], f"{key}: out_specs=P() accepted for a per-shard output"
