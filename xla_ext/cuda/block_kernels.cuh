// Device kernels of diag_matmul for block diagonals (values[K, L_b, b, b], docs/design.md section 1.2).
// Same rules as diag_kernels.cuh: one source for nvcc and the host emulation, plain structs,
// SIMT_SHARED shared memory, simt::store for outputs.
//
// Coordinates. The block grid has a long axis of L_b blocks and a short one of P_b blocks; block t
// of diagonal d sits at long index t and short index (t + d) % P_b (tall W: long = rows of W, i.e.
// output features; wide W: long = columns, input features). values[k, t][i][j] is W[row i][col j]
// of that block. The forward product reads rows i of each block as outputs and columns j as inputs,
// dx the other way round (kTranspose).
//
// Products (fwd, dx): one thread block per (output panel, 128-row slab), panel fastest, so a slab
// of the input stays in L2 while all its panels run. Every block diagonal touches every output
// block, so a panel's list of input blocks is not searched for: it is enumerated from the offsets
// (one x block per diagonal, or per diagonal and wrap), every entry useful.
//   kOutLong (outputs on the long axis: tall fwd, wide dx): a panel is the output blocks
//     t = s + w * P_b of one residue s (up to 128 columns); they all read the same input block
//     (s + d_k) % P_b for diagonal k, so each x block loaded feeds every block of the panel.
//   otherwise (outputs on the short axis: wide fwd, tall dx): a panel is one output block s, which
//     reads the input blocks t = (s - d_k) % P_b + w * P_b for every diagonal k and wrap w.
// The contraction runs in slices of 16 input columns (min(b, 16) on CUDA cores) through a
// double-buffered shared-memory pipeline: the loads of the next stage are issued into registers
// before the current stage's products and stored to shared memory after them (plain loads, no
// cp.async: the emulation runs this code). bfloat16/float16 with b a multiple of 16 multiply on
// tensor cores (wmma m16n16k16, float32 accumulation; warp w owns rows 16w.. of the slab); float32
// and b = 8 on CUDA cores (float32 FMAs).
//
// dvalues (the block SDDMM dvalues[k, t] = out_block^T in_block over rows): one thread block per
// (residue r, chunk of wraps t = r + w * P_b, group of diagonals, row split). All its long-axis
// blocks t and all its diagonals' short blocks (r + d_k) % P_b are loaded once per 16-row stage and
// every pair multiplied (tensor cores for 16-bit dtypes and b % 16 == 0). Row splits write float32
// partial sums that a second kernel adds in split order: deterministic, no float atomics.
//
// An out-of-range offset makes the whole fwd/dx output NaN (every panel visits every diagonal) and
// that diagonal's dvalues NaN; nothing is read through it.
#pragma once

#include <cstdint>

#include "cuda/kernel_common.cuh"

