"""Roofline cost model of the GPU paths of ``diag_matmul`` (docs/gpu_cost_model.md).

Every path is a list of launches, and every launch is counted from the launch plan the code really
uses (``xla_ext/cuda/launch_plan.h``, read through :mod:`dynadiag_jax.launch_plan`; the counts equal
the counters of the emulated kernels, tests/test_cuda_counts.py):

* ``mma``: warp-level ``16x16x16`` tensor-core products (``wmma::mma_sync`` calls);
* ``fma``: float32 CUDA-core fused multiply-adds (thread level);
* ``load_bytes`` / ``store_bytes``: bytes the launch reads / writes in global memory (operands,
  outputs, the lists and tiles of the workspace; per-block scalars are not counted). Every load goes
  through L2, so this is the L2 traffic;
* ``hbm_bytes``: HBM traffic under the **L2 reuse assumption**: every array a launch reads is
  fetched from HBM once and every array it writes is written once. The kernels' grids run the output
  panels of one row slab of ``x`` consecutively (output-fastest order), so the slab (at most
  ``128 rows x in`` elements per panel column) is reused from L2 by the panels that follow; weights,
  lists and tiles are small and stay resident. The assumption holds while the weights (``K * D`` or
  ``K * L_b * b * b`` elements) fit in :data:`WEIGHT_L2_BYTES`; beyond that the model charges one
  weight read from HBM per row slab.

A launch takes ``max(tensor, issue, hbm, l2, stages) + launch_seconds``: its tensor-core FLOPs at
the rate of its engine (``wmma`` for our kernels, ``dense`` for XLA's dot), its HBM bytes at the HBM
bandwidth, its L2 traffic at the L2 bandwidth, and - for our kernels - the warp
instructions it issues at the issue rate derated by its occupancy, and the time its pipeline stages
take:

* ``instructions``: counted from the compiled code. :mod:`dynadiag_jax.gpu_sass` holds, per kernel
  and region of its source, the SASS instructions a warp issues per unit (per MMA, per FMA
  instruction, per global load or store instruction, per pipeline trip, per thread block), read by
  ``scripts/sass_counts.py`` from the sm_90 build; each launch multiplies them by the units its plan
  executes. Runtime divisions, index maths and narrow loads are in these figures.
* occupancy (:func:`occupancy`): thread blocks per SM from the registers and shared memory that
  ``ptxas -v`` reports; below ``latency_warps`` warps per scheduler a scheduler cannot hide the
  latency of dependent instructions, so the issue rate is scaled by ``warps / latency_warps``.
* ``l2``: every global load and store of the SMs passes through the L2, and so does every HBM byte
  (the fills of what the SMs read, the write-back of what they write): ``(load + store + hbm)
  bytes / l2_bandwidth``. Both were measured on an H100: Nsight Compute's L2 bytes of the block
  kernels matched the SMs' loads and stores plus the HBM bytes (docs/gpu_cost_model.md), and the
  product kernels held the L2 92-99% busy at 4.0-4.6 TB/s of those bytes.
* ``stages``: a pipelined kernel's thread block runs its stages (one slice of x and weights loaded
  by cp.async, then multiplied) one after the other; the resident thread blocks (occupancy x SMs)
  share the launch's stages, so the term is ``stages x stage_seconds / resident blocks``.
  ``stage_seconds`` is fitted, not derived: on an H100 the tensor-core block kernels completed a
  stage every 1.1-1.8 us per resident thread block (Nsight Compute, 403,456 x 768 -> 3072,
  docs/gpu_cost_model.md), with two stages in the pipeline and with three alike, so it is not the
  latency of one stage's loads. The product kernels are held by the L2 (the ``l2`` term binds
  them); the others stall on fixed-latency dependencies and shared-memory loads, which this term
  stands for. 1.3 us puts each of the six profiled kernels within 30% of its time.

A path's time is the sum over its launches; a training step of the layer takes ``fwd + bwd``.

What it ignores: wave quantisation, L1 hits (the L2 term is an upper bound), clock throttling, the
sm_80 code (A100 predictions reuse the sm_90 instruction counts). It is a ranking model for
``impl="auto"``; only a GPU run (``scripts/gpu_check.sh``) measures.

Device specs: :data:`DEVICES` holds the H100 SXM and A100 SXM figures used by ``impl="auto"``; add
another with :func:`register_device` (a :class:`DeviceSpec`; ``device_kinds`` are substrings of
``jax.devices()[0].device_kind`` that select it).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from dynadiag_jax import gpu_sass, launch_plan
from dynadiag_jax._checks import int_at_least, int_in_range
from dynadiag_jax.layout import DiagGeometry, concrete_offsets, geometry

__all__ = [
    "DEVICES",
    "DeviceSpec",
    "Launch",
    "PathCost",
    "Prediction",
    "device_for_kind",
    "device_spec",
    "occupancy",
    "predict",
    "predict_layer",
    "register_device",
    "sass",
]


class DeviceSpec(NamedTuple):
    """Throughputs of one GPU model (sustained figures, not marketing peaks)."""

    name: str
    device_kinds: tuple  # substrings of jax's device_kind that select this spec
    dense_flops_16bit: float  # XLA/cuBLAS dot FLOP/s, bfloat16/float16 inputs
    dense_flops_f32: float  # XLA/cuBLAS dot FLOP/s, float32 inputs (TF32: JAX's default precision)
    wmma_flops: float  # our wmma (mma.sync m16n16k16) kernels, bf16/f16 inputs, f32 accumulation
    issue_rate: float  # warp instructions per second, whole GPU (SMs x 4 schedulers x clock)
    hbm_bandwidth: float  # bytes/s
    l2_bandwidth: float  # bytes/s through the L2: the SMs' loads and stores plus the HBM traffic
    l2_bytes: int
    launch_seconds: float  # per kernel launch inside a compiled XLA program
    sm_shared_bytes: int = 228 * 1024  # shared memory per SM (1 KiB of it reserved per block)
    sm_registers: int = 65536
    sm_max_warps: int = 64
    sm_max_blocks: int = 32
    # Warps per scheduler (4 per SM) needed to issue every cycle: dependent integer and shared
    # memory instructions take 4-30 cycles, the runtime divisions chain a dozen of them.
    latency_warps: int = 4
    sms: int = 132
    # Seconds a resident thread block of the tensor-core block kernels takes per pipeline stage,
    # fitted to the H100 profiles (1.1-1.8 us per kernel); the A100 has not been measured.
    stage_seconds: float = 1.3e-6


# H100 SXM5 80 GB: 132 SMs at ~1.75 GHz sustained; 989 TFLOP/s bf16 peak of which cuBLAS sustains
# ~800 on large GEMMs; wmma compiles to mma.sync, which on Hopper reaches about half the wgmma peak;
# 3.35 TB/s HBM3 peak (~3.0 sustained); L2 bandwidth measured: the block kernels moved 4.0-4.6 TB/s
# (SM traffic + HBM traffic, as Nsight Compute's lts__t_bytes counts) with the L2 92-99% busy.
H100 = DeviceSpec(
    name="H100",
    device_kinds=("H100", "H800", "GH200"),
    dense_flops_16bit=800e12,
    dense_flops_f32=400e12,
    wmma_flops=495e12,
    issue_rate=132 * 4 * 1.755e9,
    hbm_bandwidth=3.0e12,
    l2_bandwidth=4.5e12,
    l2_bytes=50 * 2**20,
    launch_seconds=3e-6,
)
# A100 SXM4 80 GB: 108 SMs at 1.41 GHz; 312 TFLOP/s bf16 peak (~250 sustained by cuBLAS, mma.sync
# is Ampere's native path: ~220 for wmma kernels); 2.04 TB/s HBM2e (~1.8 sustained); L2 not
# measured: the ~5 TB/s of public microbenchmarks scaled by the H100's measured 4.5 / assumed 7.
A100 = DeviceSpec(
    name="A100",
    device_kinds=("A100", "A800"),
    dense_flops_16bit=250e12,
    dense_flops_f32=125e12,
    wmma_flops=220e12,
    issue_rate=108 * 4 * 1.41e9,
    hbm_bandwidth=1.8e12,
    l2_bandwidth=3.2e12,
    l2_bytes=40 * 2**20,
    launch_seconds=3e-6,
    sm_shared_bytes=164 * 1024,
    sms=108,
)
DEVICES: dict[str, DeviceSpec] = {"H100": H100, "A100": A100}
DEFAULT_DEVICE = "H100"

# Warp instructions per thread-level FMA of the element diagonal walk that the kernels' path rule
# (TILE_COST of the launch plan, compiled into the kernels) was derived with: a global load, the
# FMA and index work, read off the source. The SASS counts are higher (gpu_sass); the rule stays
# until the kernels are rebuilt with a new one (tile_cost_ratio).
PATH_RULE_INSTRUCTIONS_PER_FMA = 3.0
MMA_FLOPS = 2 * 16 * 16 * 16  # one warp-level m16n16k16 product
WARP = 32


def register_device(spec: DeviceSpec) -> None:
    """Add (or replace) a device; ``impl="auto"`` picks it when a device kind matches."""
    if not isinstance(spec, DeviceSpec):
        raise TypeError(f"spec must be a DeviceSpec, got {type(spec).__name__}")
    DEVICES[spec.name] = spec


def device_for_kind(device_kind: str) -> DeviceSpec | None:
    """The spec whose ``device_kinds`` occur in ``device_kind`` (e.g. "NVIDIA H100 80GB HBM3")."""
    for spec in DEVICES.values():
        if any(k.lower() in device_kind.lower() for k in spec.device_kinds):
            return spec
    return None


def occupancy(registers: int, shared_bytes: int, threads: int, spec: DeviceSpec) -> tuple:
    """``(blocks per SM, warps per scheduler, issue efficiency)`` of a kernel.

    Registers are allocated per warp in units of 256 (8 per thread); each block also reserves
    1 KiB of shared memory. The efficiency is ``min(1, warps per scheduler / latency_warps)``.
    """
    warps = -(-threads // WARP)
    per_warp = -(-registers // 8) * 8 * WARP
    limits = [spec.sm_max_warps // warps, spec.sm_max_blocks]
    if registers:
        limits.append(spec.sm_registers // (per_warp * warps))
    if shared_bytes:
        limits.append(spec.sm_shared_bytes // (shared_bytes + 1024))
    blocks = min(limits)
    per_scheduler = blocks * warps / 4
    return blocks, per_scheduler, min(1.0, per_scheduler / spec.latency_warps)


def sass(kernel: str, dtype, flags: tuple = ()) -> dict:
    """The compiled kernel's figures (:mod:`dynadiag_jax.gpu_sass`): registers, smem, regions."""
    return gpu_sass.KERNELS[(kernel, jnp.dtype(dtype).name, tuple(flags))]


