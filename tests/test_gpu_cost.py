"""The GPU cost model (dynadiag_jax.gpu_cost): specs, path times and the physics it must show.

Counts against the emulated kernels: tests/test_cuda_counts.py.
"""

import ast
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import H100_MEASURED_SPEEDUP

import dynadiag_jax as dd
from dynadiag_jax import gpu_cost, launch_plan
from dynadiag_jax.layout import geometry

VIT_ROWS = 2048 * 197  # ViT-B/16 at batch 2048: the kernels' target shape
BF16 = jnp.bfloat16
ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_dense_layer_is_the_dot_at_the_dense_rate():
    p = gpu_cost.predict(VIT_ROWS, 768, 3072, BF16, 308)
    flops = 2 * VIT_ROWS * 768 * 3072
    spec = gpu_cost.H100
    fwd, bwd, step = p.seconds["dense_layer"]
    assert fwd == pytest.approx(flops / spec.dense_flops_16bit + spec.launch_seconds)
    assert bwd == pytest.approx(2 * fwd) and step == pytest.approx(3 * fwd)
    # building W from the diagonals adds two small memory-bound launches
    assert 0 < p.seconds["dense"][0] - fwd < 1e-4


def test_float32_dots_run_at_the_tf32_rate():
    f32 = gpu_cost.predict(VIT_ROWS, 768, 3072, jnp.float32, 308).seconds["dense_layer"][0]
    bf16 = gpu_cost.predict(VIT_ROWS, 768, 3072, BF16, 308).seconds["dense_layer"][0]
    assert f32 == pytest.approx(2 * bf16, rel=0.01)


def test_scattered_element_diagonals_lose_to_dense_at_90_percent():
    # docs/design.md section 6: scattered diagonals cannot beat cuBLAS at 90% sparsity
    p = gpu_cost.predict(VIT_ROWS, 768, 3072, BF16, dd.num_diagonals(768, 3072, 0.9))
    fwd, step = p.speedup("kernel", "dense")
    assert p.structure == "spread" and fwd < 1 and step < 1


@pytest.mark.parametrize("b", [16, 32])
def test_block_forward_and_dvalues_fit_two_blocks_per_sm(b):
    # the templated tensor-core product and SDDMM: <= 128 registers; the SDDMM reads each dy row
    # chunk once for all its diagonals, so it issues about what its bytes need
    k = dd.num_diagonals(768, 3072, 0.9, block_size=b)
    p = gpu_cost.predict(VIT_ROWS, 768, 3072, BF16, k, block_size=b)
    (launch,) = p.paths["kernel"].fwd
    # still the bytes of the design: x read and y written once, ~3.1 GB
    assert launch.hbm_bytes == pytest.approx(VIT_ROWS * (768 + 3072) * 2, rel=1e-3)
    sddmm = next(la for la in p.paths["kernel"].bwd if la.name == "block_sddmm")
    for la in (launch, sddmm):
        assert la.registers <= 128
        assert gpu_cost.occupancy(la.registers, la.shared_bytes, 256, gpu_cost.H100)[0] >= 2
    terms = sddmm.terms(gpu_cost.H100, BF16)
    efficiency = gpu_cost.occupancy(sddmm.registers, sddmm.shared_bytes, 256, gpu_cost.H100)[2]
    assert terms["issue"] == pytest.approx(
        sddmm.instructions / (gpu_cost.H100.issue_rate * efficiency)
    )
    assert terms["issue"] < 1.5 * terms["hbm"]


def test_the_l2_carries_the_sms_traffic_and_the_hbm_traffic():
    # Nsight Compute's L2 bytes of the H100 block kernels were their loads and stores plus their
    # HBM bytes: an HBM read fills the L2 before an SM reads it, a write leaves it to HBM
    h100 = gpu_cost.H100
    la = gpu_cost.Launch("x", load_bytes=3e9, store_bytes=2e9, hbm_bytes=4e9)
    assert la.terms(h100, BF16)["l2"] == pytest.approx(9e9 / h100.l2_bandwidth)
    assert la.terms(h100, BF16)["hbm"] == pytest.approx(4e9 / h100.hbm_bandwidth)
    # the b = 16 forward at the headline shape: x read once per diagonal, y written once
    k = dd.num_diagonals(768, 3072, 0.9, block_size=16)
    fwd = gpu_cost.predict(VIT_ROWS, 768, 3072, BF16, k, block_size=16).paths["kernel"].fwd[0]
    x_bytes, y_bytes = VIT_ROWS * 768 * 2, VIT_ROWS * 3072 * 2
    assert fwd.load_bytes > k * x_bytes and fwd.store_bytes == y_bytes
    assert fwd.terms(h100, BF16)["l2"] > fwd.terms(h100, BF16)["hbm"]