namespace dynadiag {
namespace cuda {

constexpr int kBlockRows = 128;
constexpr int kBlockThreads = 256;
constexpr int kBlockWarps = kBlockThreads / 32;
constexpr int kBlockMaxCols = 128;                   // output columns of a panel
constexpr int kBlockColFrags = kBlockMaxCols / 16;   // accumulator fragments per warp
constexpr int kBlockSlice = 16;                      // contraction columns per slice
constexpr int kSliceWeights = kBlockMaxCols * kBlockSlice;  // weight elements of one slice
constexpr int kBlockStageSlices = 2;                 // slices per stage (tensor cores)
constexpr int kBlockSimtMaxRows = kBlockRows * kBlockMaxCols / kBlockThreads;  // accumulators
constexpr int kBlockSddmmStageRows = 16;
constexpr int kBlockSddmmMaxElems = 16384;           // accumulators of one SDDMM thread block
constexpr int kBlockSddmmStageBytes = 16384;         // operands of one stage
constexpr int kBlockSddmmMaxFrags = kBlockSddmmMaxElems / 256 / kBlockWarps;  // per warp
static_assert(kBlockWarps * 16 == kBlockRows, "one 16-row wmma tile per warp");
static_assert(kBlockRows * kBlockSlice % kBlockThreads == 0, "x slice split evenly");
static_assert(kSliceWeights % kBlockThreads == 0, "weight slice split evenly");

template <class T>
struct BlockProductArgs {
  const T* in;             // [rows, q_dim]: x (forward) or dy (dx)
  T* out;                  // [rows, o_dim]
  const T* values;         // [K, L_b, b, b]
  const int32_t* offsets;  // [K]
  int64_t rows;
  int32_t q_dim, o_dim, K, P_b, L_b, b;
  int32_t wraps;           // ceil(L_b / P_b)
  int32_t per_panel;       // long-axis output blocks per panel (kOutLong), else 1
  int32_t n_panels;
};

// One slice of a panel's contraction: `width` input columns of one x block and the blocks of
// values that multiply them (one per output block of the panel).
struct BlockSlice {
  bool empty;       // nothing to load or multiply (a wrap past L_b, or a bad offset)
  bool bad;         // the offset is out of range
  bool first;       // the first slice of its diagonal: the panel reads offsets[k] here
  int x_col;        // first input column
  int j0;           // first contraction index within the block
  int64_t w_block;  // k * L_b + t of the first output block's weights (kOutLong: + u * P_b for
                    // the panel's u-th output block)
};

template <bool kOutLong, class T>
__device__ __forceinline__ BlockSlice block_slice(const BlockProductArgs<T>& a, int s, int chunk,
                                                  int i, int width) {
  const int spb = a.b / width;
  BlockSlice sl;
  int k, w = 0;
  if (kOutLong) {
    k = i / spb;
  } else {
    k = i / (a.wraps * spb);
    w = (i / spb) % a.wraps;
  }
  sl.j0 = (i % spb) * width;
  sl.first = sl.j0 == 0 && w == 0;
  const int d = a.offsets[k];
  sl.bad = !valid_offset(d, a.P_b);
  sl.empty = sl.bad;
  sl.x_col = 0;
  sl.w_block = 0;
  if (sl.bad) return sl;
  if (kOutLong) {
    int xb = s + d;
    if (xb >= a.P_b) xb -= a.P_b;
    sl.x_col = xb * a.b + sl.j0;
    sl.w_block = int64_t(k) * a.L_b + s + int64_t(chunk) * a.per_panel * a.P_b;
  } else {
    int r = s - d;
    if (r < 0) r += a.P_b;
    const int t = r + w * a.P_b;
    sl.empty = t >= a.L_b;
    sl.x_col = t * a.b + sl.j0;
    sl.w_block = int64_t(k) * a.L_b + t;
  }
  return sl;
}

// The panel of a product thread block: residue s, wrap chunk, and how many output blocks it has.
struct BlockPanel {
  int s, chunk, uses;
  int64_t r0;
  int rows_here;
};

template <bool kOutLong, class T>
__device__ __forceinline__ BlockPanel block_panel(const BlockProductArgs<T>& a) {
  BlockPanel p;
  const int64_t idx = blockIdx.x;
  const int panel = static_cast<int>(idx % a.n_panels);
  p.r0 = idx / a.n_panels * kBlockRows;
  p.rows_here = static_cast<int>(a.rows - p.r0 < kBlockRows ? a.rows - p.r0 : kBlockRows);
  p.s = panel % a.P_b;
  p.chunk = panel / a.P_b;
  p.uses = 1;
  if (kOutLong) {
    p.uses = 0;
    for (int w = 0; w < a.per_panel; ++w)
      p.uses += p.s + (p.chunk * a.per_panel + w) * a.P_b < a.L_b;
  }
  return p;
}

// Output feature of panel column c.
template <bool kOutLong, class T>
__device__ __forceinline__ int64_t block_out_col(const BlockProductArgs<T>& a, const BlockPanel& p,
                                                 int c) {
  if (!kOutLong) return int64_t(p.s) * a.b + c;
  const int u = c / a.b;
  return (int64_t(p.s) + int64_t(p.chunk * a.per_panel + u) * a.P_b) * a.b + c % a.b;
}

// Loads slice i's x columns (rows of the slab, `width` wide) and weights into registers; the
// weights are laid out [use][output n][contraction kk] (kk fastest), i.e. column-major B operands.
template <bool kOutLong, bool kTranspose, int kPer, class T>
__device__ __forceinline__ void fetch_block_slice(const BlockProductArgs<T>& a, const BlockPanel& p,
                                                  int i, int width, T (&xr)[kPer], T (&wr)[kPer],
                                                  bool& bad, Tally& tally) {
  const int tid = threadIdx.x;
  const BlockSlice sl = block_slice<kOutLong>(a, p.s, p.chunk, i, width);
  if (sl.first && tid == 0) tally.load(4);
  bad = bad || sl.bad;
  if (sl.empty) return;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int n = tid + e * kBlockThreads, r = n / width, c = n % width;
    const bool ok = r < p.rows_here && r < kBlockRows;
    xr[e] = ok ? a.in[(p.r0 + r) * a.q_dim + sl.x_col + c] : from_float<T>(0.0f);
    if (ok) tally.load(sizeof(T));
  }
  const int per_use = a.b * width;
  const int bb = a.b * a.b;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int n = tid + e * kBlockThreads;
    if (n >= p.uses * per_use) continue;
    const int u = n / per_use, rem = n % per_use;
    const int64_t blk = (sl.w_block + int64_t(u) * a.P_b) * bb;
    // consecutive threads read consecutive memory: kk fastest (fwd) or the output index (dx)
    const int64_t at = kTranspose ? blk + int64_t(sl.j0 + rem / a.b) * a.b + rem % a.b
                                  : blk + int64_t(rem / width) * a.b + sl.j0 + rem % width;
    wr[e] = a.values[at];
    tally.load(sizeof(T));
  }
}