def _compiled(kernel: str, dtype, flags: tuple, warps: int) -> tuple:
    """``(figures, fields)``: a kernel's SASS figures, and the fields its :class:`Launch` records
    (registers, shared memory, threads per block of ``warps``, the kernel's key)."""
    figures = sass(kernel, dtype, flags)
    fields = dict(
        registers=figures["registers"],
        shared_bytes=figures["smem"],
        threads=warps * WARP,
        kernel=(kernel, tuple(flags)),
    )
    return figures, fields


def _instructions(figures: dict, **units) -> float:
    """Warp instructions of a launch: each region's SASS figure times the units it executes."""
    regions = figures["regions"]
    return float(sum(regions[name] * n for name, n in units.items() if n))


def device_spec(device) -> DeviceSpec:
    """The :class:`DeviceSpec` of ``device`` (a name in :data:`DEVICES`, or a spec); ValueError
    naming the known devices otherwise."""
    if isinstance(device, DeviceSpec):
        return device
    if device not in DEVICES:
        raise ValueError(f"device must be one of {tuple(DEVICES)} or a DeviceSpec, got {device!r}")
    return DEVICES[device]


class Launch(NamedTuple):
    """The counted work of one kernel launch (or one XLA op of the dense path)."""

    name: str
    ctas: int = 0
    mma: int = 0
    fma: int = 0
    load_bytes: int = 0
    store_bytes: int = 0
    hbm_bytes: int = 0
    engine: str = "wmma"  # "wmma": our kernels; "xla": XLA ops (dot FLOPs at the dense rate)
    dense_flops: float = 0.0  # XLA dot FLOPs
    instructions: float = 0.0  # warp instructions issued (SASS figures x executed units)
    registers: int = 0  # per thread (ptxas -v)
    shared_bytes: int = 0  # static shared memory per block (ptxas -v)
    threads: int = 0  # per block (the launch plan's); 0 for XLA ops and memsets
    stages: int = 0  # pipeline stages of the tensor-core kernels, all thread blocks together
    # the CUDA kernel that runs it: ``(template, template flags)``, its gpu_sass key less the
    # dtype; () for XLA ops and memsets. bench/ncu_compare.py joins profiles on it.
    kernel: tuple = ()

    def seconds(self, spec: DeviceSpec, dtype) -> float:
        """Roofline time: the slowest of its engines plus the launch cost."""
        return max(self.terms(spec, dtype).values()) + spec.launch_seconds

    def terms(self, spec: DeviceSpec, dtype) -> dict:
        """Seconds of each engine: ``tensor``, ``issue`` (occupancy-derated), ``hbm``, ``l2``,
        ``stages`` (of the pipeline)."""
        tensor = self.mma * MMA_FLOPS / spec.wmma_flops
        if self.dense_flops:
            wide = jnp.dtype(dtype).itemsize >= 4
            rate = spec.dense_flops_f32 if wide else spec.dense_flops_16bit
            tensor += self.dense_flops / rate
        issue = stages = 0.0
        if self.threads:
            blocks, _, efficiency = occupancy(self.registers, self.shared_bytes, self.threads, spec)
            issue = self.instructions / (spec.issue_rate * efficiency)
            resident = min(self.ctas, blocks * spec.sms)
            if self.stages and resident:
                stages = self.stages * spec.stage_seconds / resident
        return {
            "tensor": tensor,
            "issue": issue,
            "hbm": self.hbm_bytes / spec.hbm_bandwidth,
            "l2": (self.load_bytes + self.store_bytes + self.hbm_bytes) / spec.l2_bandwidth,
            "stages": stages,
        }


