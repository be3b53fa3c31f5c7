// Device kernels of diag_matmul for element diagonals (values[K, D]). The same source compiles with
// nvcc for the GPU and with a host C++ compiler against emu/simt.h, which is how the test suite
// runs it (no GPU here). Kernels see plain structs of pointers and sizes only. Shared memory is
// declared with SIMT_SHARED and outputs are written with simt::store, so that the emulation checks
// them (emu/simt_api.h).
//
// Coordinates. W[out, in] holds K wrapped diagonals (docs/design.md section 1). Entry t of diagonal d
// sits at *moving* index m = (t + d) % P and *fixed* index t < D, with P = max(in, out) and
// D = min(in, out). Tall or square W: moving = row, fixed = column; wide W: moving = column,
// fixed = row. The forward product (y = x W^T) and dx (dx = dy W) are both
//     out[r, o] = sum_q M[o, q] in[r, q],   M = W (forward) or W^T (dx),
// and their output axis is either the moving one (forward on tall W, dx on wide W) or the fixed
// one; the kernels take that as the template flag kOutMoving.
//
// Forward/dx plan ("pack once, multiply many"), per 16-wide output block ob:
//   element_plan_kernel     one thread block per output block, once per call: the diagonals that
//                           touch the block (its list; out-moving products only - along the fixed
//                           axis every diagonal touches every output), the touched 16x16 tiles of
//                           M and their entries, and the path: tensor cores when
//                           tiles * kTileCost <= entries * kEntryCost (the cost model's ratio,
//                           dynadiag_jax/gpu_cost.py), whose tiles it then packs into the workspace;
//   element_product_kernel  one thread block per (output block, 128-row slab), output-block
//                           fastest so the slab of x stays in L2: multiplies the packed tiles on
//                           tensor cores (wmma, double-buffered loads), or walks the block's list
//                           of diagonals on CUDA cores. float32 has no tensor-core path.
// dvalues is the diagonal SDDMM dvalues[k, t] = sum_r fixed[r, t] * moving[r, (t + d_k) % P]
// (fixed/moving = x/dy on tall W, dy/x on wide W), split over rows when the grid is small.
//
// Out-of-range offsets cannot be reported without a host sync: the kernels never read through
// them and write NaN instead (the whole forward/dx output, the row of dvalues).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/kernel_common.cuh"
#include "cuda/launch_plan.h"

// Test-only variants, each with one deliberate bug that the emulation must catch (built by
// tests/test_cuda_checks.py through emu/kernel_check.cc; docs/emulation.md): 1 reads a shared
// counter no thread has set, 2 writes output blocks twice, 3 reads `values` out of bounds.
// 0 (no bug) in every real build.
#ifndef DYNADIAG_PLANTED_BUG
#define DYNADIAG_PLANTED_BUG 0
#endif