// Shared-memory index of register element e of a weight slice (see fetch_block_slice).
template <bool kTranspose>
__device__ __forceinline__ int weight_slot(int n, int b, int width) {
  if (!kTranspose) return n;
  const int per_use = b * width, u = n / per_use, rem = n % per_use;
  return u * per_use + (rem % b) * width + rem / b;
}

// ---- tensor-core product ------------------------------------------------------------------------
template <class T, bool kOutLong, bool kTranspose>
__global__ void __launch_bounds__(kBlockThreads) block_product_tc_kernel(BlockProductArgs<T> a) {
  namespace wmma = nvcuda::wmma;
  constexpr int kX = kBlockRows * kBlockSlice;
  constexpr int kPer = kX / kBlockThreads;
  static_assert(kSliceWeights / kBlockThreads == kPer, "x and weight slices share the register split");
  SIMT_SHARED_ALIGNED(T[2][kBlockStageSlices][kX], xs, 32);             // [row][kk]
  SIMT_SHARED_ALIGNED(T[2][kBlockStageSlices][kSliceWeights], ws, 32);  // [use][n][kk]
  SIMT_SHARED_ALIGNED(float[kBlockWarps][256], cs, 32);                 // epilogue, per warp
  Tally tally;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const BlockPanel p = block_panel<kOutLong>(a);
  const int bf = a.b / 16;
  const int n_frags = p.uses * bf;
  const int n_slices = (kOutLong ? a.K : a.K * a.wraps) * bf;
  const int n_stages = (n_slices + kBlockStageSlices - 1) / kBlockStageSlices;
  if (tid == 0) tally.cta();
  T xr[kBlockStageSlices][kPer], wr[kBlockStageSlices][kPer];
  bool bad = false;  // the same for every thread: all see the same slices
  auto fetch = [&](int stage) {
#pragma unroll
    for (int j = 0; j < kBlockStageSlices; ++j) {
      const int i = stage * kBlockStageSlices + j;
      if (i < n_slices)
        fetch_block_slice<kOutLong, kTranspose>(a, p, i, kBlockSlice, xr[j], wr[j], bad, tally);
    }
  };
  auto commit = [&](int stage, int buf) {
#pragma unroll
    for (int j = 0; j < kBlockStageSlices; ++j) {
      const int i = stage * kBlockStageSlices + j;
      if (i >= n_slices || block_slice<kOutLong>(a, p.s, p.chunk, i, kBlockSlice).empty) continue;
#pragma unroll
      for (int e = 0; e < kPer; ++e) xs[buf][j][tid + e * kBlockThreads] = xr[j][e];
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        const int n = tid + e * kBlockThreads;
        if (n < p.uses * a.b * kBlockSlice)
          ws[buf][j][weight_slot<kTranspose>(n, a.b, kBlockSlice)] = wr[j][e];
      }
    }
  };
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kBlockColFrags];
#pragma unroll
  for (int f = 0; f < kBlockColFrags; ++f) wmma::fill_fragment(acc[f], 0.0f);
  fetch(0);
  commit(0, 0);
  __syncthreads();
  for (int st = 0; st < n_stages; ++st) {
    const int buf = st & 1;
    if (st + 1 < n_stages) fetch(st + 1);
#pragma unroll
    for (int j = 0; j < kBlockStageSlices; ++j) {
      const int i = st * kBlockStageSlices + j;
      if (i >= n_slices || block_slice<kOutLong>(a, p.s, p.chunk, i, kBlockSlice).empty) continue;
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
      wmma::load_matrix_sync(fa, xs[buf][j] + warp * 256, kBlockSlice);
#pragma unroll
      for (int f = 0; f < kBlockColFrags; ++f) {
        if (f >= n_frags) continue;
        // fragment f: output columns 16f.. of the panel = use f / bf, columns 16 (f % bf).. of it
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
        wmma::load_matrix_sync(fb, ws[buf][j] + (f / bf) * a.b * kBlockSlice + (f % bf) * 256,
                               kBlockSlice);
        wmma::mma_sync(acc[f], fa, fb, acc[f]);
        if (lane == 0) tally.mma(1);
      }
    }
    if (st + 1 < n_stages) commit(st + 1, buf ^ 1);
    __syncthreads();
  }