class PathCost(NamedTuple):
    """Launches of one path: the forward product and the backward (dx and dvalues)."""

    fwd: tuple
    bwd: tuple

    def seconds(self, spec: DeviceSpec, dtype) -> tuple:
        """``(fwd, bwd, fwd + bwd)`` seconds."""
        f = sum(launch.seconds(spec, dtype) for launch in self.fwd)
        b = sum(launch.seconds(spec, dtype) for launch in self.bwd)
        return f, b, f + b


class Prediction(NamedTuple):
    """Result of :func:`predict`: seconds per path (``fwd``, ``bwd``, ``step`` = fwd + bwd)."""

    device: str
    dtype: str
    rows: int
    in_features: int
    out_features: int
    num_diagonals: int
    block_size: int
    structure: str  # "offsets" (the given ones) or "spread" (K evenly spread: the scattered case)
    paths: dict  # name -> PathCost: "kernel", "dense" (build W + XLA's dot), "dense_layer"
    seconds: dict  # name -> (fwd, bwd, step)

    def speedup(self, path: str = "kernel", baseline: str = "dense_layer") -> tuple:
        """``(fwd, step)`` speed-ups of ``path`` over ``baseline`` (> 1: faster; ``inf`` where
        ``path`` launches nothing, as for zero rows, and ``baseline`` does)."""
        p, b = self.seconds[path], self.seconds[baseline]
        return tuple(b[i] / p[i] if p[i] else (math.inf if b[i] else 1.0) for i in (0, 2))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def spread_offsets(num_diagonals: int, num_candidates: int) -> np.ndarray:
    """``K`` offsets spread evenly over ``[0, P)``: what the model assumes when offsets are unknown.

    A search leaves diagonals scattered; even spreading is the scattered case with the most
    touched tiles, so predictions without offsets are the pessimistic ones.
    """
    k = np.arange(num_diagonals, dtype=np.int64)
    return (k * num_candidates) // max(num_diagonals, 1)