@pytest.mark.parametrize("b", [16, 32])
def test_the_stage_term_shares_the_stages_among_the_resident_blocks(b):
    # every stage of the tensor-core kernels takes stage_seconds of one resident thread block
    k = dd.num_diagonals(768, 3072, 0.9, block_size=b)
    p = gpu_cost.predict(VIT_ROWS, 768, 3072, BF16, k, block_size=b)
    h100 = gpu_cost.H100
    launches = [la for la in (*p.paths["kernel"].fwd, *p.paths["kernel"].bwd) if la.stages]
    assert {la.name for la in launches} == {"block_product", "block_sddmm"}
    for la in launches:
        blocks = gpu_cost.occupancy(la.registers, la.shared_bytes, la.threads, h100)[0]
        resident = min(la.ctas, blocks * h100.sms)
        assert la.terms(h100, BF16)["stages"] == pytest.approx(
            la.stages * h100.stage_seconds / resident
        )
    assert all(la.terms(h100, BF16)["stages"] == 0 for la in p.paths["dense"].fwd)


# Nsight Compute times of the tensor-core block kernels on an H100 80GB HBM3 (2026-11-27, second
# profile; 403,456 x 768 -> 3072, bfloat16, 90%, the benchmark's random offsets;
# docs/gpu_cost_model.md), and the benchmark's step (fwd + bwd) speed-up at 90%.
H100_KERNEL_SECONDS = {
    16: {"fwd": 2.437e-3, "dx": 3.958e-3, "dvalues": 2.467e-3},
    32: {"fwd": 2.818e-3, "dx": 2.725e-3, "dvalues": 2.946e-3},
}
H100_STEP_SPEEDUP = {b: H100_MEASURED_SPEEDUP[(b, 0.9)][1] for b in (16, 32)}


@pytest.mark.parametrize("b", [16, 32])
def test_the_model_is_within_30_percent_of_the_profiled_h100_kernels(b):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from diag_matmul_gpu import make_offsets  # noqa: PLC0415 - bench/ is not a package
    finally:
        sys.path.remove(str(ROOT / "bench"))
    geo = geometry(768, 3072, b)
    k = dd.num_diagonals(768, 3072, 0.9, block_size=b)
    offsets = make_offsets("random", k, geo.num_candidates, np.random.default_rng(0))
    p = gpu_cost.predict(403456, 768, 3072, BF16, offsets=offsets, block_size=b)
    path = p.paths["kernel"]
    dx = [la for la in path.bwd if la.name == "block_product"]
    dvalues = [la for la in path.bwd if la.name != "block_product"]
    for role, launches in (("fwd", path.fwd), ("dx", dx), ("dvalues", dvalues)):
        predicted = sum(la.seconds(gpu_cost.H100, BF16) for la in launches)
        assert predicted == pytest.approx(H100_KERNEL_SECONDS[b][role], rel=0.3), role
    step = p.speedup("kernel", "dense")[1]
    assert step == pytest.approx(H100_STEP_SPEEDUP[b], rel=0.3)
    assert step < 1  # a training step on these kernels is slower than on cuBLAS


def test_occupancy_from_registers_and_shared_memory():
    h100 = gpu_cost.H100
    # 198 registers x 256 threads: one block per SM, 2 warps per scheduler, latency half hidden
    assert gpu_cost.occupancy(198, 40960, 256, h100) == (1, 2.0, 0.5)
    # 64 registers: 4 blocks by registers, 32 warps, enough to hide latency
    assert gpu_cost.occupancy(64, 8192, 256, h100) == (4, 8.0, 1.0)
    # shared memory limits before registers: 100 KiB blocks, two fit in 228 KiB
    assert gpu_cost.occupancy(32, 100 * 1024, 256, h100)[0] == 2
    assert gpu_cost.occupancy(32, 100 * 1024, 256, gpu_cost.A100)[0] == 1
    # registers are allocated 8 per thread: 129 registers count as 136
    assert gpu_cost.occupancy(129, 0, 256, h100)[0] == 65536 // (136 * 32 * 8)


