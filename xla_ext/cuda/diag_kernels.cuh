// Device kernels behind diag_matmul on CUDA. The same source compiles with nvcc for the GPU and
// with a host C++ compiler against emu/simt.h, which is how the test suite runs it (no GPU here).
// Kernels see plain structs of pointers and sizes only. Shared memory is declared with SIMT_SHARED
// and outputs are written with simt::store, so that the emulation checks them (emu/simt_api.h).
//
// Coordinates. W[out, in] holds K wrapped diagonals (docs/design.md section 1). Entry t of diagonal d
// sits at *moving* index m = (t + d) % P and *fixed* index t < D, with P = max(in, out) and
// D = min(in, out). Tall or square W: moving = row, fixed = column; wide W: moving = column,
// fixed = row. The forward product (y = x W^T) and dx (dx = dy W) are both
//     out[b, o] = sum_q M[o, q] in[b, q],   M = W (forward) or W^T (dx),
// and their output axis is either the moving one (forward on tall W, dx on wide W) or the fixed
// one; the kernels take that as the template flag kOutMoving.
//
// Forward/dx plan, per 16-wide output block `ob` ("output tile" = ob x 64 batch rows):
//   count_tiles_kernel    entries of every 16x16 tile of W, from the offsets (on the device);
//   compact_tiles_kernel  per output block: the input blocks with entries (ascending), their
//                         number, and the path: tensor cores if the touched tiles are at least
//                         kMinFillNum/kMinFillDen full, else the diagonal CUDA-core path;
//   tensor_core_product_kernel  blocks on the tensor-core path: each touched W tile is assembled
//                         in shared memory from `values` and multiplied with wmma (f16/bf16 in,
//                         f32 accumulate);
//   diagonal_product_kernel     blocks on the diagonal path (and every block for float32 inputs,
//                         which have no tensor-core path): walks the diagonals, f32 FMAs.
// dvalues is the diagonal SDDMM dvalues[k, t] = sum_b fixed[b, t] * moving[b, (t + d_k) % P]
// (fixed/moving = x/dy on tall W, dy/x on wide W), split over batch rows when the grid is small.
//
// Out-of-range offsets cannot be reported without a host sync: the kernels never read through
// them and write NaN instead (the whole forward/dx output, the row of dvalues).
#pragma once

#include <cstdint>

#include "emu/simt_api.h"

// Test-only variants, each with one deliberate bug that the emulation must catch (built by
// tests/test_cuda_checks.py through emu/kernel_check.cc; docs/emulation.md): 1 reads a shared
// counter no thread has set, 2 writes output blocks twice, 3 reads `values` out of bounds.
// 0 (no bug) in every real build.
#ifndef DYNADIAG_PLANTED_BUG
#define DYNADIAG_PLANTED_BUG 0
#endif

