"""The cost model counts exactly what the kernels do (without a GPU).

Each emulated launch sequence tallies, per kernel, the thread blocks it ran, the warp-level MMAs and
float32 FMAs it issued and the global bytes it loaded and stored (cuda/kernel_common.cuh; the
device build compiles the tallies to nothing). dynadiag_jax.gpu_cost derives the same numbers from
the launch plan; they must be equal, launch by launch, for every path: element diagonals on tensor
cores and on the diagonal path, block diagonals on tensor cores and CUDA cores, both output axes,
the row-split SDDMMs and their reductions.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd
from dynadiag_jax import gpu_cost, launch_plan
from dynadiag_jax.layout import geometry
from dynadiag_jax.ops import cuda

pytestmark = pytest.mark.skipif(
    "cuda_emulated" not in dd.available_impls(), reason="emulated CUDA targets not built"
)

FIELDS = ("ctas", "mma", "fma", "load_bytes", "store_bytes")


def counted(kind, rows, in_f, out_f, offsets, dtype, b, rng):
    """Counts of one emulated target call: {kernel: {field: n}}."""
    from dynadiag_jax import _emu_ext  # noqa: PLC0415 - present whenever this module runs

    geo = geometry(in_f, out_f, b)
    k = len(offsets)
    values_shape = (k, *geo.values_shape)
    x = jnp.asarray(rng.standard_normal((rows, in_f)), dtype)
    dy = jnp.asarray(rng.standard_normal((rows, out_f)), dtype)
    operands = {
        "fwd": (x, jnp.ones(values_shape, dtype), (rows, out_f)),
        "dx": (dy, jnp.ones(values_shape, dtype), (rows, in_f)),
        "dvalues": (dy, x, values_shape),
    }[kind]
    nbytes = launch_plan.workspace_bytes(kind, rows, in_f, out_f, k, dtype, block_size=b)
    call = jax.ffi.ffi_call(
        f"{cuda.EMULATED_PREFIX}_{kind}",
        (
            jax.ShapeDtypeStruct(operands[2], dtype),
            jax.ShapeDtypeStruct((max(nbytes, 1),), jnp.uint8),
        ),
    )
    _emu_ext.reset_kernel_counts()
    jax.block_until_ready(call(operands[0], operands[1], jnp.asarray(offsets, jnp.int32)))
    return {name: c for name, c in _emu_ext.kernel_counts().items() if c["ctas"]}


def modelled(kind, rows, in_f, out_f, offsets, dtype, b):
    geo = geometry(in_f, out_f, b)
    if b == 1 and kind == "dvalues":
        launches = gpu_cost.element_dvalues_launches(rows, geo, offsets, dtype)
    elif b == 1:
        launches = gpu_cost.element_product_launches(kind, rows, geo, offsets, dtype)
    elif kind == "dvalues":
        launches = gpu_cost.block_dvalues_launches(rows, geo, offsets, dtype)
    else:
        launches = gpu_cost.block_product_launches(kind, rows, geo, offsets, dtype)
    return {la.name: {f: getattr(la, f) for f in FIELDS} for la in launches}


def band_and_lone(p):
    """16 adjacent diagonals (tensor-core blocks), a lone one (diagonal path), a repeat."""
    return np.concatenate([np.arange(2, 18) % p, [p * 2 // 3, p * 2 // 3]])


ELEMENT = [(150, 48, 100), (150, 100, 48), (40, 40, 40)]
BLOCK = [(140, 32, 64, 16), (140, 64, 32, 16), (40, 48, 80, 16), (30, 32, 64, 8), (20, 64, 128, 32)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: d.__name__)
@pytest.mark.parametrize("kind", ["fwd", "dx", "dvalues"])
@pytest.mark.parametrize("rows,in_f,out_f", ELEMENT)
def test_element_kernels_do_what_the_model_counts(rows, in_f, out_f, kind, dtype, rng):
    offsets = band_and_lone(max(in_f, out_f))
    got = counted(kind, rows, in_f, out_f, offsets, dtype, 1, rng)
    assert got == modelled(kind, rows, in_f, out_f, offsets, dtype, 1)


def test_the_element_cases_cover_both_paths():
    const = launch_plan.constants()
    paths = set()
    for _, in_f, out_f in ELEMENT:
        for kind in ("fwd", "dx"):
            offsets = band_and_lone(max(in_f, out_f))
            st = gpu_cost.element_structure(offsets, kind, geometry(in_f, out_f), jnp.bfloat16)
            paths |= set(st.path.tolist())
    assert paths == {const.PATH_TENSOR_CORE, const.PATH_DIAGONAL}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: d.__name__)
@pytest.mark.parametrize("kind", ["fwd", "dx", "dvalues"])
@pytest.mark.parametrize("rows,in_f,out_f,b", BLOCK)
def test_block_kernels_do_what_the_model_counts(rows, in_f, out_f, b, kind, dtype, rng):
    p_b = min(in_f, out_f) // b
    offsets = np.array([p_b - 1, 0, 0])
    got = counted(kind, rows, in_f, out_f, offsets, dtype, b, rng)
    assert got == modelled(kind, rows, in_f, out_f, offsets, dtype, b)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: d.__name__)
def test_split_sddmms_and_their_reductions_are_counted(dtype, rng):
    element = launch_plan.sddmm_splits(600, 40, 24, 8)
    block = launch_plan.block_sddmm_plan(1100, 32, 64, 2, 16, dtype).splits
    assert element > 1 and block > 1
    for rows, in_f, out_f, offsets, b in (
        (600, 40, 24, np.arange(8), 1),
        (1100, 32, 64, [1, 0], 16),
    ):
        got = counted("dvalues", rows, in_f, out_f, offsets, dtype, b, rng)
        assert set(got) == {"element_sddmm" if b == 1 else "block_sddmm", "sddmm_reduce"}
        assert got == modelled("dvalues", rows, in_f, out_f, offsets, dtype, b)


def test_block_tensor_cores_do_only_useful_products(rng):
    # K * L_b * b * b MACs per row of the (128-row padded) slab: no work on empty tiles
    rows, in_f, out_f, b = 140, 32, 64, 16
    got = counted("fwd", rows, in_f, out_f, np.array([1, 0]), jnp.bfloat16, b, rng)
    assert got["block_product"]["mma"] * 16**3 == 256 * 2 * (64 // 16) * b * b


@pytest.mark.parametrize("b", [16, 64])
def test_block_dvalues_reads_dy_once_and_x_once_per_diagonal(b, rng):
    # tall 2b -> 4b: P_b = 2, L_b = 4, 2 wraps; one CTA per residue r holds both of its dy blocks
    # (t = r, r + 2) and the x block (r + d) % 2 of each diagonal. 100 rows, one split: dy is read
    # once, x once per diagonal, the offsets once per CTA.
    rows, in_f, out_f, offsets = 100, 2 * b, 4 * b, [1, 0]
    plan = launch_plan.block_sddmm_plan(rows, in_f, out_f, 2, b, jnp.bfloat16)
    assert (plan.wrap_chunks, plan.wraps_per_cta, plan.groups, plan.splits) == (1, 2, 1, 1)
    (got,) = counted("dvalues", rows, in_f, out_f, offsets, jnp.bfloat16, b, rng).values()
    assert got["ctas"] == 2
    assert got["load_bytes"] == rows * out_f * 2 + 2 * rows * in_f * 2 + 2 * 4 * 2
    # 4 b x b tiles a CTA, (b/16)^2 MMAs each per 16 rows of the zero-padded stages: 32-row stages
    # at b = 16 (128 rows), 16-row ones at b = 64 (112 rows)
    padded = {16: 128, 64: 112}[b]
    assert got["mma"] == 2 * 4 * (b // 16) ** 2 * padded // 16
    assert got["store_bytes"] == 2 * 4 * b * b * 2  # dvalues written once, in bfloat16
