// Host side of the CUDA kernels: the launch sequence of each target (its plan: launch_plan.h).
// Written once for both builds: `Launcher` is a small policy with
//   launch(grid, block, kernel, args...)   kernel<<<grid, block, 0, stream>>>(args...) or emu::launch
//   launch.memset(ptr, bytes)              cudaMemsetAsync(ptr, 0, bytes, stream) or std::memset
//   launch.output(ptr, count, row, name)   declares an output the sequence writes exactly once per
//                                          element (simt::store in the kernels, or a memset); the
//                                          emulation checks it, the CUDA launcher ignores it
// The plans and the constants they read are in launch_plan.h, which Python reads through the
// _plan_ext module (dynadiag_jax/launch_plan.py); dynadiag_jax/gpu_cost.py counts the launches from
// them and tests compare the counts with the emulated kernels'.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda/block_kernels.cuh"
#include "cuda/diag_kernels.cuh"
#include "cuda/launch_plan.h"

namespace dynadiag {
namespace cuda {

template <class T>
constexpr bool kHasTensorCorePath =
    std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value;

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