namespace dynadiag {
namespace cuda {

// ---- tiling (host plan: diag_plan.h; mirrored in dynadiag_jax/ops/cuda.py) ----------------------
constexpr int kTile = 16;                                // structure granularity = wmma m16n16k16
constexpr int kTileArea = kTile * kTile;
constexpr int kBatchTile = 64;                           // batch rows per output tile
constexpr int kProductThreads = 128;                     // 4 warps, 16 batch rows each
// Tensor-core kernel: ask ptxas for 8 resident blocks (<= 64 registers). With the thread count
// alone it aimed at a higher occupancy and spilled on sm_80.
constexpr int kTensorCoreMinBlocks = 8;
constexpr int kProductWarps = kProductThreads / 32;
constexpr int kGroups = kProductThreads / kTile;         // diagonal path: 8 row groups x 16 outputs
constexpr int kRowsPerThread = kBatchTile / kGroups;     // diagonal path: rows per thread
constexpr int kEntriesPerThread = kTileArea / kProductThreads;  // W tile entries per thread
constexpr int kOffsetChunk = kProductThreads;            // offsets scanned per step
constexpr int kWindow = 2 * kTile - 1;                   // diagonals that can touch one tile
constexpr int kMinFillNum = 1, kMinFillDen = 4;          // tensor cores from 25% tile fill
constexpr int kPathDiagonal = 0, kPathTensorCore = 1;
constexpr int kStructureThreads = 256;
constexpr int kCompactThreads = 128;
// dvalues: 32 consecutive t per warp, 8 warps over batch rows, 8 diagonals per block.
constexpr int kSddmmLanes = 32;
constexpr int kSddmmWarps = 8;
constexpr int kSddmmDiags = 8;
constexpr int kSddmmThreads = kSddmmLanes * kSddmmWarps;
constexpr int kReduceThreads = 256;
static_assert(kProductWarps * kTile == kBatchTile, "one 16-row wmma tile per warp");
static_assert(kGroups * kRowsPerThread == kBatchTile, "diagonal path covers the batch tile");
static_assert(kEntriesPerThread * kProductThreads == kTileArea, "W tile split evenly");
static_assert(kSddmmDiags == kSddmmWarps, "the SDDMM reduction maps one diagonal to one warp");

// ---- element conversions (float accumulation for every input type) -----------------------------
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ bool valid_offset(int d, int P) { return d >= 0 && d < P; }

// ---- structure ----------------------------------------------------------------------------------
struct StructureArgs {
  const int32_t* offsets;  // [K]
  int32_t K, P, D;
  int32_t n_mb, n_tb;      // tile rows (moving axis) and tile columns (fixed axis)
  int32_t* count;          // [n_mb, n_tb], zeroed: entries per tile
};

// One thread per (diagonal, 16-wide fixed block): the diagonal's 16 entries there fall into at
// most three moving blocks (the run may wrap past P), each added with one atomic.
__global__ void __launch_bounds__(kStructureThreads) count_tiles_kernel(StructureArgs a) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(a.K) * a.n_tb) return;
  const int k = static_cast<int>(idx / a.n_tb);
  const int tb = static_cast<int>(idx % a.n_tb);
  const int d = a.offsets[k];
  if (!valid_offset(d, a.P)) return;  // reported by the product kernels
  const int t0 = tb * kTile;
  const int t1 = imin(t0 + kTile, a.D);
  int m = t0 + d;
  if (m >= a.P) m -= a.P;
  int run_mb = m / kTile, run = 0;
  for (int t = t0; t < t1; ++t) {
    const int mb = m / kTile;
    if (mb != run_mb) {
      atomicAdd(&a.count[run_mb * a.n_tb + tb], run);
      run_mb = mb;
      run = 0;
    }
    ++run;
    if (++m == a.P) m = 0;
  }
  atomicAdd(&a.count[run_mb * a.n_tb + tb], run);
}

struct CompactArgs {
  const int32_t* count;  // [n_mb, n_tb]
  int32_t n_mb, n_tb;
  int32_t out_moving;    // output blocks along the moving axis (rows of count) or the fixed one
  int32_t* tiles;        // [n_ob, n_qb]: touched input blocks of each output block, ascending
  int32_t* ntiles;       // [n_ob]
  int32_t* path;         // [n_ob]: kPathTensorCore or kPathDiagonal
};

// One thread per output block: the BCSR row of the block and its path.
__global__ void __launch_bounds__(kCompactThreads) compact_tiles_kernel(CompactArgs a) {
  const int n_ob = a.out_moving ? a.n_mb : a.n_tb;
  const int n_qb = a.out_moving ? a.n_tb : a.n_mb;
  const int ob = blockIdx.x * blockDim.x + threadIdx.x;
  if (ob >= n_ob) return;
  int n = 0;
  int64_t entries = 0;
  for (int qb = 0; qb < n_qb; ++qb) {
    const int c = a.out_moving ? a.count[ob * a.n_tb + qb] : a.count[qb * a.n_tb + ob];
    if (c > 0) {
      a.tiles[int64_t(ob) * n_qb + n] = qb;
      ++n;
      entries += c;
    }
  }
  a.ntiles[ob] = n;
  const bool dense_enough = entries * kMinFillDen >= int64_t(n) * kTileArea * kMinFillNum;
  a.path[ob] = (n > 0 && dense_enough) ? kPathTensorCore : kPathDiagonal;
}