# --- element diagonals ------------------------------------------------------------------------


class ElementStructure(NamedTuple):
    """What the plan kernel computes for one product, per output block (arrays of ``n_ob``)."""

    n_list: np.ndarray  # diagonals touching the block (out-moving products), else K
    entries: np.ndarray  # non-zeros of M in the block's rows
    n_tiles: np.ndarray  # touched 16x16 tiles
    path: np.ndarray  # PATH_TENSOR_CORE / PATH_DIAGONAL of the launch plan


def element_structure(offsets, kind: str, geo: DiagGeometry, dtype):
    """The device plan of the element fwd (``kind="fwd"``) or ``dx`` product for these offsets."""
    const = launch_plan.constants()
    p, d = geo.num_candidates, geo.length
    layout = launch_plan.product_layout(kind, geo.in_features, geo.out_features, dtype=dtype)
    off = np.asarray(offsets, np.int64)
    k = off.size
    t = np.arange(d, dtype=np.int64)
    moving = (t[None, :] + off[:, None]) % p if k else np.zeros((0, d), np.int64)
    mb, tb = moving // const.TILE, np.broadcast_to(t // const.TILE, moving.shape)
    counts = np.bincount(
        (mb * layout.n_tb + tb).ravel(), minlength=layout.n_mb * layout.n_tb
    ).reshape(layout.n_mb, layout.n_tb)
    per_block = counts if layout.out_moving else counts.T  # [n_ob, n_qb]
    entries = per_block.sum(axis=1)
    n_tiles = (per_block > 0).sum(axis=1)
    if layout.out_moving:
        per_diag = np.bincount(
            (np.arange(k)[:, None] * layout.n_mb + mb).ravel(), minlength=k * layout.n_mb
        ).reshape(k, layout.n_mb)
        n_list = (per_diag > 0).sum(axis=0)
    else:
        n_list = np.full(layout.n_ob, k)
    cheaper = n_tiles * const.TILE_COST <= entries * const.ENTRY_COST
    on_tc = layout.tiles & (n_tiles > 0) & cheaper
    path = np.where(on_tc, const.PATH_TENSOR_CORE, const.PATH_DIAGONAL)
    return ElementStructure(n_list, entries, n_tiles, path)


def _slab_rows(rows: int, slab_rows: int) -> np.ndarray:
    """Valid rows of each row slab."""
    n = _cdiv(rows, slab_rows)
    r = np.full(n, slab_rows, np.int64)
    if n:
        r[-1] = rows - (n - 1) * slab_rows
    return r