#pragma unroll
  for (int f = 0; f < kBlockColFrags; ++f) {
    if (f >= n_frags) continue;
    wmma::store_matrix_sync(cs[warp] + 0, acc[f], 16, wmma::mem_row_major);
    __syncwarp();
    for (int e = lane; e < 256; e += 32) {
      const int r = warp * 16 + e / 16;
      if (r >= p.rows_here) continue;
      const float v = cs[warp][e];
      const int64_t col = block_out_col<kOutLong>(a, p, f * 16 + e % 16);
      simt::store(&a.out[(p.r0 + r) * a.o_dim + col], from_float<T>(bad ? quiet_nan() : v));
      tally.store(sizeof(T));
    }
    __syncwarp();  // cs[warp] is overwritten by the next fragment
  }
  tally.flush(kCountBlockProduct);
}

// ---- CUDA-core product (float32; b = 8) ---------------------------------------------------------
// Thread (group g, column c) of a power-of-two column split owns rows g, g + groups, ... of panel
// column c; per slice it keeps the column's weights in a register and streams the x rows.
template <class T, bool kOutLong, bool kTranspose>
__global__ void __launch_bounds__(kBlockThreads) block_product_simt_kernel(BlockProductArgs<T> a) {
  constexpr int kX = kBlockRows * kBlockSlice;
  constexpr int kPer = kX / kBlockThreads;
  SIMT_SHARED_ALIGNED(T[2][kX], xs, 16);             // [row][kk], `width` wide
  SIMT_SHARED_ALIGNED(T[2][kSliceWeights], ws, 16);  // [use][n][kk]
  Tally tally;
  const int tid = threadIdx.x;
  const BlockPanel p = block_panel<kOutLong>(a);
  const int width = a.b < kBlockSlice ? a.b : kBlockSlice;
  const int cols = p.uses * a.b;
  int cols_alloc = 1;
  while (cols_alloc < cols) cols_alloc *= 2;
  const int groups = kBlockThreads / cols_alloc;
  const int rpt = kBlockRows / groups;
  const int c = tid % cols_alloc, g = tid / cols_alloc;
  const int n_slices = (kOutLong ? a.K : a.K * a.wraps) * (a.b / width);
  if (tid == 0) tally.cta();
  float acc[kBlockSimtMaxRows];
#pragma unroll
  for (int m = 0; m < kBlockSimtMaxRows; ++m) acc[m] = 0.0f;
  T xr[kPer], wr[kPer];
  bool bad = false;
  auto commit = [&](int i, int buf) {
    if (block_slice<kOutLong>(a, p.s, p.chunk, i, width).empty) return;
#pragma unroll
    for (int e = 0; e < kPer; ++e) xs[buf][tid + e * kBlockThreads] = xr[e];
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int n = tid + e * kBlockThreads;
      if (n < cols * width) ws[buf][weight_slot<kTranspose>(n, a.b, width)] = wr[e];
    }
  };
  if (n_slices > 0) {
    fetch_block_slice<kOutLong, kTranspose>(a, p, 0, width, xr, wr, bad, tally);
    commit(0, 0);
  }
  __syncthreads();
  for (int i = 0; i < n_slices; ++i) {
    const int buf = i & 1;
    if (i + 1 < n_slices) fetch_block_slice<kOutLong, kTranspose>(a, p, i + 1, width, xr, wr, bad, tally);
    if (c < cols && !block_slice<kOutLong>(a, p.s, p.chunk, i, width).empty) {
      for (int kk = 0; kk < width; ++kk) {
        const float w = to_float(ws[buf][c * width + kk]);
#pragma unroll
        for (int m = 0; m < kBlockSimtMaxRows; ++m) {
          if (m >= rpt) continue;
          const float x = to_float(xs[buf][(g + m * groups) * width + kk]);
          acc[m] += x * w;
        }
      }
      tally.fma(int64_t(rpt) * width);
    }
    if (i + 1 < n_slices) commit(i + 1, buf ^ 1);
    __syncthreads();
  }
  if (c < cols) {
    const int64_t col = block_out_col<kOutLong>(a, p, c);
#pragma unroll
    for (int m = 0; m < kBlockSimtMaxRows; ++m) {  // unrolled: acc stays in registers
      const int r = g + m * groups;
      if (m >= rpt || r >= p.rows_here) continue;
      simt::store(&a.out[(p.r0 + r) * a.o_dim + col], from_float<T>(bad ? quiet_nan() : acc[m]));
      tally.store(sizeof(T));
    }
  }
  tally.flush(kCountBlockProduct);
}

