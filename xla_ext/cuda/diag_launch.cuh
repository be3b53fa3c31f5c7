// Host side of the CUDA kernels: the workspace plans and the launch sequence of each target.
// Written once for both builds: `Launcher` is a small policy with
//   launch(grid, block, kernel, args...)   kernel<<<grid, block, 0, stream>>>(args...) or emu::launch
//   launch.memset(ptr, bytes)              cudaMemsetAsync(ptr, 0, bytes, stream) or std::memset
//   launch.output(ptr, count, row, name)   declares an output the sequence writes exactly once per
//                                          element (simt::store in the kernels, or a memset); the
//                                          emulation checks it, the CUDA launcher ignores it
// The plans are mirrored by dynadiag_jax/ops/cuda.py (workspace_bytes and the block plans) and the
// launches counted by dynadiag_jax/gpu_cost.py; tests compare both.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cuda/block_kernels.cuh"
#include "cuda/diag_kernels.cuh"

namespace dynadiag {
namespace cuda {

constexpr size_t kWorkspaceAlign = 256;
// Element dvalues: split the rows over grid.z until about kSddmmTargetBlocks blocks are in flight,
// keeping at least kSddmmRowsPerSplit rows per split.
constexpr int64_t kSddmmRowsPerSplit = 256;
constexpr int64_t kSddmmMaxSplits = 64;
constexpr int64_t kSddmmTargetBlocks = 512;
// Block dvalues: the same idea over its 1-D grid.
constexpr int64_t kBlockSddmmTargetCtas = 1024;
constexpr int64_t kBlockSddmmMaxSplits = 64;
constexpr int64_t kBlockSddmmRowsPerSplit = 512;
constexpr int64_t kMaxGridYZ = 65535;
constexpr int64_t kMaxGridX = std::numeric_limits<int32_t>::max();

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline size_t align_up(size_t n) { return (n + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

template <class T>
constexpr bool kHasTensorCorePath =
    std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value;

// ---- element diagonals --------------------------------------------------------------------------
// Forward (transpose = false: out = y, in = x) or dx (transpose = true: out = dx, in = dy) of
// W[out_features, in_features]. Workspace segments (256-byte aligned): the diagonal lists
// [n_ob, K] and their lengths [n_ob] (out-moving products), then for 16-bit dtypes with at most
// kMaxPlanBlocks input blocks the structure: touched input blocks [n_ob, n_qb], their number
// [n_ob], the path [n_ob] and the packed 16x16 tiles [n_ob * n_qb, 16, 16] (2-byte elements).
struct ProductPlan {
  int32_t P, D, n_mb, n_tb, n_ob, n_qb;
  bool out_moving, lists, tiles;
  size_t list_at, nlist_at, tiles_at, ntiles_at, path_at, packed_at, workspace_bytes;
};

inline ProductPlan plan_product(int64_t in_features, int64_t out_features, bool transpose, int64_t K,
                                bool tensor_cores) {
  ProductPlan p{};
  const bool tall = out_features >= in_features;
  p.P = static_cast<int32_t>(tall ? out_features : in_features);
  p.D = static_cast<int32_t>(tall ? in_features : out_features);
  p.n_mb = static_cast<int32_t>(ceil_div(p.P, kTile));
  p.n_tb = static_cast<int32_t>(ceil_div(p.D, kTile));
  p.out_moving = transpose ? !tall : tall;
  p.n_ob = p.out_moving ? p.n_mb : p.n_tb;
  p.n_qb = p.out_moving ? p.n_tb : p.n_mb;
  p.lists = p.out_moving;
  p.tiles = tensor_cores && p.n_qb <= kMaxPlanBlocks;
  size_t at = 0;
  p.list_at = at;
  at += p.lists ? align_up(sizeof(int32_t) * size_t(p.n_ob) * size_t(K)) : 0;
  p.nlist_at = at;
  at += p.lists ? align_up(sizeof(int32_t) * size_t(p.n_ob)) : 0;
  p.tiles_at = at;
  at += p.tiles ? align_up(sizeof(int32_t) * size_t(p.n_ob) * p.n_qb) : 0;
  p.ntiles_at = at;
  at += p.tiles ? align_up(sizeof(int32_t) * size_t(p.n_ob)) : 0;
  p.path_at = at;
  at += p.tiles ? align_up(sizeof(int32_t) * size_t(p.n_ob)) : 0;
  p.packed_at = at;
  at += p.tiles ? align_up(2 * size_t(p.n_ob) * p.n_qb * kTileArea) : 0;
  p.workspace_bytes = at;
  return p;
}

// dvalues: float partial sums [splits, K, D] when splits > 1. With a smaller workspace than
// requested (e.g. a vmapped call that multiplied the rows) the plan uses fewer splits.
struct SddmmPlan {
  int32_t splits;
  int64_t rows_per_split;
  size_t workspace_bytes;
};

inline SddmmPlan plan_sddmm(int64_t rows, int64_t in_features, int64_t out_features, int64_t K,
                            size_t available = std::numeric_limits<size_t>::max()) {
  const int64_t D = in_features < out_features ? in_features : out_features;
  const int64_t blocks = ceil_div(D, kSddmmLanes) * ceil_div(K, kSddmmDiags);
  int64_t splits = ceil_div(rows, kSddmmRowsPerSplit);
  if (splits > kSddmmMaxSplits) splits = kSddmmMaxSplits;
  if (blocks > 0 && splits > ceil_div(kSddmmTargetBlocks, blocks))
    splits = ceil_div(kSddmmTargetBlocks, blocks);
  const size_t per_split = sizeof(float) * size_t(K) * size_t(D);
  if (per_split > 0 && splits > 1 && size_t(splits) * per_split > available)
    splits = static_cast<int64_t>(available / per_split);
  if (splits < 2 || per_split == 0) splits = 1;
  SddmmPlan p{};
  p.splits = static_cast<int32_t>(splits);
  p.rows_per_split = rows > 0 ? ceil_div(rows, splits) : 0;
  p.workspace_bytes = splits > 1 ? size_t(splits) * per_split : 0;
  return p;
}

// ---- block diagonals ----------------------------------------------------------------------------
struct BlockGeometry {
  int32_t b, P_b, L_b, wraps;
  bool tall;
};

inline BlockGeometry block_geometry(int64_t in_features, int64_t out_features, int64_t b) {
  BlockGeometry g{};
  const int64_t nb_in = in_features / b, nb_out = out_features / b;
  g.b = static_cast<int32_t>(b);
  g.tall = out_features >= in_features;
  g.P_b = static_cast<int32_t>(nb_in < nb_out ? nb_in : nb_out);
  g.L_b = static_cast<int32_t>(nb_in < nb_out ? nb_out : nb_in);
  g.wraps = static_cast<int32_t>(ceil_div(g.L_b, g.P_b));
  return g;
}

// Panels of the fwd (transpose = false) or dx product (block_kernels.cuh); no workspace. On tensor
// cores `cols` is the kernel's panel width (the panel's output blocks, rounded up to a power of
// two) and `slab_rows` its rows per thread block (TcPanel); on CUDA cores kBlockRows.
struct BlockProductPlan {
  BlockGeometry g;
  bool out_long, tensor_cores;
  int32_t per_panel, n_panels, cols, slab_rows;
};

inline int32_t tc_panel_cols(int32_t per_panel, int32_t b) {
  int32_t cols = b;
  while (cols < per_panel * b) cols *= 2;
  return cols;
}
inline int32_t tc_slab_rows(int32_t cols) { return cols >= kBlockMaxCols ? kBlockRows : 2 * kBlockRows; }

inline BlockProductPlan plan_block_product(int64_t in_features, int64_t out_features, bool transpose,
                                           int64_t b, bool tensor_core_dtype) {
  BlockProductPlan p{};
  p.g = block_geometry(in_features, out_features, b);
  p.out_long = transpose ? !p.g.tall : p.g.tall;
  p.tensor_cores = tensor_core_dtype && b % 16 == 0;
  const int32_t fit = static_cast<int32_t>(kBlockMaxCols / b > 1 ? kBlockMaxCols / b : 1);
  p.per_panel = p.out_long ? (p.g.wraps < fit ? p.g.wraps : fit) : 1;
  p.n_panels = p.g.P_b * (p.out_long ? static_cast<int32_t>(ceil_div(p.g.wraps, p.per_panel)) : 1);
  p.cols = p.tensor_cores ? tc_panel_cols(p.per_panel, p.g.b) : 0;
  p.slab_rows = p.tensor_cores ? tc_slab_rows(p.cols) : kBlockRows;
  return p;
}

// Thread blocks of the block SDDMM: (residue, wrap chunk, diagonal group, row split); float32
// partial sums [splits, K, L_b, b, b] when splits > 1 (fewer splits with a smaller workspace).
struct BlockSddmmPlan {
  BlockGeometry g;
  bool tensor_cores;
  int32_t per_cta, chunks, diags, groups, splits;
  int64_t rows_per_split;
  size_t workspace_bytes;
};

inline int64_t tc_sddmm_max_blocks(int64_t b) {
  switch (b) {
    case 16: return TcSddmm<16>::kMaxBlocks;
    case 32: return TcSddmm<32>::kMaxBlocks;
    case 64: return TcSddmm<64>::kMaxBlocks;
    default: return TcSddmm<128>::kMaxBlocks;
  }
}

inline BlockSddmmPlan plan_block_sddmm(int64_t rows, int64_t in_features, int64_t out_features, int64_t K,
                                       int64_t b, size_t itemsize, bool tensor_core_dtype,
                                       size_t available = std::numeric_limits<size_t>::max()) {
  BlockSddmmPlan p{};
  p.g = block_geometry(in_features, out_features, b);
  p.tensor_cores = tensor_core_dtype && b % 16 == 0;
  const int64_t cap = kBlockSddmmMaxElems / (b * b) > 1 ? kBlockSddmmMaxElems / (b * b) : 1;
  int64_t root = static_cast<int64_t>(std::sqrt(static_cast<double>(cap)));
  while (root * root > cap) --root;
  while ((root + 1) * (root + 1) <= cap) ++root;
  p.per_cta = static_cast<int32_t>(p.g.wraps < root ? p.g.wraps : root);
  // blocks a stage holds: the tensor-core kernel's padded stages (TcSddmm), else 16 rows of b
  const int64_t stage_blocks = p.tensor_cores ? tc_sddmm_max_blocks(b)
                                             : kBlockSddmmStageBytes / (kBlockSddmmStageRows * b * int64_t(itemsize));
  const int64_t room = stage_blocks - p.per_cta;
  int64_t diags = K > 1 ? K : 1;
  if (diags > cap / p.per_cta) diags = cap / p.per_cta;
  if (diags > room) diags = room;
  if (diags < 1) diags = 1;
  p.diags = static_cast<int32_t>(diags);
  p.groups = static_cast<int32_t>(ceil_div(K, diags));
  p.chunks = static_cast<int32_t>(ceil_div(p.g.wraps, p.per_cta));
  const int64_t base = int64_t(p.g.P_b) * p.chunks * (p.groups > 1 ? p.groups : 1);
  int64_t splits = ceil_div(rows, kBlockSddmmRowsPerSplit);
  if (splits > kBlockSddmmMaxSplits) splits = kBlockSddmmMaxSplits;
  if (splits > ceil_div(kBlockSddmmTargetCtas, base)) splits = ceil_div(kBlockSddmmTargetCtas, base);
  const size_t per_split = sizeof(float) * size_t(K) * size_t(p.g.L_b) * size_t(b) * size_t(b);
  if (per_split > 0 && splits > 1 && size_t(splits) * per_split > available)
    splits = static_cast<int64_t>(available / per_split);
  if (splits < 2 || per_split == 0) splits = 1;
  p.splits = static_cast<int32_t>(splits);
  p.rows_per_split = rows > 0 ? ceil_div(rows, splits) : 0;
  p.workspace_bytes = splits > 1 ? size_t(splits) * per_split : 0;
  return p;
}

// ---- limits, checked by the handlers before launching; nullptr when the shapes fit --------------
inline const char* product_limits(const ProductPlan& p, int64_t rows) {
  if (int64_t(p.n_ob) * ceil_div(rows, kElemRows) > kMaxGridX) return "too many rows for one launch";
  return nullptr;
}

inline const char* sddmm_limits(int64_t K, int64_t D) {
  if (ceil_div(K, kSddmmDiags) > kMaxGridYZ) return "too many diagonals for one launch (at most 524280)";
  if (ceil_div(D, kSddmmLanes) > kMaxGridX) return "diagonals too long for one launch";
  return nullptr;
}

inline const char* block_product_limits(const BlockProductPlan& p, int64_t rows) {
  if (int64_t(p.n_panels) * ceil_div(rows, p.slab_rows) > kMaxGridX) return "too many rows for one launch";
  return nullptr;
}

inline const char* block_sddmm_limits(const BlockSddmmPlan& p) {
  if (int64_t(p.g.P_b) * p.chunks * p.groups * p.splits > kMaxGridX) return "too many blocks for one launch";
  return nullptr;
}

// ---- launch sequences ---------------------------------------------------------------------------
template <class T, class Launcher>
void launch_product(Launcher& launch, const ProductPlan& plan, ProductArgs<T> a, uint8_t* workspace) {
  launch.output(a.out, size_t(a.rows) * size_t(a.o_dim), size_t(a.o_dim), "ProductArgs::out");
  if (a.rows == 0) return;
  if (a.K == 0) {
    launch.memset(a.out, sizeof(T) * size_t(a.rows) * size_t(a.o_dim));
    return;
  }
  auto seg = [&](bool present, size_t at) {
    return present ? reinterpret_cast<int32_t*>(workspace + at) : nullptr;
  };
  int32_t* list = seg(plan.lists, plan.list_at);
  int32_t* nlist = seg(plan.lists, plan.nlist_at);
  int32_t* tiles = seg(plan.tiles, plan.tiles_at);
  int32_t* ntiles = seg(plan.tiles, plan.ntiles_at);
  int32_t* path = seg(plan.tiles, plan.path_at);
  T* packed = plan.tiles ? reinterpret_cast<T*>(workspace + plan.packed_at) : nullptr;
  a.n_ob = plan.n_ob;
  a.n_qb = plan.n_qb;
  a.list = list;
  a.nlist = nlist;
  a.tiles = tiles;
  a.ntiles = ntiles;
  a.path = path;
  a.packed = packed;
  if (plan.lists || plan.tiles) {
    const PlanArgs<T> p{a.values, a.offsets, a.K, a.P, a.D, a.o_dim, plan.n_ob, plan.n_qb,
                        list, nlist, tiles, ntiles, path, packed};
    launch(dim3(static_cast<unsigned>(plan.n_ob)), dim3(kPlanThreads),
           plan.out_moving ? element_plan_kernel<T, true> : element_plan_kernel<T, false>, p);
  }
  const int64_t ctas = int64_t(plan.n_ob) * ceil_div(a.rows, kElemRows);
  launch(dim3(static_cast<unsigned>(ctas)), dim3(kElemThreads),
         plan.out_moving ? element_product_kernel<T, true> : element_product_kernel<T, false>, a);
}

template <class T, class Launcher>
void launch_reduce(Launcher& launch, const float* partial, T* out, int64_t n, int32_t splits) {
  const ReduceArgs<T> r{partial, out, n, splits};
  launch(dim3(static_cast<unsigned>(ceil_div(n, kReduceThreads))), dim3(kReduceThreads), sddmm_reduce_kernel<T>,
         r);
}

template <class T, class Launcher>
void launch_sddmm(Launcher& launch, const SddmmPlan& plan, SddmmArgs<T> a, uint8_t* workspace) {
  launch.output(a.out, size_t(a.K) * size_t(a.D), size_t(a.D), "SddmmArgs::out");
  if (a.K == 0) return;
  if (a.rows == 0) {
    launch.memset(a.out, sizeof(T) * size_t(a.K) * size_t(a.D));
    return;
  }
  a.splits = plan.splits;
  a.rows_per_split = plan.rows_per_split;
  a.partial = plan.splits > 1 ? reinterpret_cast<float*>(workspace) : nullptr;
  if (a.partial != nullptr)
    launch.output(a.partial, size_t(plan.splits) * size_t(a.K) * size_t(a.D), size_t(a.D), "SddmmArgs::partial");
  const dim3 grid(static_cast<unsigned>(ceil_div(a.D, kSddmmLanes)),
                  static_cast<unsigned>(ceil_div(a.K, kSddmmDiags)), static_cast<unsigned>(plan.splits));
  launch(grid, dim3(kSddmmThreads), sddmm_kernel<T>, a);
  if (plan.splits > 1) launch_reduce(launch, a.partial, a.out, int64_t(a.K) * a.D, plan.splits);
}

template <class T>
using BlockProductKernel = void (*)(BlockProductArgs<T>);

// The tensor-core instantiation of block size kB and the narrowest panel of at least `cols`.
template <class T, bool kOutLong, bool kTranspose, int kB, int kCols = kB>
BlockProductKernel<T> block_tc_kernel_for(int32_t cols) {
  if constexpr (kOutLong && kCols < kBlockMaxCols) {
    if (cols > kCols) return block_tc_kernel_for<T, kOutLong, kTranspose, kB, kCols * 2>(cols);
  }
  return block_product_tc_kernel<T, kOutLong, kTranspose, kB, kCols>;
}

template <class T, bool kOutLong, bool kTranspose>
BlockProductKernel<T> block_product_kernel(const BlockProductPlan& plan) {
  if constexpr (kHasTensorCorePath<T>) {
    if (plan.tensor_cores) {
      switch (plan.g.b) {
        case 16: return block_tc_kernel_for<T, kOutLong, kTranspose, 16>(plan.cols);
        case 32: return block_tc_kernel_for<T, kOutLong, kTranspose, 32>(plan.cols);
        case 64: return block_tc_kernel_for<T, kOutLong, kTranspose, 64>(plan.cols);
        default: return block_tc_kernel_for<T, kOutLong, kTranspose, 128>(plan.cols);
      }
    }
  }
  return block_product_simt_kernel<T, kOutLong, kTranspose>;
}

template <class T, class Launcher>
void launch_block_product(Launcher& launch, const BlockProductPlan& plan, bool transpose, BlockProductArgs<T> a) {
  launch.output(a.out, size_t(a.rows) * size_t(a.o_dim), size_t(a.o_dim), "BlockProductArgs::out");
  if (a.rows == 0) return;
  if (a.K == 0) {
    launch.memset(a.out, sizeof(T) * size_t(a.rows) * size_t(a.o_dim));
    return;
  }
  a.P_b = plan.g.P_b;
  a.L_b = plan.g.L_b;
  a.b = plan.g.b;
  a.wraps = plan.g.wraps;
  a.per_panel = plan.per_panel;
  a.n_panels = plan.n_panels;
  const dim3 grid(static_cast<unsigned>(int64_t(plan.n_panels) * ceil_div(a.rows, plan.slab_rows)));
  if (plan.out_long)
    launch(grid, dim3(kBlockThreads),
           transpose ? block_product_kernel<T, true, true>(plan) : block_product_kernel<T, true, false>(plan), a);
  else
    launch(grid, dim3(kBlockThreads),
           transpose ? block_product_kernel<T, false, true>(plan) : block_product_kernel<T, false, false>(plan), a);
}

template <class T, class Launcher>
void launch_block_sddmm(Launcher& launch, const BlockSddmmPlan& plan, BlockSddmmArgs<T> a, uint8_t* workspace) {
  const BlockGeometry& g = plan.g;
  const int64_t n = int64_t(a.K) * g.L_b * g.b * g.b;
  launch.output(a.out, size_t(n), size_t(g.b), "BlockSddmmArgs::out");
  if (a.K == 0) return;
  if (a.rows == 0) {
    launch.memset(a.out, sizeof(T) * size_t(n));
    return;
  }
  a.P_b = g.P_b;
  a.L_b = g.L_b;
  a.b = g.b;
  a.tall = g.tall;
  a.per_cta = plan.per_cta;
  a.chunks = plan.chunks;
  a.diags = plan.diags;
  a.groups = plan.groups;
  a.splits = plan.splits;
  a.rows_per_split = plan.rows_per_split;
  a.partial = plan.splits > 1 ? reinterpret_cast<float*>(workspace) : nullptr;
  if (a.partial != nullptr)
    launch.output(a.partial, size_t(plan.splits) * size_t(n), size_t(g.b), "BlockSddmmArgs::partial");
  const dim3 grid(static_cast<unsigned>(int64_t(g.P_b) * plan.chunks * plan.groups * plan.splits));
  if constexpr (kHasTensorCorePath<T>) {
    if (plan.tensor_cores) {
      switch (g.b) {
        case 16: launch(grid, dim3(kBlockThreads), block_sddmm_tc_kernel<T, 16>, a); break;
        case 32: launch(grid, dim3(kBlockThreads), block_sddmm_tc_kernel<T, 32>, a); break;
        case 64: launch(grid, dim3(kBlockThreads), block_sddmm_tc_kernel<T, 64>, a); break;
        default: launch(grid, dim3(kBlockThreads), block_sddmm_tc_kernel<T, 128>, a); break;
      }
    } else {
      launch(grid, dim3(kBlockThreads), block_sddmm_simt_kernel<T>, a);
    }
  } else {
    launch(grid, dim3(kBlockThreads), block_sddmm_simt_kernel<T>, a);
  }
  if (plan.splits > 1) launch_reduce(launch, a.partial, a.out, n, plan.splits);
}

}  // namespace cuda
}  // namespace dynadiag