def element_product_launches(kind, rows, geo: DiagGeometry, offsets, dtype) -> list:
    """Launches of the element fwd/dx product (plan kernel, product kernel)."""
    const = launch_plan.constants()
    in_features, out_features = geo.in_features, geo.out_features
    k = len(offsets)
    layout = launch_plan.product_layout(kind, in_features, out_features, k, dtype)
    s = _itemsize(dtype)
    if rows == 0:
        return []
    o_dim = out_features if kind == "fwd" else in_features
    q_dim = in_features if kind == "fwd" else out_features
    if k == 0:
        return [Launch("memset", store_bytes=rows * o_dim * s, hbm_bytes=rows * o_dim * s)]
    st = element_structure(offsets, kind, geo, dtype)
    om, structure = layout.lists, layout.tiles
    tc_blocks = st.path == const.PATH_TENSOR_CORE
    launches = []
    if om or structure:
        # offsets once per block; packing re-reads the list (k and offset) and read-modify-writes
        # every entry of the packed tiles after zeroing them
        packed = int(st.n_tiles[tc_blocks].sum())
        pack_entries = int(st.entries[tc_blocks].sum())
        pack_list = int(st.n_list[tc_blocks].sum()) * (8 if om else 4)
        load = layout.n_ob * 4 * k + pack_list + 2 * s * pack_entries
        store = (
            om * 4 * int(st.n_list.sum() + layout.n_ob)
            + structure * 4 * int(st.n_tiles.sum() + 2 * layout.n_ob)
            + s * (packed * const.TILE * const.TILE + pack_entries)
        )
        plan, plan_fields = _compiled(
            "element_plan_kernel", dtype, (layout.out_moving,), const.PLAN_WARPS
        )
        launches.append(
            Launch(
                "element_plan",
                ctas=layout.n_ob,
                load_bytes=load,
                store_bytes=store,
                hbm_bytes=4 * k + s * pack_entries + store,
                instructions=_instructions(plan, cta=layout.n_ob * const.PLAN_WARPS),
                **plan_fields,
            )
        )
    slab = _slab_rows(rows, const.ELEM_ROWS)
    n_slabs, rows_sum = len(slab), int(slab.sum())
    q_width = np.minimum(const.TILE, q_dim - np.arange(layout.n_qb) * const.TILE)
    # Per output block: tensor-core path work per row slab, or diagonal path work.
    tiles = int(st.n_tiles[tc_blocks].sum())
    mma = tiles * const.ELEM_WARPS * n_slabs
    x_tc = 0
    if tiles:  # x slices of each touched tile: valid rows x valid columns
        per_tile_cols = _touched_tile_widths(offsets, geo, layout, q_width)
        x_tc = int(per_tile_cols[tc_blocks].sum()) * rows_sum * s
    tc_load = x_tc + tiles * n_slabs * (4 + const.TILE * const.TILE * s)
    diag = ~tc_blocks
    entries_diag = int(st.entries[diag].sum())
    groups = np.minimum(const.ELEM_GROUPS, slab)  # thread groups holding at least one row
    fma = entries_diag * rows_sum
    meta = (8 if om else 4) * int(st.n_list[diag].sum()) * n_slabs
    diag_load = meta + entries_diag * s * (rows_sum + int(groups.sum()))
    store = rows_sum * o_dim * s
    weights = k * geo.length * s
    packed = int(st.n_tiles[tc_blocks].sum()) * const.TILE * const.TILE * s
    hbm = rows * q_dim * s + store + _weight_hbm(weights + packed, n_slabs)
    warps = const.ELEM_WARPS
    product, product_fields = _compiled(
        "element_product_kernel", dtype, (layout.out_moving,), warps
    )
    tc_count = int(tc_blocks.sum())
    instructions = _instructions(
        product,
        mma=mma,
        # every thread loads its 8 slots of a 128 x 16 x slice (predicated past the last row)
        x_load=tiles * n_slabs * const.ELEM_ROWS * const.TILE // WARP,
        tc_store=tc_count * rows_sum * const.TILE // WARP,
        stage=int(np.sum(-(-st.n_tiles[tc_blocks] // 2))) * n_slabs * warps,
        fma=fma / WARP,
        diag_store=(layout.n_ob - tc_count) * rows_sum * const.TILE // WARP,
        cta=layout.n_ob * n_slabs * warps,
    )
    launches.append(
        Launch(
            "element_product",
            ctas=layout.n_ob * n_slabs,
            mma=mma,
            fma=fma,
            load_bytes=tc_load + diag_load,
            store_bytes=store,
            hbm_bytes=hbm,
            instructions=instructions,
            **product_fields,
        )
    )
    return launches


def _touched_tile_widths(offsets, geo: DiagGeometry, layout, q_width) -> np.ndarray:
    """Per output block: the summed input widths of its touched tiles."""
    const = launch_plan.constants()
    off = np.asarray(offsets, np.int64)
    t = np.arange(geo.length, dtype=np.int64)
    moving = (t[None, :] + off[:, None]) % geo.num_candidates
    touched = np.zeros((layout.n_mb, layout.n_tb), bool)
    touched[moving // const.TILE, np.broadcast_to(t // const.TILE, moving.shape)] = True
    per_block = touched if layout.out_moving else touched.T
    return (per_block * q_width[None, :]).sum(axis=1)


# Weights up to this size stay in L2 across row slabs (half of the smaller L2 of the two specs).
WEIGHT_L2_BYTES = 20 * 2**20


def _weight_hbm(weight_bytes: int, n_slabs: int) -> int:
    """HBM bytes of the weights: once, or once per row slab when they do not stay in L2."""
    return weight_bytes if weight_bytes <= WEIGHT_L2_BYTES else weight_bytes * max(n_slabs, 1)


def element_dvalues_launches(rows, geo: DiagGeometry, offsets, dtype) -> list:
    """Launches of the element dvalues (diagonal SDDMM on CUDA cores, + split reduction)."""
    const = launch_plan.constants()
    in_features, out_features = geo.in_features, geo.out_features
    s = _itemsize(dtype)
    k, d = len(offsets), geo.length
    if k == 0:
        return []
    if rows == 0:
        return [Launch("memset", store_bytes=k * d * s, hbm_bytes=k * d * s)]
    splits = launch_plan.sddmm_splits(rows, in_features, out_features, k)
    valid = int(np.sum((np.asarray(offsets) >= 0) & (np.asarray(offsets) < geo.num_candidates)))
    groups = _cdiv(k, const.SDDMM_DIAGS)
    fma = valid * d * rows
    load = (groups * d + valid * d) * rows * s
    out = k * d * (4 * splits if splits > 1 else s)  # the partial sums of every split
    ctas = _cdiv(d, const.SDDMM_LANES) * groups * splits
    sddmm, sddmm_fields = _compiled("sddmm_kernel", dtype, (), const.SDDMM_WARPS)
    launches = [
        Launch(
            "element_sddmm",
            ctas=ctas,
            fma=fma,
            load_bytes=load,
            store_bytes=out,
            hbm_bytes=rows * (in_features + out_features) * s + out,
            instructions=_instructions(sddmm, fma=fma / WARP, cta=ctas * const.SDDMM_WARPS),
            **sddmm_fields,
        )
    ]
    if splits > 1:
        launches.append(_reduce_launch(k * d, splits, dtype))
    return launches


def _reduce_launch(n: int, splits: int, dtype) -> Launch:
    """The fixed-order sum of ``splits`` float32 partial results of ``n`` elements."""
    const = launch_plan.constants()
    ctas = _cdiv(n, const.REDUCE_THREADS)
    warps = const.REDUCE_THREADS // WARP
    reduce, reduce_fields = _compiled("sddmm_reduce_kernel", dtype, (), warps)
    return Launch(
        "sddmm_reduce",
        ctas=ctas,
        load_bytes=splits * n * 4,
        store_bytes=n * _itemsize(dtype),
        hbm_bytes=splits * n * 4 + n * _itemsize(dtype),
        instructions=_instructions(reduce, load=splits * n / WARP, cta=ctas * warps),
        **reduce_fields,
    )


# --- block diagonals --------------------------------------------------------------------------


def block_product_launches(kind, rows, geo: DiagGeometry, offsets, dtype) -> list:
    """Launch of the block fwd/dx product (one kernel, no workspace)."""
    const = launch_plan.constants()
    in_features, out_features, b = geo
    plan = launch_plan.block_product_plan(kind, in_features, out_features, b, dtype)
    s = _itemsize(dtype)
    off = np.asarray(offsets, np.int64)
    k = off.size
    o_dim = out_features if kind == "fwd" else in_features
    q_dim = in_features if kind == "fwd" else out_features
    if rows == 0:
        return []
    if k == 0:
        return [Launch("memset", store_bytes=rows * o_dim * s, hbm_bytes=rows * o_dim * s)]
    p_b, l_b = geo.num_candidates, geo.length
    valid = (off >= 0) & (off < p_b)
    slab = _slab_rows(rows, plan.slab_rows)
    n_slabs, rows_sum = len(slab), int(slab.sum())
    sw = plan.slice_width
    slices_per_block = b // sw
    loads = stores = mma = fma = 0
    # per row slab: loaded x slices, weight elements, loop trips; tensor cores: stored tiles
    x_slices = w_elements = trips = tiles = 0
    for panel in range(plan.n_panels):
        s_idx, chunk = panel % p_b, panel // p_b
        if plan.out_long:  # one x block per diagonal, shared by the panel's valid wraps
            wraps = [
                s_idx + (chunk * plan.wraps_per_panel + w) * p_b
                for w in range(plan.wraps_per_panel)
            ]
            u = sum(t < l_b for t in wraps)
            n_x_blocks = int(valid.sum())
            weight_blocks = n_x_blocks * u
            cols = u * b
        else:  # one x block and one weight block per (diagonal, wrap) term
            r = (s_idx - off[valid]) % p_b
            n_x_blocks = int(sum(((r + w * p_b) < l_b).sum() for w in range(plan.wraps)))
            weight_blocks = n_x_blocks
            cols = b
        x_load = n_x_blocks * slices_per_block * sw * rows_sum * s
        w_load = weight_blocks * slices_per_block * b * sw * s * n_slabs
        stores += rows_sum * cols * s
        x_slices += n_x_blocks * slices_per_block
        w_elements += weight_blocks * slices_per_block * b * sw
        if plan.tensor_cores:
            # the slice table: one offset per x block (diagonal, or diagonal and wrap); every
            # entry's slices are visited, empty ones too
            entries = k if plan.out_long else k * plan.wraps
            # rows past a partial slab's end are loaded too (a copy of its last row)
            x_load = n_x_blocks * slices_per_block * sw * plan.slab_rows * n_slabs * s
            loads += x_load + w_load + 4 * entries * n_slabs
            trips += entries * slices_per_block
            tiles += (cols // 16) * (plan.slab_rows // 16)
            mma += weight_blocks * slices_per_block * (b // 16) * (plan.slab_rows // 16) * n_slabs
        else:
            loads += x_load + w_load + 4 * k * n_slabs
            trips += k * (1 if plan.out_long else plan.wraps) * slices_per_block
            fma += weight_blocks * b * b * const.BLOCK_ROWS * n_slabs
    weights = k * l_b * b * b * s
    hbm = rows * (q_dim + o_dim) * s + _weight_hbm(weights, n_slabs)
    ctas = plan.n_panels * n_slabs
    warps = const.BLOCK_WARPS
    if plan.tensor_cores:
        flags = (plan.out_long, kind == "dx", b, plan.cols)
        kernel, kernel_fields = _compiled("block_product_tc_kernel", dtype, flags, warps)
        instructions = _instructions(
            kernel,
            mma=mma,
            stage=trips * n_slabs * warps,
            store=tiles * n_slabs,  # one 16-byte store per lane and stored 16x16 tile
            cta=ctas * warps,
        )
    else:
        kernel, kernel_fields = _compiled(
            "block_product_simt_kernel", dtype, (plan.out_long, kind == "dx"), warps
        )
        instructions = _instructions(
            kernel,
            fma=fma / WARP,
            # every thread loads its slots of a 128-row x slice (predicated past the last row)
            x_load=x_slices * n_slabs * const.BLOCK_ROWS * 16 // WARP,
            w_load=w_elements * n_slabs / WARP,
            store=stores / s / WARP,
            stage=trips * n_slabs * warps,
            cta=ctas * warps,
        )
    return [
        Launch(
            "block_product",
            ctas=ctas,
            mma=mma,
            fma=fma,
            load_bytes=loads,
            store_bytes=stores,
            hbm_bytes=hbm,
            instructions=instructions,
            stages=trips * n_slabs if plan.tensor_cores else 0,
            **kernel_fields,
        )
    ]


def block_dvalues_launches(rows, geo: DiagGeometry, offsets, dtype) -> list:
    """Launches of the block dvalues (block SDDMM, + the fixed-order split reduction)."""
    in_features, out_features, b = geo
    s = _itemsize(dtype)
    off = np.asarray(offsets, np.int64)
    k = off.size
    if k == 0:
        return []
    p_b, l_b = geo.num_candidates, geo.length
    n_out = k * l_b * b * b
    if rows == 0:
        return [Launch("memset", store_bytes=n_out * s, hbm_bytes=n_out * s)]
    plan = launch_plan.block_sddmm_plan(rows, in_features, out_features, k, b, dtype)
    tc = plan.tensor_cores
    valid = (off >= 0) & (off < p_b)
    split_rows = _slab_rows(rows, plan.rows_per_split)
    # every split runs its rows in stages; the last stage of a split is padded (zero-filled in
    # shared memory on tensor cores, predicated loads on CUDA cores)
    stage_rows = plan.stage_rows
    stages = sum(_cdiv(int(r), stage_rows) for r in split_rows)
    rows_padded = stages * stage_rows
    loads = mma = fma = loaded = 0
    frag = (b // 16) ** 2 if tc else 0
    for chunk in range(plan.wrap_chunks):
        for r in range(p_b):
            ts = [r + (chunk * plan.wraps_per_cta + w) * p_b for w in range(plan.wraps_per_cta)]
            u = sum(t < l_b for t in ts)
            for g in range(plan.groups):
                ks = range(g * plan.diags_per_cta, min(k, (g + 1) * plan.diags_per_cta))
                v = int(sum(valid[kk] for kk in ks))
                if tc and u == 0:
                    continue  # a chunk past L_b: no tiles, nothing read
                loads += (u + v) * b * rows * s + 4 * len(ks) * plan.splits
                loaded += (u + v) * b * rows_padded
                if tc:
                    mma += u * v * frag * (rows_padded // 16)
                else:
                    fma += u * v * b * b * rows_padded
    out_bytes = n_out * (4 * plan.splits if plan.splits > 1 else s)
    ctas = plan.wrap_chunks * p_b * plan.groups * plan.splits
    base = plan.wrap_chunks * p_b * plan.groups  # thread blocks per row split
    warps = launch_plan.constants().BLOCK_WARPS
    if tc:
        kernel, kernel_fields = _compiled("block_sddmm_tc_kernel", dtype, (b,), warps)
        instructions = _instructions(
            kernel,
            mma=mma,
            load=loaded / 8 / WARP,  # one 16-byte cp.async (or zero fill) per 8 elements
            # one 16-byte store per lane and 16x16 tile: 8 outputs, or 4 float32 partial sums
            store=n_out // 256 * (2 * plan.splits if plan.splits > 1 else 1),
            stage=stages * base * warps,
            cta=ctas * warps,
        )
    else:
        kernel, kernel_fields = _compiled("block_sddmm_simt_kernel", dtype, (), warps)
        instructions = _instructions(
            kernel,
            fma=fma / WARP,
            load=loaded / WARP,
            store=n_out * plan.splits / WARP,
            stage=stages * base * warps,
            cta=ctas * warps,
        )
    launches = [
        Launch(
            "block_sddmm",
            ctas=ctas,
            mma=mma,
            fma=fma,
            load_bytes=loads,
            store_bytes=out_bytes,
            hbm_bytes=rows * (in_features + out_features) * s + out_bytes,
            instructions=instructions,
            stages=stages * base if tc else 0,
            **kernel_fields,
        )
    ]
    if plan.splits > 1:
        launches.append(_reduce_launch(n_out, plan.splits, dtype))
    return launches


# --- XLA's dense dot --------------------------------------------------------------------------


def _dot(name, m, k, n, s, out_itemsize=None) -> Launch:
    out_itemsize = s if out_itemsize is None else out_itemsize
    return Launch(
        name,
        engine="xla",
        dense_flops=2.0 * m * k * n,
        hbm_bytes=(m * k + k * n) * s + m * n * out_itemsize,
    )


def dense_path(rows, in_features, out_features, nonzeros, dtype) -> PathCost:
    """Build W on the device (zeros + scatter), XLA's dot; backward: two dots and a gather."""
    s = _itemsize(dtype)
    w = in_features * out_features
    build = (
        Launch("zeros_w", engine="xla", hbm_bytes=w * s),
        Launch("scatter_w", engine="xla", hbm_bytes=nonzeros * (2 * s + 8)),
    )
    fwd = (*build, _dot("dot_y", rows, in_features, out_features, s))
    bwd = (
        _dot("dot_dx", rows, out_features, in_features, s),
        _dot("dot_dw", out_features, rows, in_features, s, out_itemsize=4),
        Launch("gather_dvalues", engine="xla", hbm_bytes=nonzeros * (4 + s + 8)),
    )
    return PathCost(fwd, bwd)


def dense_layer(rows, in_features, out_features, dtype) -> PathCost:
    """The dense layer DynaDiag replaces: ``x @ W.T`` with ``W`` a parameter (cuBLAS)."""
    s = _itemsize(dtype)
    return PathCost(
        (_dot("dot_y", rows, in_features, out_features, s),),
        (
            _dot("dot_dx", rows, out_features, in_features, s),
            _dot("dot_dw", out_features, rows, in_features, s),
        ),
    )


def kernel_path(rows, geo: DiagGeometry, offsets, dtype) -> PathCost:
    """Our kernels: forward; backward = dx + dvalues."""
    if not geo.blocked:
        fwd = element_product_launches("fwd", rows, geo, offsets, dtype)
        dx = element_product_launches("dx", rows, geo, offsets, dtype)
        dv = element_dvalues_launches(rows, geo, offsets, dtype)
    else:
        fwd = block_product_launches("fwd", rows, geo, offsets, dtype)
        dx = block_product_launches("dx", rows, geo, offsets, dtype)
        dv = block_dvalues_launches(rows, geo, offsets, dtype)
    return PathCost(tuple(fwd), tuple(dx) + tuple(dv))


def predict(
    rows: int,
    in_features: int,
    out_features: int,
    dtype,
    num_diagonals: int | None = None,
    *,
    block_size: int = 1,
    offsets=None,
    device="H100",
) -> Prediction:
    """Predicted seconds of every GPU path of ``diag_matmul`` on one layer.

    Args:
      rows: product of the leading dimensions of ``x``.
      in_features, out_features: the layer; dtype: of ``x`` and ``values``.
      num_diagonals: ``K`` (taken from ``offsets`` when those are given).
      block_size: 1 (element diagonals) or ``b`` (block diagonals).
      offsets: concrete diagonal ids; None assumes ``K`` evenly spread (the scattered case).
      device: a name in :data:`DEVICES` or a :class:`DeviceSpec`.

    Returns:
      :class:`Prediction` with the paths ``kernel``, ``dense`` (build ``W`` from the diagonals,
      XLA's dot) and ``dense_layer`` (XLA's dot with ``W`` given: the layer being replaced).
    """
    geo = geometry(in_features, out_features, block_size)
    return predict_layer(rows, geo, dtype, num_diagonals, offsets=offsets, device=device)


def predict_layer(
    rows: int,
    geo: DiagGeometry,
    dtype,
    num_diagonals: int | None = None,
    *,
    offsets=None,
    device="H100",
) -> Prediction:
    """:func:`predict` for a layer whose geometry the caller holds (``diag_matmul``'s dispatch
    computes it once per call and hands it down)."""
    spec = device_spec(device)
    dtype = launch_plan.kernel_dtype(dtype, "predict")
    rows = int_at_least(rows, "rows", 0)
    in_features, out_features, block_size = geo
    if offsets is None:
        if num_diagonals is None:
            raise ValueError("give num_diagonals or offsets")
        p = "P_b" if geo.blocked else "P"
        k = int_in_range(num_diagonals, "num_diagonals", 1, geo.num_candidates, f"[1, {p}]")
        off, structure = spread_offsets(k, geo.num_candidates), "spread"
    else:
        off, structure = concrete_offsets(offsets, geo, "predict"), "offsets"
    k = off.size
    per_diag = geo.length * (block_size * block_size if geo.blocked else 1)
    paths = {
        "kernel": kernel_path(rows, geo, off, dtype),
        "dense": dense_path(rows, in_features, out_features, k * per_diag, dtype),
        "dense_layer": dense_layer(rows, in_features, out_features, dtype),
    }
    return Prediction(
        device=spec.name,
        dtype=jnp.dtype(dtype).name,
        rows=rows,
        in_features=in_features,
        out_features=out_features,
        num_diagonals=k,
        block_size=block_size,
        structure=structure,
        paths=paths,
        seconds={name: p.seconds(spec, dtype) for name, p in paths.items()},
    )


def tile_cost_ratio(spec: DeviceSpec | str = H100, dtype=jnp.bfloat16) -> float:
    """Model cost of one tensor-core tile over one diagonal entry, per 128-row slab, on ``spec``
    (a :class:`DeviceSpec` or a name in :data:`DEVICES`).

    The element kernels take the tensor-core path for an output block when
    ``tiles * TILE_COST <= entries * ENTRY_COST`` (``xla_ext/cuda/launch_plan.h``); this is the
    ratio those integer constants round.
    """
    spec = device_spec(spec)
    const = launch_plan.constants()
    s = _itemsize(dtype)
    rows = const.ELEM_ROWS
    tile = max(
        rows * const.TILE * const.TILE * 2 / spec.wmma_flops,
        (rows * const.TILE * s + const.TILE * const.TILE * s) / spec.l2_bandwidth,
    )
    entry = max(
        rows * PATH_RULE_INSTRUCTIONS_PER_FMA / WARP / spec.issue_rate,
        (rows + const.ELEM_GROUPS) * s / spec.l2_bandwidth,
    )
    return tile / entry