// ---- forward / dx products ----------------------------------------------------------------------
template <class T>
struct ProductArgs {
  const T* in;             // [rows, q_dim]: x (forward) or dy (dx)
  T* out;                  // [rows, o_dim]
  const T* values;         // [K, D]
  const int32_t* offsets;  // [K]
  int64_t rows;
  int32_t q_dim, o_dim, P, D, K;
  const int32_t* tiles;    // structure from compact_tiles_kernel (tensor-core types only)
  const int32_t* ntiles;
  const int32_t* path;     // nullptr: every block takes the diagonal path
};

// Diagonal path. Thread (group, lane) owns output o = ob*16 + lane for batch rows
// b0 + group + 8*i; it walks all diagonals (offsets staged through shared memory) and adds the
// one entry each puts into row o of M.
template <class T, bool kOutMoving>
__global__ void __launch_bounds__(kProductThreads) diagonal_product_kernel(ProductArgs<T> a) {
  const int ob = blockIdx.y;
#if DYNADIAG_PLANTED_BUG != 2  // planted: the tensor-core blocks are computed (and written) again
  if (a.path != nullptr && a.path[ob] != kPathDiagonal) return;  // uniform over the block
#endif
  SIMT_SHARED(int32_t[kOffsetChunk], offs);
  const int tid = threadIdx.x;
  const int o = ob * kTile + tid % kTile;
  const int64_t b0 = int64_t(blockIdx.x) * kBatchTile + tid / kTile;
  const int64_t left = a.rows - b0;  // rows b0 + kGroups*i exist for i < nrows
  const int nrows = left <= 0              ? 0
                    : left >= kBatchTile ? kRowsPerThread
                                         : static_cast<int>((left + kGroups - 1) / kGroups);
  float acc[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) acc[i] = 0.0f;
  bool bad = false;
  for (int kc = 0; kc < a.K; kc += kOffsetChunk) {
    __syncthreads();  // the previous chunk has been read by everyone
    if (kc + tid < a.K) offs[tid] = a.offsets[kc + tid];
    __syncthreads();
    const int n = imin(kOffsetChunk, a.K - kc);
    if (o >= a.o_dim) continue;
    for (int j = 0; j < n; ++j) {
      const int d = offs[j];
      if (!valid_offset(d, a.P)) {
        bad = true;
        continue;
      }
      int t, q;
      if (kOutMoving) {  // o = (t + d) % P; the diagonal misses row o if t falls past D
        t = o - d;
        if (t < 0) t += a.P;
#if DYNADIAG_PLANTED_BUG != 3  // planted: entries past the diagonal's end are read
        if (t >= a.D) continue;
#endif
        q = t;
      } else {           // o = t; the entry reads input (t + d) % P
        t = o;
        q = o + d;
        if (q >= a.P) q -= a.P;
      }
      const float v = to_float(a.values[int64_t(kc + j) * a.D + t]);
      const T* col = a.in + b0 * a.q_dim + q;
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i)
        if (i < nrows) acc[i] += v * to_float(col[int64_t(i) * kGroups * a.q_dim]);
    }
  }
  if (o >= a.o_dim) return;
  for (int i = 0; i < nrows; ++i)
    simt::store(&a.out[(b0 + int64_t(i) * kGroups) * a.o_dim + o], from_float<T>(bad ? quiet_nan() : acc[i]));
}