def test_issue_term_is_the_sass_figures_times_the_executed_units():
    rows, b, k = 512, 16, 2
    geo = geometry(64, 256, b)
    (launch,) = gpu_cost.block_product_launches("fwd", rows, geo, np.arange(k), BF16)
    # 64 -> 256 at b = 16: 4 wraps, a 64-column kernel with 256-row slabs
    fig = gpu_cost.sass("block_product_tc_kernel", BF16, (True, False, 16, 64))
    regions = fig["regions"]
    slabs, panels = rows // 256, 64 // b
    trips = k  # one 16-wide slice per diagonal at b = 16
    tiles = (64 // 16) * (256 // 16)  # stored 16x16 tiles per thread block
    expected = (
        regions["mma"] * launch.mma
        + regions["stage"] * panels * slabs * 8 * trips
        + regions["store"] * panels * slabs * tiles
        + regions["cta"] * launch.ctas * 8
    )
    assert launch.instructions == pytest.approx(expected)
    assert (launch.registers, launch.shared_bytes) == (fig["registers"], fig["smem"])


def test_block_products_do_exactly_the_useful_tensor_core_work():
    k, b, rows = 3, 16, 1000
    geo = geometry(64, 256, b)
    for kind in ("fwd", "dx"):
        (launch,) = gpu_cost.block_product_launches(kind, rows, geo, np.arange(k), BF16)
        # one MAC per non-zero of W (K * L_b * b * b) and row of the 128-row slabs (1024 rows)
        padded = -(-rows // 128) * 128
        assert launch.mma * 16**3 == padded * k * (256 // b) * b * b


def test_known_offsets_change_the_element_prediction():
    band = np.arange(308)
    p_band = gpu_cost.predict(VIT_ROWS, 768, 3072, BF16, offsets=band)
    p_spread = gpu_cost.predict(VIT_ROWS, 768, 3072, BF16, 308)
    assert p_band.structure == "offsets"
    assert p_band.seconds["kernel"][2] < p_spread.seconds["kernel"][2]


def test_spread_offsets_are_distinct_and_scattered():
    off = gpu_cost.spread_offsets(308, 3072)
    assert len(np.unique(off)) == 308 and off.min() == 0 and off.max() < 3072
    assert np.diff(off).min() >= 9


def test_devices_can_be_added_and_are_found_by_kind(monkeypatch):
    monkeypatch.setattr(gpu_cost, "DEVICES", dict(gpu_cost.DEVICES))  # restored afterwards
    assert gpu_cost.device_for_kind("NVIDIA H100 80GB HBM3") is gpu_cost.H100
    assert gpu_cost.device_for_kind("NVIDIA A100-SXM4-80GB") is gpu_cost.A100
    assert gpu_cost.device_for_kind("Tesla T4") is None
    h100 = gpu_cost.H100
    slow = h100._replace(
        name="slowH",
        device_kinds=("L4",),
        issue_rate=h100.issue_rate / 4,
        stage_seconds=4 * h100.stage_seconds,
    )
    gpu_cost.register_device(slow)
    assert gpu_cost.device_for_kind("NVIDIA L4") is slow
    fast = gpu_cost.predict(VIT_ROWS, 768, 3072, BF16, 5, block_size=16)
    slower = gpu_cost.predict(VIT_ROWS, 768, 3072, BF16, 5, block_size=16, device="slowH")
    assert slower.seconds["dense"][0] == fast.seconds["dense"][0]
    assert slower.seconds["kernel"][2] > 3 * fast.seconds["kernel"][2]
    with pytest.raises(ValueError, match="device must be one of"):
        gpu_cost.predict(10, 16, 16, BF16, 1, device="B200")
    with pytest.raises(TypeError, match="DeviceSpec"):
        gpu_cost.register_device({"name": "x"})


def test_a_device_registered_after_the_first_decision_is_used(monkeypatch):
    """impl="auto" cached the spec of the first decision: a device registered after it was
    never used."""
    from dynadiag_jax.ops import auto

    monkeypatch.setattr(gpu_cost, "DEVICES", dict(gpu_cost.DEVICES))  # restored afterwards
    monkeypatch.setattr(auto, "_gpu_kind", lambda: "NVIDIA L4")
    assert auto.gpu_spec() is gpu_cost.DEVICES[gpu_cost.DEFAULT_DEVICE]
    l4 = gpu_cost.H100._replace(name="L4", device_kinds=("L4",), sms=58)
    gpu_cost.register_device(l4)
    assert auto.gpu_spec() is l4


def test_predict_needs_k_or_offsets():
    with pytest.raises(ValueError, match="num_diagonals or offsets"):
        gpu_cost.predict(10, 16, 16, BF16)


@pytest.mark.parametrize(
    "call, error, match",
    [
        # a KeyError from the SASS figures, or silently some other K or offsets
        (lambda: gpu_cost.predict(10, 64, 128, jnp.float64, 4), TypeError, "predict: dtype"),
        (lambda: gpu_cost.predict(10, 64, 128, "int8", 4), TypeError, "CUDA kernels take"),
        (lambda: gpu_cost.predict(-5, 64, 128, BF16, 4), ValueError, "rows must be >= 0"),
        (lambda: gpu_cost.predict(2.5, 64, 128, BF16, 4), TypeError, "rows"),
        (lambda: gpu_cost.predict(10, 64, 128, BF16, -3), ValueError, r"\[1, P\]"),
        (lambda: gpu_cost.predict(10, 64, 128, BF16, 2.5), TypeError, "num_diagonals"),
        (lambda: gpu_cost.predict(10, 64, 128, BF16, 500), ValueError, r"\[1, P\] = \[1, 128\]"),
        (lambda: gpu_cost.predict(10, 64, 128, BF16, offsets=[0, 999]), ValueError, "lie in"),
        (lambda: gpu_cost.predict(10, 64, 128, BF16, offsets=[-1, 3]), ValueError, "lie in"),
        (lambda: gpu_cost.predict(10, 64, 128, BF16, offsets=[0.5]), TypeError, "integer"),
    ],
)
def test_predict_refuses_what_the_kernels_cannot_run(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_zero_rows_cost_nothing_and_divide_by_nothing():
    """No launches for zero rows made the speed-up a ZeroDivisionError, in impl="auto" too."""
    pred = gpu_cost.predict(0, 128, 64, BF16, 2, block_size=16)
    assert pred.seconds["kernel"][0] == 0
    fwd, step = pred.speedup("kernel", "dense_layer")
    assert fwd >= 1 and step >= 1


@pytest.mark.parametrize(
    "call",
    [
        lambda: launch_plan.block_product_plan("fwd", 64, 128, 128, BF16),
        lambda: launch_plan.block_product_plan("fwd", 64, 128, 0, BF16),
        lambda: launch_plan.block_product_plan("fwd", 64, 128, -16, BF16),
        lambda: launch_plan.block_sddmm_plan(1000, 64, 128, 2, 128, BF16),
        lambda: launch_plan.workspace_bytes("dvalues", 1000, 64, 128, 2, BF16, block_size=128),
        lambda: launch_plan.workspace_bytes("dvalues", 1000, 0, 128, 2, BF16, block_size=16),
        lambda: launch_plan.workspace_bytes("dvalues", 100000, 64, 128, -1),
        lambda: launch_plan.sddmm_splits(-1, 64, 128, 2),
        lambda: launch_plan.product_layout("fwd", 64, 128, -1),
    ],
)
def test_launch_plans_refuse_shapes_the_planner_divides_by(call):
    """The C++ planners divided by zero blocks along the short axis: the interpreter died of
    SIGFPE, or a negative K came back as 2^64 bytes of workspace."""
    with pytest.raises(ValueError, match="block_size|in_features|rows|num_diagonals"):
        call()


def _imported_modules(module) -> set:
    """The dynadiag_jax modules a module's source imports, at any depth of its code."""
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.startswith("dynadiag_jax.")}


def test_imports_run_from_the_dispatch_to_the_plan():
    # ops/auto.py -> gpu_cost -> launch_plan: neither imports the ops back
    for module in (gpu_cost, launch_plan):
        ops = {n for n in _imported_modules(module) if n.startswith("dynadiag_jax.ops")}
        assert not ops, f"{module.__name__} imports {ops}"
    assert "dynadiag_jax.launch_plan" in _imported_modules(gpu_cost)
    assert not any("gpu_cost" in n for n in _imported_modules(launch_plan))
