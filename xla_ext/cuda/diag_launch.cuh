// Host side of the CUDA kernels: the workspace plan and the launch sequence of each target.
// Written once for both builds: `Launcher` is a small policy with
//   launch(grid, block, kernel, args...)   kernel<<<grid, block, 0, stream>>>(args...) or emu::launch
//   launch.memset(ptr, bytes)              cudaMemsetAsync(ptr, 0, bytes, stream) or std::memset
//   launch.output(ptr, count, row, name)   declares an output the sequence writes exactly once per
//                                          element (simt::store in the kernels, or a memset); the
//                                          emulation checks it, the CUDA launcher ignores it
// The plan is mirrored by dynadiag_jax/ops/cuda.py (workspace_bytes); a test compares the two.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cuda/diag_kernels.cuh"

namespace dynadiag {
namespace cuda {

constexpr size_t kWorkspaceAlign = 256;
// dvalues: split the batch rows over grid.z until about kSddmmTargetBlocks blocks are in flight,
// keeping at least kSddmmRowsPerSplit rows per split.
constexpr int64_t kSddmmRowsPerSplit = 256;
constexpr int64_t kSddmmMaxSplits = 64;
constexpr int64_t kSddmmTargetBlocks = 512;
constexpr int64_t kMaxGridYZ = 65535;
constexpr int64_t kMaxGridX = std::numeric_limits<int32_t>::max();

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline size_t align_up(size_t n) { return (n + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

template <class T>
constexpr bool kHasTensorCorePath =
    std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value;

// Forward (transpose = false: out = y, in = x) or dx (transpose = true: out = dx, in = dy) of
// W[out_features, in_features]. Workspace: tile counts [n_mb, n_tb], then per output block its
// touched input blocks [n_ob, n_qb], their number [n_ob] and its path [n_ob] (int32 each,
// 256-byte aligned segments). Without a tensor-core path (float32) nothing is needed.
struct ProductPlan {
  int32_t P, D, n_mb, n_tb, n_ob, n_qb;
  bool out_moving, tensor_cores;
  size_t count_at, tiles_at, ntiles_at, path_at, workspace_bytes;
};

inline ProductPlan plan_product(int64_t in_features, int64_t out_features, bool transpose,
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
  p.tensor_cores = tensor_cores;
  if (!tensor_cores) return p;
  size_t at = 0;
  p.count_at = at;
  at += align_up(sizeof(int32_t) * size_t(p.n_mb) * p.n_tb);
  p.tiles_at = at;
  at += align_up(sizeof(int32_t) * size_t(p.n_ob) * p.n_qb);
  p.ntiles_at = at;
  at += align_up(sizeof(int32_t) * size_t(p.n_ob));
  p.path_at = at;
  at += align_up(sizeof(int32_t) * size_t(p.n_ob));
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

// Grid limits, checked by the handlers before launching; nullptr when the shapes fit.
inline const char* product_limits(const ProductPlan& p, int64_t rows) {
  if (p.n_ob > kMaxGridYZ) return "too many output features for one launch (at most 1048560)";
  if (ceil_div(rows, kBatchTile) > kMaxGridX) return "too many rows for one launch";
  return nullptr;
}

inline const char* sddmm_limits(int64_t K, int64_t D) {
  if (ceil_div(K, kSddmmDiags) > kMaxGridYZ) return "too many diagonals for one launch (at most 524280)";
  if (ceil_div(D, kSddmmLanes) > kMaxGridX) return "diagonals too long for one launch";
  return nullptr;
}

template <class T, class Launcher>
void launch_product(Launcher& launch, const ProductPlan& plan, ProductArgs<T> a, uint8_t* workspace) {
  launch.output(a.out, size_t(a.rows) * size_t(a.o_dim), size_t(a.o_dim), "ProductArgs::out");
  if (a.rows == 0) return;
  if (a.K == 0) {
    launch.memset(a.out, sizeof(T) * size_t(a.rows) * size_t(a.o_dim));
    return;
  }
  const dim3 grid(static_cast<unsigned>(ceil_div(a.rows, kBatchTile)), static_cast<unsigned>(plan.n_ob));
  a.tiles = a.ntiles = a.path = nullptr;
  if constexpr (kHasTensorCorePath<T>) {
    int32_t* count = reinterpret_cast<int32_t*>(workspace + plan.count_at);
    int32_t* tiles = reinterpret_cast<int32_t*>(workspace + plan.tiles_at);
    int32_t* ntiles = reinterpret_cast<int32_t*>(workspace + plan.ntiles_at);
    int32_t* path = reinterpret_cast<int32_t*>(workspace + plan.path_at);
    launch.memset(count, sizeof(int32_t) * size_t(plan.n_mb) * plan.n_tb);
    const StructureArgs s{a.offsets, a.K, plan.P, plan.D, plan.n_mb, plan.n_tb, count};
    launch(dim3(static_cast<unsigned>(ceil_div(int64_t(a.K) * plan.n_tb, kStructureThreads))),
           dim3(kStructureThreads), count_tiles_kernel, s);
    const CompactArgs c{count, plan.n_mb, plan.n_tb, plan.out_moving, tiles, ntiles, path};
    launch(dim3(static_cast<unsigned>(ceil_div(plan.n_ob, kCompactThreads))), dim3(kCompactThreads),
           compact_tiles_kernel, c);
    a.tiles = tiles;
    a.ntiles = ntiles;
    a.path = path;
    launch(grid, dim3(kProductThreads),
           plan.out_moving ? tensor_core_product_kernel<T, true> : tensor_core_product_kernel<T, false>, a);
  }
  launch(grid, dim3(kProductThreads),
         plan.out_moving ? diagonal_product_kernel<T, true> : diagonal_product_kernel<T, false>, a);
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
  if (plan.splits > 1)
    launch(dim3(static_cast<unsigned>(ceil_div(int64_t(a.K) * a.D, kReduceThreads))), dim3(kReduceThreads),
           sddmm_reduce_kernel<T>, a);
}

}  // namespace cuda
}  // namespace dynadiag