// Tensor-core path (T = __half or __nv_bfloat16). Warp w accumulates batch rows b0+16w.. of the
// output tile over the touched input blocks. Per input block: stage in[b0.., q0..] in shared
// memory, assemble M[o0.., q0..] from the diagonals whose offsets fall in the tile's window, and
// run one 16x16x16 wmma per warp.
template <class T, bool kOutMoving>
__global__ void __launch_bounds__(kProductThreads, kTensorCoreMinBlocks)
    tensor_core_product_kernel(ProductArgs<T> a) {
  namespace wmma = nvcuda::wmma;
  const int ob = blockIdx.y;
  if (a.path[ob] != kPathTensorCore) return;  // uniform over the block
  SIMT_SHARED_ALIGNED(T[kBatchTile * kTile], xs, 32);  // in tile, row-major [batch][q]
  SIMT_SHARED_ALIGNED(T[kTile * kTile], ws, 32);       // M tile, [o][q] = wmma B in col-major
  SIMT_SHARED_ALIGNED(float[kBatchTile * kTile], cs, 32);
  SIMT_SHARED(int32_t[kOffsetChunk], list_k);          // diagonals in the window, this chunk
  SIMT_SHARED(int32_t[kOffsetChunk], list_d);
  SIMT_SHARED(int32_t, list_len);
  SIMT_SHARED(int32_t, bad);
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int o0 = ob * kTile;
  const int64_t b0 = int64_t(blockIdx.x) * kBatchTile;
  const int n_qb = (a.q_dim + kTile - 1) / kTile;
  if (tid == 0) bad = 0;

  wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float> acc;
  wmma::fill_fragment(acc, 0.0f);
  const int ntiles = a.ntiles[ob];
  for (int i = 0; i < ntiles; ++i) {
    const int q0 = a.tiles[int64_t(ob) * n_qb + i] * kTile;
    for (int e = tid; e < kBatchTile * kTile; e += kProductThreads) {
      const int64_t b = b0 + e / kTile;
      const int q = q0 + e % kTile;
      xs[e] = (b < a.rows && q < a.q_dim) ? a.in[b * a.q_dim + q] : from_float<T>(0.0f);
    }
    // Entry (o, q) of M lies on diagonal (m - t) mod P, at fixed index t; the tile's entries span
    // the kWindow diagonals starting at dlo.
    const int m0 = kOutMoving ? o0 : q0;
    const int t0 = kOutMoving ? q0 : o0;
    int dlo = (m0 - t0 - (kTile - 1)) % a.P;
    if (dlo < 0) dlo += a.P;
    int diag[kEntriesPerThread], fixed[kEntriesPerThread];
    float w[kEntriesPerThread];
#pragma unroll
    for (int s = 0; s < kEntriesPerThread; ++s) {
      const int e = tid + s * kProductThreads;
      const int o = o0 + e / kTile, q = q0 + e % kTile;
      const int m = kOutMoving ? o : q, t = kOutMoving ? q : o;
      diag[s] = -1;  // outside the matrix: stays zero
      fixed[s] = t;
      if (o < a.o_dim && q < a.q_dim) diag[s] = m - t < 0 ? m - t + a.P : m - t;
      w[s] = 0.0f;
    }
    for (int kc = 0; kc < a.K; kc += kOffsetChunk) {
#if DYNADIAG_PLANTED_BUG != 1  // planted: the counter starts with whatever shared memory holds
      if (tid == 0) list_len = 0;
#endif
      __syncthreads();
      const int k = kc + tid;
      if (k < a.K) {
        const int d = a.offsets[k];
        if (!valid_offset(d, a.P)) {
          atomicOr(&bad, 1);
        } else {
          int rel = d - dlo;
          if (rel < 0) rel += a.P;
          if (rel < kWindow) {
            const int slot = atomicAdd(&list_len, 1);
            list_k[slot] = k;
            list_d[slot] = d;
          }
        }
      }
      __syncthreads();
      const int n = list_len;
      for (int j = 0; j < n; ++j) {
        const int d = list_d[j];
#pragma unroll
        for (int s = 0; s < kEntriesPerThread; ++s)
          if (diag[s] == d) w[s] += to_float(a.values[int64_t(list_k[j]) * a.D + fixed[s]]);
      }
      __syncthreads();  // list_len is reset by the next chunk
    }
#pragma unroll
    for (int s = 0; s < kEntriesPerThread; ++s) ws[tid + s * kProductThreads] = from_float<T>(w[s]);
    __syncthreads();
    wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, T, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, T, wmma::col_major> fb;
    wmma::load_matrix_sync(fa, xs + warp * kTile * kTile, kTile);
    wmma::load_matrix_sync(fb, ws, kTile);
    wmma::mma_sync(acc, fa, fb, acc);
    __syncthreads();  // xs and ws are overwritten by the next input block
  }
  wmma::store_matrix_sync(cs + warp * kTile * kTile, acc, kTile, wmma::mem_row_major);
  __syncthreads();
  const bool poisoned = bad != 0;
  for (int e = tid; e < kBatchTile * kTile; e += kProductThreads) {
    const int64_t b = b0 + e / kTile;
    const int o = o0 + e % kTile;
    if (b < a.rows && o < a.o_dim)
      simt::store(&a.out[b * a.o_dim + o], from_float<T>(poisoned ? quiet_nan() : cs[e]));
  }
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
// t = 32*blockIdx.x + l and 8 diagonals, reusing each fixed[b, t] across the 8; the 8 warps'
// partial sums are then added in a fixed order (deterministic, no float atomics).
template <class T>
__global__ void __launch_bounds__(kSddmmThreads) sddmm_kernel(SddmmArgs<T> a) {
  SIMT_SHARED(float[kSddmmWarps][kSddmmDiags][kSddmmLanes], red);
  const int lane = threadIdx.x % kSddmmLanes;
  const int warp = threadIdx.x / kSddmmLanes;
  const int t = blockIdx.x * kSddmmLanes + lane;
  const int k0 = blockIdx.y * kSddmmDiags;
  const int64_t r0 = int64_t(blockIdx.z) * a.rows_per_split;
  const int64_t r1 = r0 + a.rows_per_split < a.rows ? r0 + a.rows_per_split : a.rows;
  int mpos[kSddmmDiags];
  bool use[kSddmmDiags];
  float acc[kSddmmDiags];
#pragma unroll
  for (int g = 0; g < kSddmmDiags; ++g) {
    const int k = k0 + g;
    const int d = k < a.K ? a.offsets[k] : -1;
    use[g] = valid_offset(d, a.P);
    int m = t + (use[g] ? d : 0);
    if (m >= a.P) m -= a.P;
    mpos[g] = m;
    acc[g] = 0.0f;
  }
  if (t < a.D) {
    for (int64_t b = r0 + warp; b < r1; b += kSddmmWarps) {
      const float f = to_float(a.fixed[b * a.D + t]);
      const T* row = a.moving + b * a.P;
#pragma unroll
      for (int g = 0; g < kSddmmDiags; ++g)
        if (use[g]) acc[g] += f * to_float(row[mpos[g]]);
    }
  }
#pragma unroll
  for (int g = 0; g < kSddmmDiags; ++g) red[warp][g][lane] = acc[g];
  __syncthreads();
  const int g = warp;  // now: this thread finishes diagonal k0 + g at t
  float s = 0.0f;
#pragma unroll
  for (int w = 0; w < kSddmmWarps; ++w) s += red[w][g][lane];
  const int k = k0 + g;
  if (k >= a.K || t >= a.D) return;
  if (!valid_offset(a.offsets[k], a.P)) s = quiet_nan();
  if (a.splits == 1)
    simt::store(&a.out[int64_t(k) * a.D + t], from_float<T>(s));
  else
    simt::store(&a.partial[(int64_t(blockIdx.z) * a.K + k) * a.D + t], s);
}

// Sums the split partials in split order.
template <class T>
__global__ void __launch_bounds__(kReduceThreads) sddmm_reduce_kernel(SddmmArgs<T> a) {
  const int64_t n = int64_t(a.K) * a.D;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n) return;
  float s = 0.0f;
  for (int z = 0; z < a.splits; ++z) s += a.partial[z * n + idx];
  simt::store(&a.out[idx], from_float<T>(s));
}

}  // namespace cuda
}  // namespace dynadiag