// ---- dvalues: block SDDMM -----------------------------------------------------------------------
template <class T>
struct BlockSddmmArgs {
  const T* dy;             // [rows, out_f]
  const T* x;              // [rows, in_f]
  const int32_t* offsets;  // [K]
  T* out;                  // [K, L_b, b, b] when splits == 1
  float* partial;          // [splits, K, L_b, b, b] when splits > 1
  int64_t rows, rows_per_split;
  int32_t in_f, out_f, K, P_b, L_b, b;
  int32_t tall;            // the long axis holds the output features (rows of W)
  int32_t per_cta, chunks, diags, groups, splits;
};

// The work of one SDDMM thread block.
struct SddmmTile {
  int r, chunk, g, z;
  int n_long;   // long-axis blocks t = r + (chunk * per_cta + w) * P_b, w < n_long
  int n_diags;  // diagonals k = g * diags + j, j < n_diags
  int64_t row0, row1;
};

template <class T>
__device__ __forceinline__ SddmmTile sddmm_tile(const BlockSddmmArgs<T>& a) {
  SddmmTile s;
  int64_t idx = blockIdx.x;
  s.r = static_cast<int>(idx % a.P_b);
  idx /= a.P_b;
  s.chunk = static_cast<int>(idx % a.chunks);
  idx /= a.chunks;
  s.g = static_cast<int>(idx % a.groups);
  s.z = static_cast<int>(idx / a.groups);
  s.n_long = 0;
  for (int w = 0; w < a.per_cta; ++w) s.n_long += s.r + (s.chunk * a.per_cta + w) * a.P_b < a.L_b;
  s.n_diags = imin(a.diags, a.K - s.g * a.diags);
  s.row0 = int64_t(s.z) * a.rows_per_split;
  s.row1 = s.row0 + a.rows_per_split < a.rows ? s.row0 + a.rows_per_split : a.rows;
  return s;
}

// Stage layout in shared memory: the long blocks [w][row][b], then the short blocks [j][row][b].
// Loads one stage (16 rows from `row`) into registers; `bad` bits mark out-of-range diagonals.
template <int kPer, class T>
__device__ __forceinline__ void fetch_sddmm_stage(const BlockSddmmArgs<T>& a, const SddmmTile& s,
                                                  int64_t row, T (&regs)[kPer], Tally& tally) {
  const int tid = threadIdx.x;
  const int per_block = kBlockSddmmStageRows * a.b;
  const int n_blocks = s.n_long + s.n_diags;
  const T* long_op = a.tall ? a.dy : a.x;
  const T* short_op = a.tall ? a.x : a.dy;
  const int long_w = a.tall ? a.out_f : a.in_f, short_w = a.tall ? a.in_f : a.out_f;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int n = tid + e * kBlockThreads;
    regs[e] = from_float<T>(0.0f);
    if (n >= n_blocks * per_block) continue;
    const int blk = n / per_block, rem = n % per_block;
    const int64_t rr = row + rem / a.b;
    if (rr >= s.row1) continue;
    const int col = rem % a.b;
    if (blk < s.n_long) {
      const int64_t t = s.r + int64_t(s.chunk * a.per_cta + blk) * a.P_b;
      regs[e] = long_op[rr * long_w + t * a.b + col];
    } else {
      const int d = a.offsets[s.g * a.diags + blk - s.n_long];
      if (!valid_offset(d, a.P_b)) continue;
      int sb = s.r + d;
      if (sb >= a.P_b) sb -= a.P_b;
      regs[e] = short_op[rr * short_w + int64_t(sb) * a.b + col];
    }
    tally.load(sizeof(T));
  }
}