namespace dynadiag {
namespace cuda {

// Where diagonal d puts an entry in row o of M: its input index q and fixed index t (the column of
// values). False when the diagonal misses row o (out-moving: t would fall past D).
template <bool kOutMoving>
__device__ __forceinline__ bool entry_of(int o, int d, int P, int D, int* q, int* t) {
  if (kOutMoving) {
    int tt = o - d;
    if (tt < 0) tt += P;
#if DYNADIAG_PLANTED_BUG != 3  // planted: entries past the diagonal's end are read
    if (tt >= D) return false;
#endif
    *q = tt;
    *t = tt;
    return true;
  }
  int qq = o + d;
  if (qq >= P) qq -= P;
  *q = qq;
  *t = o;
  return true;
}

// ---- plan ---------------------------------------------------------------------------------------
template <class T>
struct PlanArgs {
  const T* values;         // [K, D]
  const int32_t* offsets;  // [K]
  int32_t K, P, D, o_dim, n_ob, n_qb;
  int32_t* list;           // [n_ob, K]: diagonals touching each output block (out-moving), or null
  int32_t* nlist;          // [n_ob]: their number; -1 when an offset is out of range
  int32_t* tiles;          // [n_ob, n_qb]: touched input blocks, ascending (structure), or null
  int32_t* ntiles;         // [n_ob]
  int32_t* path;           // [n_ob]: kPathTensorCore, kPathDiagonal or kPathPoison
  T* packed;               // [n_ob * n_qb, 16, 16]: M tiles [o][q] of tensor-core blocks
};

// One thread block per output block (see the top of the file).
template <class T, bool kOutMoving>
__global__ void __launch_bounds__(kPlanThreads) element_plan_kernel(PlanArgs<T> a) {
  SIMT_SHARED(int32_t[kPlanThreads], scan);
  SIMT_SHARED(int32_t[kPlanThreads], chunk_k);
  SIMT_SHARED(int32_t[kPlanThreads], chunk_d);
  SIMT_SHARED(int32_t[kMaxPlanBlocks], qmap);  // entries per input block, then its tile slot
  SIMT_SHARED(int32_t, bad);
  SIMT_SHARED(int32_t, entries);
  Tally tally;
  const int tid = threadIdx.x;
  const int ob = blockIdx.x, o0 = ob * kTile;
  const int n_out = imin(kTile, a.o_dim - o0);
  const bool structure = a.tiles != nullptr;
  if (tid == 0) {
    bad = 0;
#if DYNADIAG_PLANTED_BUG != 1  // planted: the counter starts with whatever shared memory holds
    entries = 0;
#endif
    tally.cta();
  }
  if (structure)
    for (int i = tid; i < a.n_qb; i += kPlanThreads) qmap[i] = 0;
  __syncthreads();
  int listed = 0;
  for (int kc = 0; kc < a.K; kc += kPlanThreads) {
    const int k = kc + tid;
    int touches = 0;
    if (k < a.K) {
      const int d = a.offsets[k];
      tally.load(4);
      if (!valid_offset(d, a.P)) {
        atomicOr(&bad, 1);
      } else {
        for (int j = 0; j < n_out; ++j) {
          int q, t;
          if (!entry_of<kOutMoving>(o0 + j, d, a.P, a.D, &q, &t)) continue;
          touches = 1;
          if (structure) atomicAdd(&qmap[q / kTile], 1);
        }
      }
    }
    if (kOutMoving) {
      int total;
      const int pos = block_exclusive_scan<kPlanThreads>(scan, touches, &total);
      if (touches) {
        a.list[int64_t(ob) * a.K + listed + pos] = k;
        tally.store(4);
      }
      listed += total;
    }
  }
  __syncthreads();
  const bool poisoned = bad != 0;
  if (kOutMoving && tid == 0) {
    a.nlist[ob] = poisoned ? -1 : listed;
    tally.store(4);
  }
  if (!structure) {
    tally.flush(kCountElementPlan);
    return;
  }
  // The touched input blocks: their list, their tile slots and the block's entries.
  int n_tiles = 0;
  for (int qc = 0; qc < a.n_qb; qc += kPlanThreads) {
    const int qb = qc + tid;
    const int c = qb < a.n_qb ? int(qmap[qb]) : 0;
    if (c > 0) atomicAdd(&entries, c);
    int total;
    const int pos = block_exclusive_scan<kPlanThreads>(scan, c > 0, &total);
    if (qb < a.n_qb) qmap[qb] = c > 0 ? n_tiles + pos : -1;
    if (c > 0) {
      a.tiles[int64_t(ob) * a.n_qb + n_tiles + pos] = qb;
      tally.store(4);
    }
    n_tiles += total;
  }
  __syncthreads();
  const int64_t n_entries = entries;
  const bool cheaper = int64_t(n_tiles) * kTileCost <= n_entries * kEntryCost;
  const int path = poisoned                    ? kPathPoison
                   : n_tiles > 0 && cheaper    ? kPathTensorCore
                                               : kPathDiagonal;
  if (tid == 0) {
    a.ntiles[ob] = n_tiles;
    a.path[ob] = path;
    tally.store(8);
  }
  if (path != kPathTensorCore) {
    tally.flush(kCountElementPlan);
    return;
  }
  // Pack the touched tiles: zeros, then each entry added by the thread of its row and of its
  // offset mod 16, in list order - so repeated offsets always add up in the same order.
  T* packed = a.packed + int64_t(ob) * a.n_qb * kTileArea;
  for (int i = tid; i < n_tiles * kTileArea; i += kPlanThreads) {
    packed[i] = from_float<T>(0.0f);
    tally.store(sizeof(T));
  }
  const int lane = tid % kTile, group = tid / kTile;
  const int n_list = kOutMoving ? listed : a.K;
  for (int kc = 0; kc < n_list; kc += kPlanThreads) {
    const int cnt = imin(kPlanThreads, n_list - kc);
    __syncthreads();  // the zeros are written and the previous chunk has been read
    if (tid < cnt) {
      const int k = kOutMoving ? a.list[int64_t(ob) * a.K + kc + tid] : kc + tid;
      chunk_k[tid] = k;
      chunk_d[tid] = a.offsets[k];
      tally.load(kOutMoving ? 8 : 4);
    }
    __syncthreads();
    if (lane >= n_out) continue;
    for (int j = 0; j < cnt; ++j) {
      const int d = chunk_d[j];
      int q, t;
      if (d % kTile != group || !entry_of<kOutMoving>(o0 + lane, d, a.P, a.D, &q, &t)) continue;
      const int k = chunk_k[j];
      const int slot = qmap[q / kTile];
      T* dst = packed + int64_t(slot) * kTileArea + lane * kTile + q % kTile;
      *dst = from_float<T>(to_float(*dst) + to_float(a.values[int64_t(k) * a.D + t]));
      tally.load(2 * sizeof(T));
      tally.store(sizeof(T));
    }
  }
  tally.flush(kCountElementPlan);
}

// ---- forward / dx products ----------------------------------------------------------------------
template <class T>
struct ProductArgs {
  const T* in;             // [rows, q_dim]: x (forward) or dy (dx)
  T* out;                  // [rows, o_dim]
  const T* values;         // [K, D]
  const int32_t* offsets;  // [K]
  int64_t rows;
  int32_t q_dim, o_dim, P, D, K, n_ob, n_qb;
  // The plan (PlanArgs); null where the product has none (float32 along the fixed axis: every
  // block walks all K diagonals).
  const int32_t* list;
  const int32_t* nlist;
  const int32_t* tiles;
  const int32_t* ntiles;
  const int32_t* path;
  const T* packed;
};

// Tensor-core path of one (output block, slab): the packed tiles two at a time through a
// double-buffered pipeline (the next stage's loads are issued into registers before this stage's
// MMAs and stored to shared memory after them); warp w owns rows 16w.. of the slab.
template <class T>
__device__ void element_tensor_core_tile(const ProductArgs<T>& a, int ob, int64_t r0, int rows_here,
                                         Tally& tally) {
  namespace wmma = nvcuda::wmma;
  SIMT_SHARED_ALIGNED(T[2][kStageTiles][kElemRows * kTile], xs, 32);  // x slices [row][q]
  SIMT_SHARED_ALIGNED(T[2][kStageTiles][kTileArea], ws, 32);          // M tiles [o][q]
  SIMT_SHARED_ALIGNED(float[kElemWarps][kTileArea], cs, 32);          // epilogue, per warp
  constexpr int kPerThread = kElemRows * kTile / kElemThreads;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int n = a.ntiles[ob];
  const int n_stages = (n + kStageTiles - 1) / kStageTiles;
  const int32_t* tiles = a.tiles + int64_t(ob) * a.n_qb;
  const T* packed = a.packed + int64_t(ob) * a.n_qb * kTileArea;
  const int o0 = ob * kTile, n_out = imin(kTile, a.o_dim - o0);
  T xr[kStageTiles][kPerThread];
  T wr[kStageTiles];
  auto fetch = [&](int stage) {
#pragma unroll
    for (int j = 0; j < kStageTiles; ++j) {
      const int i = stage * kStageTiles + j;
      if (i >= n) continue;
      const int q0 = tiles[i] * kTile;
      if (tid == 0) tally.load(4);
#pragma unroll
      for (int s = 0; s < kPerThread; ++s) {
        const int e = tid + s * kElemThreads, r = e / kTile, c = e % kTile;
        const bool ok = r < rows_here && q0 + c < a.q_dim;
        xr[j][s] = ok ? a.in[(r0 + r) * a.q_dim + q0 + c] : from_float<T>(0.0f);
        if (ok) tally.load(sizeof(T));
      }
      wr[j] = packed[int64_t(i) * kTileArea + tid];
      tally.load(sizeof(T));
    }
  };
  auto commit = [&](int stage, int buf) {
#pragma unroll
    for (int j = 0; j < kStageTiles; ++j) {
      if (stage * kStageTiles + j >= n) continue;
#pragma unroll
      for (int s = 0; s < kPerThread; ++s) xs[buf][j][tid + s * kElemThreads] = xr[j][s];
      ws[buf][j][tid] = wr[j];
    }
  };
  static_assert(kTileArea == kElemThreads, "one M tile entry per thread");
  wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float> acc;
  wmma::fill_fragment(acc, 0.0f);
  if (n_stages > 0) {
    fetch(0);
    commit(0, 0);
  }
  __syncthreads();
  for (int st = 0; st < n_stages; ++st) {
    const int buf = st & 1;
    if (st + 1 < n_stages) fetch(st + 1);
#pragma unroll
    for (int j = 0; j < kStageTiles; ++j) {
      if (st * kStageTiles + j >= n) continue;
      wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, T, wmma::row_major> fa;
      wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, T, wmma::col_major> fb;
      wmma::load_matrix_sync(fa, xs[buf][j] + warp * kTileArea, kTile);
      wmma::load_matrix_sync(fb, ws[buf][j] + 0, kTile);
      wmma::mma_sync(acc, fa, fb, acc);
      if (lane == 0) tally.mma(1);
    }
    if (st + 1 < n_stages) commit(st + 1, buf ^ 1);
    __syncthreads();
  }
  wmma::store_matrix_sync(cs[warp] + 0, acc, kTile, wmma::mem_row_major);
  __syncwarp();
  for (int e = lane; e < kTileArea; e += 32) {
    const int r = warp * kTile + e / kTile, c = e % kTile;
    if (r >= rows_here || c >= n_out) continue;
    const float v = cs[warp][e];
    simt::store(&a.out[(r0 + r) * a.o_dim + o0 + c], from_float<T>(v));
    tally.store(sizeof(T));
  }
}

// Diagonal path of one (output block, slab): thread (group, lane) owns output o = ob*16 + lane for
// rows r0 + group + 16 i and adds the entry each listed diagonal puts into row o of M.
template <class T, bool kOutMoving>
__device__ void element_diagonal_tile(const ProductArgs<T>& a, int ob, int64_t r0, int rows_here,
                                      Tally& tally) {
  SIMT_SHARED(int32_t[kElemThreads], chunk_k);
  SIMT_SHARED(int32_t[kElemThreads], chunk_d);
  SIMT_SHARED(int32_t, bad);
  const int tid = threadIdx.x, lane = tid % kTile, group = tid / kTile;
  const int o = ob * kTile + lane;
  const int nr = rows_here > group ? (rows_here - group + kElemGroups - 1) / kElemGroups : 0;
  const bool active = o < a.o_dim && nr > 0;
  float acc[kElemRowsPerThread];
#pragma unroll
  for (int i = 0; i < kElemRowsPerThread; ++i) acc[i] = 0.0f;
  const int n = kOutMoving ? a.nlist[ob] : a.K;
  if (tid == 0) bad = 0;
  for (int kc = 0; kc < n; kc += kElemThreads) {
    const int cnt = imin(kElemThreads, n - kc);
    __syncthreads();  // the previous chunk has been read (and `bad` initialised)
    if (tid < cnt) {
      const int k = kOutMoving ? a.list[int64_t(ob) * a.K + kc + tid] : kc + tid;
      chunk_k[tid] = k;
      chunk_d[tid] = a.offsets[k];
      tally.load(kOutMoving ? 8 : 4);
    }
    __syncthreads();
    if (!active) continue;
    for (int j = 0; j < cnt; ++j) {
      const int d = chunk_d[j];
      int q, t;
      if (!valid_offset(d, a.P)) {
        atomicOr(&bad, 1);
        continue;
      }
      if (!entry_of<kOutMoving>(o, d, a.P, a.D, &q, &t)) continue;
      const int k = chunk_k[j];
      const float v = to_float(a.values[int64_t(k) * a.D + t]);
      const T* col = a.in + (r0 + group) * a.q_dim + q;
#pragma unroll
      for (int i = 0; i < kElemRowsPerThread; ++i)
        if (i < nr) acc[i] += v * to_float(col[int64_t(i) * kElemGroups * a.q_dim]);
      tally.load(sizeof(T) * (1 + nr));
      tally.fma(nr);
    }
  }
  __syncthreads();
  const bool poisoned = bad != 0;
  if (o >= a.o_dim) return;
#pragma unroll
  for (int i = 0; i < kElemRowsPerThread; ++i) {  // unrolled: acc stays in registers
    if (i >= nr) continue;
    const float v = poisoned ? quiet_nan() : acc[i];
    simt::store(&a.out[(r0 + group + int64_t(i) * kElemGroups) * a.o_dim + o], from_float<T>(v));
    tally.store(sizeof(T));
  }
}

// One thread block per (output block, 128-row slab); blockIdx.x = ob + n_ob * slab.
template <class T, bool kOutMoving>
__global__ void __launch_bounds__(kElemThreads) element_product_kernel(ProductArgs<T> a) {
  Tally tally;
  const int64_t idx = blockIdx.x;
  const int ob = static_cast<int>(idx % a.n_ob);
  const int64_t r0 = idx / a.n_ob * kElemRows;
  const int rows_here = static_cast<int>(a.rows - r0 < kElemRows ? a.rows - r0 : kElemRows);
  if (threadIdx.x == 0) tally.cta();
  int path = a.path != nullptr ? a.path[ob] : kPathDiagonal;
  if (kOutMoving && a.nlist[ob] < 0) path = kPathPoison;
  if (path == kPathPoison) {  // an offset out of range: NaN, reading nothing
    const int o0 = ob * kTile, n_out = imin(kTile, a.o_dim - o0);
    for (int e = threadIdx.x; e < kElemRows * kTile; e += kElemThreads) {
      const int r = e / kTile, c = e % kTile;
      if (r >= rows_here || c >= n_out) continue;
      simt::store(&a.out[(r0 + r) * a.o_dim + o0 + c], from_float<T>(quiet_nan()));
      tally.store(sizeof(T));
    }
  } else if (path == kPathTensorCore) {
    if constexpr (!std::is_same<T, float>::value) element_tensor_core_tile(a, ob, r0, rows_here, tally);
#if DYNADIAG_PLANTED_BUG == 2  // planted: the tensor-core blocks are computed (and written) again
    element_diagonal_tile<T, kOutMoving>(a, ob, r0, rows_here, tally);
#endif
  } else {
    element_diagonal_tile<T, kOutMoving>(a, ob, r0, rows_here, tally);
  }
  tally.flush(kCountElementProduct);
}

// ---- dvalues (diagonal SDDMM) -------------------------------------------------------------------
template <class T>
struct SddmmArgs {
  const T* fixed;          // [rows, D]: x (tall W) or dy (wide W)
  const T* moving;         // [rows, P]: dy (tall W) or x (wide W)
  const int32_t* offsets;  // [K]
  T* out;                  // [K, D] when splits == 1
  float* partial;          // [splits, K, D] when splits > 1
  int64_t rows, rows_per_split;
  int32_t P, D, K, splits;
};

// Block (t block, diagonal group, split): lane l of warp w sums rows r0 + w, r0 + w + 8, ... for
// t = 32*blockIdx.x + l and 8 diagonals, reusing each fixed[r, t] across the 8; the 8 warps'
// partial sums are then added in a fixed order (deterministic, no float atomics).
template <class T>
__global__ void __launch_bounds__(kSddmmThreads) sddmm_kernel(SddmmArgs<T> a) {
  SIMT_SHARED(float[kSddmmWarps][kSddmmDiags][kSddmmLanes], red);
  Tally tally;
  const int lane = threadIdx.x % kSddmmLanes;
  const int warp = threadIdx.x / kSddmmLanes;
  const int t = blockIdx.x * kSddmmLanes + lane;
  const int k0 = blockIdx.y * kSddmmDiags;
  const int64_t r0 = int64_t(blockIdx.z) * a.rows_per_split;
  const int64_t r1 = r0 + a.rows_per_split < a.rows ? r0 + a.rows_per_split : a.rows;
  if (threadIdx.x == 0) tally.cta();
  int mpos[kSddmmDiags];
  bool use[kSddmmDiags];
  float acc[kSddmmDiags];
  int n_use = 0;
#pragma unroll
  for (int g = 0; g < kSddmmDiags; ++g) {
    const int k = k0 + g;
    const int d = k < a.K ? a.offsets[k] : -1;
    use[g] = valid_offset(d, a.P);
    n_use += use[g];
    int m = t + (use[g] ? d : 0);
    if (m >= a.P) m -= a.P;
    mpos[g] = m;
    acc[g] = 0.0f;
  }
  if (t < a.D) {
    for (int64_t r = r0 + warp; r < r1; r += kSddmmWarps) {
      const float f = to_float(a.fixed[r * a.D + t]);
      const T* row = a.moving + r * a.P;
#pragma unroll
      for (int g = 0; g < kSddmmDiags; ++g)
        if (use[g]) acc[g] += f * to_float(row[mpos[g]]);
      tally.load(sizeof(T) * (1 + n_use));
      tally.fma(n_use);
    }
  }
#pragma unroll
  for (int g = 0; g < kSddmmDiags; ++g) red[warp][g][lane] = acc[g];
  __syncthreads();
  const int g = warp;  // now: this thread finishes diagonal k0 + g at t
  float s = 0.0f;
#pragma unroll
  for (int w = 0; w < kSddmmWarps; ++w) {
    const float p = red[w][g][lane];
    s += p;
  }
  const int k = k0 + g;
  if (k < a.K && t < a.D) {
    if (!valid_offset(a.offsets[k], a.P)) s = quiet_nan();
    if (a.splits == 1) {
      simt::store(&a.out[int64_t(k) * a.D + t], from_float<T>(s));
      tally.store(sizeof(T));
    } else {
      simt::store(&a.partial[(int64_t(blockIdx.z) * a.K + k) * a.D + t], s);
      tally.store(4);
    }
  }
  tally.flush(kCountElementSddmm);
}

// Sums n float partials of `splits` row ranges in split order: deterministic.
template <class T>
struct ReduceArgs {
  const float* partial;  // [splits, n]
  T* out;                // [n]
  int64_t n;
  int32_t splits;
};

template <class T>
__global__ void __launch_bounds__(kReduceThreads) sddmm_reduce_kernel(ReduceArgs<T> a) {
  Tally tally;
  if (threadIdx.x == 0) tally.cta();
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx < a.n) {
    float s = 0.0f;
    for (int z = 0; z < a.splits; ++z) s += a.partial[z * a.n + idx];
    simt::store(&a.out[idx], from_float<T>(s));
    tally.load(4 * int64_t(a.splits));
    tally.store(sizeof(T));
  }
  tally.flush(kCountSddmmReduce);
}

}  // namespace cuda
}  // namespace dynadiag