// Stores the registers of fetch_sddmm_stage to shared memory (`dst`: one stage buffer).
template <int kPer, class Dst, class T>
__device__ __forceinline__ void commit_sddmm_stage(Dst dst, const T (&regs)[kPer], int n_stage) {
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int n = threadIdx.x + e * kBlockThreads;
    if (n < n_stage) dst[n] = regs[e];
  }
}

// Stores result element (i, j) of the thread block's result block blk (diagonal-major): to dvalues,
// or to the split's partial sums; NaN for an out-of-range diagonal.
template <class T>
__device__ __forceinline__ void store_sddmm(const BlockSddmmArgs<T>& a, const SddmmTile& s, int blk,
                                            int i, int j, float v, Tally& tally) {
  const int jd = blk / s.n_long, w = blk % s.n_long;
  const int k = s.g * a.diags + jd;
  const int64_t t = s.r + int64_t(s.chunk * a.per_cta + w) * a.P_b;
  if (!valid_offset(a.offsets[k], a.P_b)) v = quiet_nan();
  const int64_t at = ((int64_t(k) * a.L_b + t) * a.b + i) * a.b + j;
  if (a.splits == 1) {
    simt::store(&a.out[at], from_float<T>(v));
    tally.store(sizeof(T));
  } else {
    simt::store(&a.partial[int64_t(s.z) * a.K * a.L_b * a.b * a.b + at], v);
    tally.store(4);
  }
}

// Tensor-core SDDMM: the thread block's G x n_long result blocks are (b/16)^2 fragments each, at
// most 64 in all; warp w owns fragments w, w + 8, ...
template <class T>
__global__ void __launch_bounds__(kBlockThreads) block_sddmm_tc_kernel(BlockSddmmArgs<T> a) {
  namespace wmma = nvcuda::wmma;
  constexpr int kStage = kBlockSddmmStageBytes / sizeof(T);
  constexpr int kPer = kStage / kBlockThreads;
  SIMT_SHARED_ALIGNED(T[2][kStage], buf, 32);
  SIMT_SHARED_ALIGNED(float[kBlockWarps][256], cs, 32);
  Tally tally;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const SddmmTile s = sddmm_tile(a);
  const int bf = a.b / 16, F = bf * bf;
  const int n_frags = s.n_long * s.n_diags * F;
  const int per_block = kBlockSddmmStageRows * a.b;
  const int n_stages = static_cast<int>((s.row1 - s.row0 + kBlockSddmmStageRows - 1) / kBlockSddmmStageRows);
  if (tid == 0) {
    tally.cta();
    tally.load(4 * int64_t(s.n_diags));
  }
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kBlockSddmmMaxFrags];
#pragma unroll
  for (int m = 0; m < kBlockSddmmMaxFrags; ++m) wmma::fill_fragment(acc[m], 0.0f);
  T regs[kPer];
  const int n_stage = (s.n_long + s.n_diags) * per_block;
  if (n_stages > 0) {
    fetch_sddmm_stage(a, s, s.row0, regs, tally);
    commit_sddmm_stage(buf[0], regs, n_stage);
  }
  __syncthreads();
  for (int st = 0; st < n_stages; ++st) {
    const int b = st & 1;
    if (st + 1 < n_stages) fetch_sddmm_stage(a, s, s.row0 + int64_t(st + 1) * kBlockSddmmStageRows, regs, tally);
#pragma unroll
    for (int m = 0; m < kBlockSddmmMaxFrags; ++m) {
      const int f = warp + m * kBlockWarps;
      if (f >= n_frags) continue;
      const int blk = f / F, io = (f % F) / bf, jo = f % bf;
      const int jd = blk / s.n_long, w = blk % s.n_long;
      if (!valid_offset(a.offsets[s.g * a.diags + jd], a.P_b)) continue;
      // result rows = output features: the long block on tall W, the short block on wide W
      const int long_at = w * per_block, short_at = (s.n_long + jd) * per_block;
      const int rows_at = a.tall ? long_at : short_at, cols_at = a.tall ? short_at : long_at;
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
      wmma::load_matrix_sync(fa, buf[b] + rows_at + io * 16, a.b);
      wmma::load_matrix_sync(fb, buf[b] + cols_at + jo * 16, a.b);
      wmma::mma_sync(acc[m], fa, fb, acc[m]);
      if (lane == 0) tally.mma(1);
    }
    if (st + 1 < n_stages) commit_sddmm_stage(buf[b ^ 1], regs, n_stage);
    __syncthreads();
  }
#pragma unroll
  for (int m = 0; m < kBlockSddmmMaxFrags; ++m) {
    const int f = warp + m * kBlockWarps;
    if (f >= n_frags) continue;
    wmma::store_matrix_sync(cs[warp] + 0, acc[m], 16, wmma::mem_row_major);
    __syncwarp();
    const int blk = f / F, io = (f % F) / bf, jo = f % bf;
    for (int e = lane; e < 256; e += 32) {
      const float v = cs[warp][e];
      store_sddmm(a, s, blk, io * 16 + e / 16, jo * 16 + e % 16, v, tally);
    }
    __syncwarp();
  }
  tally.flush(kCountBlockSddmm);
}

// CUDA-core SDDMM (float32; b = 8): thread `tid` owns result elements tid, tid + 256, ...
template <class T>
__global__ void __launch_bounds__(kBlockThreads, 1) block_sddmm_simt_kernel(BlockSddmmArgs<T> a) {
  constexpr int kStage = kBlockSddmmStageBytes / sizeof(T);
  constexpr int kPer = kStage / kBlockThreads;
  constexpr int kOwn = kBlockSddmmMaxElems / kBlockThreads;
  SIMT_SHARED_ALIGNED(T[2][kStage], buf, 16);
  Tally tally;
  const int tid = threadIdx.x;
  const SddmmTile s = sddmm_tile(a);
  const int bb = a.b * a.b;
  const int n_elems = s.n_long * s.n_diags * bb;
  const int per_block = kBlockSddmmStageRows * a.b;
  const int n_stages = static_cast<int>((s.row1 - s.row0 + kBlockSddmmStageRows - 1) / kBlockSddmmStageRows);
  if (tid == 0) {
    tally.cta();
    tally.load(4 * int64_t(s.n_diags));
  }
  float acc[kOwn];
#pragma unroll
  for (int m = 0; m < kOwn; ++m) acc[m] = 0.0f;
  T regs[kPer];
  const int n_stage = (s.n_long + s.n_diags) * per_block;
  if (n_stages > 0) {
    fetch_sddmm_stage(a, s, s.row0, regs, tally);
    commit_sddmm_stage(buf[0], regs, n_stage);
  }
  __syncthreads();
  for (int st = 0; st < n_stages; ++st) {
    const int b = st & 1;
    if (st + 1 < n_stages) fetch_sddmm_stage(a, s, s.row0 + int64_t(st + 1) * kBlockSddmmStageRows, regs, tally);
#pragma unroll
    for (int m = 0; m < kOwn; ++m) {
      const int e = tid + m * kBlockThreads;
      if (e >= n_elems) continue;
      const int blk = e / bb, i = (e % bb) / a.b, j = e % a.b;
      const int jd = blk / s.n_long, w = blk % s.n_long;
      if (!valid_offset(a.offsets[s.g * a.diags + jd], a.P_b)) continue;
      const int long_at = w * per_block, short_at = (s.n_long + jd) * per_block;
      const int rows_at = a.tall ? long_at : short_at, cols_at = a.tall ? short_at : long_at;
      float sum = acc[m];
      for (int rr = 0; rr < kBlockSddmmStageRows; ++rr) {
        const float u = to_float(buf[b][rows_at + rr * a.b + i]);
        const float v = to_float(buf[b][cols_at + rr * a.b + j]);
        sum += u * v;
      }
      acc[m] = sum;
      tally.fma(kBlockSddmmStageRows);
    }
    if (st + 1 < n_stages) commit_sddmm_stage(buf[b ^ 1], regs, n_stage);
    __syncthreads();
  }
#pragma unroll
  for (int m = 0; m < kOwn; ++m) {
    const int e = tid + m * kBlockThreads;
    if (e < n_elems) store_sddmm(a, s, e / bb, (e % bb) / a.b, e % a.b, acc[m], tally);
  }
  tally.flush(kCountBlockSddmm);
}

}  // namespace cuda
}  // namespace dynadiag
