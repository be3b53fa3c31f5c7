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
// double-buffered shared-memory pipeline. bfloat16/float16 with b a multiple of 16 multiply on
// tensor cores (wmma m16n16k16, float32 accumulation) in a kernel templated on b and the panel
// width, fed by cp.async from a per-block slice table (see block_product_tc_kernel); float32 and
// b = 8 on CUDA cores (float32 FMAs; the next slice's loads go to registers before the current
// slice's products and to shared memory after them).
//
// dvalues (the block SDDMM dvalues[k, t] = out_block^T in_block over rows): one thread block per
// (residue r, chunk of wraps t = r + w * P_b, group of diagonals, row split). All its long-axis
// blocks t and all its diagonals' short blocks (r + d_k) % P_b are loaded once per stage of rows
// and every pair multiplied, so the long operand is read once and the short one once per diagonal
// (tensor cores for 16-bit dtypes and b % 16 == 0: block_sddmm_tc_kernel, templated on b; CUDA
// cores in 16-row stages otherwise). Row splits write float32 partial sums that a second kernel
// adds in split order: deterministic, no float atomics.
//
// An out-of-range offset makes the whole fwd/dx output NaN (every panel visits every diagonal) and
// that diagonal's dvalues NaN; nothing is read through it.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/kernel_common.cuh"
#include "cuda/launch_plan.h"

namespace dynadiag {
namespace cuda {

constexpr int kBlockColFrags = kBlockMaxCols / 16;   // accumulator fragments per warp
constexpr int kSliceWeights = kBlockMaxCols * kBlockSlice;  // weight elements of one slice
constexpr int kBlockSimtMaxRows = kBlockRows * kBlockMaxCols / kBlockThreads;  // accumulators
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
__device__ __forceinline__ BlockPanel block_panel(const BlockProductArgs<T>& a, int slab_rows) {
  BlockPanel p;
  const int64_t idx = blockIdx.x;
  const int panel = static_cast<int>(idx % a.n_panels);
  p.r0 = idx / a.n_panels * slab_rows;
  p.rows_here = static_cast<int>(a.rows - p.r0 < slab_rows ? a.rows - p.r0 : slab_rows);
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
// Templated on b and the panel width so that every index in the main loop is a shift, a mask or an
// add (a runtime division is a ~20-instruction sequence). A thread block owns kRows rows of one
// panel of kCols columns (a power of two: the panel's output blocks rounded up, <= 128); warp w owns
// rows 16 w kRowFrags.. and every column, so each x fragment it loads feeds all of its accumulators
// and each weight fragment feeds kRowFrags products. Narrow panels take two row fragments per warp
// (256 rows) so that every warp keeps 8 accumulator tiles (64 registers) busy; a full panel takes
// one (128 rows).
//
// The thread block first builds its slice table in shared memory, one entry per x block it reads
// (per diagonal, or per diagonal and wrap): the block's first x column (-1: a wrap past L_b,
// -2: an out-of-range offset) and the element offset of its weights; the contraction then runs
// over the entries' 16-column slices with a kTcStages-deep cp.async pipeline into padded shared
// memory: kTcStages - 1 slices load while one is multiplied (on an H100 three stages ran within
// -5%..+1% of two: what sets the time per stage is not one stage's load latency,
// docs/gpu_cost_model.md). The epilogue converts each accumulator tile to T, through a float tile that reuses the x stages,
// and writes rows of 8 outputs with 16-byte stores.
constexpr int kTcXLd = kBlockSlice + kTcPad;  // x slice: [row][kk]
constexpr int kTcEpiLd = 16 + 4;         // float epilogue tile: [row][col]
constexpr int kTcTable = kBlockThreads;  // slice-table entries built per pass (one per thread)

__host__ __device__ constexpr int ilog2(int v) { return v <= 1 ? 0 : 1 + ilog2(v / 2); }

template <int kB, int kCols>
struct TcPanel {
  static_assert(kB % 16 == 0 && kB <= kBlockMaxCols && (kB & (kB - 1)) == 0, "b in {16, 32, 64, 128}");
  static_assert(kCols % kB == 0 && kCols <= kBlockMaxCols && (kCols & (kCols - 1)) == 0, "panel width");
  static constexpr int kColFrags = kCols / 16;
  static constexpr int kRowFrags = kColFrags >= 8 ? 1 : 2;
  static constexpr int kRows = kBlockWarps * 16 * kRowFrags;
  static constexpr int kLogB = ilog2(kB);
  static constexpr int kSpb = kB / kBlockSlice;  // slices per x block
  static constexpr int kLogSpb = ilog2(kSpb);
  // 16-byte chunks of one slice: x rows are 16 elements (2 chunks); the weights are kCols rows of
  // 16 (forward, [n][kk]) or 16 rows of kCols (dx, [kk][n]), 2 kCols chunks either way.
  static constexpr int kXPer = kRows * 2 / kBlockThreads;
  static constexpr int kWChunks = kCols * 2;
  // Padding: 8 elements (16 bytes) per row make the row stride an odd number of 16-byte units, so
  // the 8 rows of each 8x8 matrix a fragment load reads fall in distinct banks.
  static constexpr int kWLdFwd = kBlockSlice + kTcPad;
  static constexpr int kWLdDx = kCols + kTcPad;
  static constexpr int kWElems = kCols * kWLdFwd > kBlockSlice * kWLdDx ? kCols * kWLdFwd : kBlockSlice * kWLdDx;
  static_assert(kRows * 2 % kBlockThreads == 0 && kWChunks <= kBlockThreads, "chunks split evenly");
};

// Two floats as T in one 32-bit word (the first in the low half), for the 16-byte stores.
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
#ifdef __CUDACC__
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
#else
template <class T>
inline uint32_t pack2(float lo, float hi) {
  return uint32_t(from_float<T>(lo).bits) | uint32_t(from_float<T>(hi).bits) << 16;
}
#endif

template <class T, bool kOutLong, bool kTranspose, int kB, int kCols>
__global__ void __launch_bounds__(kBlockThreads, 2) block_product_tc_kernel(BlockProductArgs<T> a) {
  namespace wmma = nvcuda::wmma;
  using S = TcPanel<kB, kCols>;
  using BLayout = typename std::conditional<kTranspose, wmma::row_major, wmma::col_major>::type;
  constexpr int kWLd = kTranspose ? S::kWLdDx : S::kWLdFwd;
  static_assert(kBlockWarps * 16 * kTcEpiLd * 4 <= kTcStages * S::kRows * kTcXLd * int(sizeof(T)),
                "the epilogue tiles fit in the x stages");
  SIMT_SHARED_ALIGNED(T[kTcStages][S::kRows * kTcXLd], xs, 32);
  SIMT_SHARED_ALIGNED(T[kTcStages][S::kWElems], ws, 32);
  SIMT_SHARED(int32_t[kTcTable], xcol_t);
  SIMT_SHARED(int64_t[kTcTable], wofs_t);
  Tally tally;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const BlockPanel p = block_panel<kOutLong>(a, S::kRows);
  const int n_frags = kOutLong ? p.uses * (kB / 16) : S::kColFrags;
  const int64_t bb = int64_t(kB) * kB;
  if (tid == 0) tally.cta();

  // This thread's 16-byte chunks of every slice: sources relative to the slice's x column and
  // weight offset, destinations in the stage buffers.
  // Rows past the end of a partial slab load the slab's last row again (never stored): a
  // predicate-free copy costs fewer instructions than zero-filling them.
  const T* x_src[S::kXPer];
  int x_dst[S::kXPer];
#pragma unroll
  for (int e = 0; e < S::kXPer; ++e) {
    const int c = tid + e * kBlockThreads, row = c >> 1, half = c & 1;
    x_src[e] = a.in + (p.r0 + imin(row, p.rows_here - 1)) * a.q_dim + half * 8;
    x_dst[e] = row * kTcXLd + half * 8;
  }
  int w_dst;
  const T* w_src;
  bool w_ok;
  {
    int n, kk, nn;
    if (kTranspose) {  // [kk][n]: kCols / 8 chunks per row
      constexpr int kLogRow = ilog2(kCols / 8);
      kk = tid >> kLogRow;
      n = (tid & (kCols / 8 - 1)) * 8;
      w_dst = kk * kWLd + n;
    } else {  // [n][kk]: 2 chunks per row
      n = tid >> 1;
      kk = (tid & 1) * 8;
      w_dst = n * kWLd + kk;
    }
    const int u = n >> S::kLogB;
    nn = n & (kB - 1);
    w_ok = tid < S::kWChunks && (kOutLong ? u < p.uses : true);
    // consecutive threads read consecutive 16-byte chunks of a block row
    w_src = a.values + int64_t(u) * a.P_b * bb + (kTranspose ? kk * kB + nn : nn * kB + kk);
  }
  constexpr int kWSliceStep = kTranspose ? kBlockSlice * kB : kBlockSlice;  // per slice of a block

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[S::kRowFrags][S::kColFrags];
#pragma unroll
  for (int rf = 0; rf < S::kRowFrags; ++rf)
#pragma unroll
    for (int f = 0; f < S::kColFrags; ++f) wmma::fill_fragment(acc[rf][f], 0.0f);

  // Slice i of the table: entry i >> kLogSpb (x column xcol), contraction columns
  // 16 (i & (kSpb - 1)).. of it.
  auto issue = [&](int i, int xcol, int buf) {
    if (xcol < 0) return;
    const int entry = i >> S::kLogSpb, j = i & (S::kSpb - 1);
#pragma unroll
    for (int e = 0; e < S::kXPer; ++e) {
      simt::copy_async16(&xs[buf][x_dst[e]], x_src[e] + xcol + j * kBlockSlice);
      tally.load(16);
    }
    if (w_ok) {
      simt::copy_async16(&ws[buf][w_dst], w_src + wofs_t[entry] + j * kWSliceStep);
      tally.load(16);
    }
  };

  bool bad = false;  // the same for every thread: all read the whole table
  const int n_entries = kOutLong ? a.K : a.K * a.wraps;
  for (int e0 = 0; e0 < n_entries; e0 += kTcTable) {
    const int n_here = imin(kTcTable, n_entries - e0);
    __syncthreads();  // the previous pass is done with the table and the stage buffers
    if (tid < n_here) {
      const int e = e0 + tid;
      int k = e, w = 0;
      if (!kOutLong) {  // once per entry and thread block, outside the main loop
        k = e / a.wraps;
        w = e - k * a.wraps;
      }
      const int d = a.offsets[k];
      tally.load(4);
      int xcol = -2;
      int64_t wofs = 0;
      if (valid_offset(d, a.P_b)) {
        if (kOutLong) {
          int xb = p.s + d;
          if (xb >= a.P_b) xb -= a.P_b;
          xcol = xb * kB;
          wofs = (int64_t(k) * a.L_b + p.s + int64_t(p.chunk) * a.per_panel * a.P_b) * bb;
        } else {
          int r = p.s - d;
          if (r < 0) r += a.P_b;
          const int t = r + w * a.P_b;
          xcol = t < a.L_b ? t * kB : -1;
          wofs = (int64_t(k) * a.L_b + t) * bb;
        }
      }
      xcol_t[tid] = xcol;
      wofs_t[tid] = wofs;
    }
    __syncthreads();
    const int n_slices = n_here << S::kLogSpb;
    // Slices 0 .. kTcStages - 2 go out first; the one group per trip after them keeps the count
    // of committed groups fixed, so that waiting for all but the newest kTcStages - 2 means
    // slice i has landed.
#pragma unroll
    for (int j = 0; j < kTcStages - 1; ++j) {
      if (j < n_slices) issue(j, xcol_t[j >> S::kLogSpb], j);
      simt::copy_async_commit();
    }
    int buf = 0, next = kTcStages - 1;  // stages of slice i and of slice i + kTcStages - 1
    for (int i = 0; i < n_slices; ++i) {
      simt::copy_async_wait_prior<kTcStages - 2>();
      __syncthreads();  // slice i has landed, and every warp is done with slice i - 1's stage
      const int ahead = i + kTcStages - 1;
      if (ahead < n_slices) issue(ahead, xcol_t[ahead >> S::kLogSpb], next);
      simt::copy_async_commit();
      next = next == kTcStages - 1 ? 0 : next + 1;
      const int xcol = xcol_t[i >> S::kLogSpb];
      const int here = buf;
      buf = buf == kTcStages - 1 ? 0 : buf + 1;
      bad = bad || xcol == -2;
      if (xcol < 0) continue;
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[S::kRowFrags];
#pragma unroll
      for (int rf = 0; rf < S::kRowFrags; ++rf)
        simt::load_shared(fa[rf], &xs[here][(warp * S::kRowFrags + rf) * 16 * kTcXLd], kTcXLd);
#pragma unroll
      for (int f = 0; f < S::kColFrags; ++f) {
        if (f >= n_frags) continue;
        // output columns 16 f.. of the panel: [kk][n] columns or [n][kk] rows of the weights
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, BLayout> fb;
        simt::load_shared(fb, &ws[here][kTranspose ? f * 16 : f * 16 * kWLd], kWLd);
#pragma unroll
        for (int rf = 0; rf < S::kRowFrags; ++rf) wmma::mma_sync(acc[rf][f], fa[rf], fb, acc[rf][f]);
        if (lane == 0) tally.mma(S::kRowFrags);
      }
    }
  }

  simt::copy_async_wait();  // the trailing groups are empty; nothing may land in the tiles below
  __syncthreads();          // every warp is done with the stages the epilogue tiles reuse
  const auto cs = simt::pointer_cast<float>(&xs[0][0]) + warp * 16 * kTcEpiLd;

  // Panel column c = 16 f + 8 h of use u = c / b is output feature col0 + u P_b b + c % b.
  const int64_t col0 = kOutLong ? (int64_t(p.s) + int64_t(p.chunk) * a.per_panel * a.P_b) * kB : int64_t(p.s) * kB;
  const int64_t use_stride = int64_t(a.P_b) * kB;
  const int er = lane >> 1, eh = (lane & 1) * 8;
#pragma unroll
  for (int rf = 0; rf < S::kRowFrags; ++rf) {
#pragma unroll
    for (int f = 0; f < S::kColFrags; ++f) {
      if (f >= n_frags) continue;
      wmma::store_matrix_sync(cs, acc[rf][f], kTcEpiLd, wmma::mem_row_major);
      __syncwarp();
      float4 lo = *simt::pointer_cast<float4>(cs + er * kTcEpiLd + eh);
      float4 hi = *simt::pointer_cast<float4>(cs + er * kTcEpiLd + eh + 4);
      const int r = (warp * S::kRowFrags + rf) * 16 + er;
      if (r < p.rows_here) {
        if (bad) lo = hi = float4{quiet_nan(), quiet_nan(), quiet_nan(), quiet_nan()};
        // one aggregate built in one place: a select between two uint4 would be split into four
        // 4-byte stores
        const uint4 v{pack2<T>(lo.x, lo.y), pack2<T>(lo.z, lo.w), pack2<T>(hi.x, hi.y), pack2<T>(hi.z, hi.w)};
        const int c = f * 16;
        const int64_t col = col0 + (c >> S::kLogB) * use_stride + (c & (kB - 1)) + eh;
        simt::store(simt::pointer_cast<uint4>(&a.out[(p.r0 + r) * a.o_dim + col]), v);
        tally.store(16);
      }
      __syncwarp();  // this warp's tile is overwritten by the next one
    }
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
  const BlockPanel p = block_panel<kOutLong>(a, kBlockRows);
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

// ---- tensor-core SDDMM ---------------------------------------------------------------------------
// Templated on b (rows per stage and every index in the main loop are shifts and masks). The thread
// block first builds its block table in shared memory: the first column of each of its blocks in
// its operand (the n_long long-axis blocks, then the short block of each diagonal; -1 for an
// out-of-range diagonal). Each thread then owns fixed 16-byte chunks of a stage (block, row,
// column) and fixed result fragments: the rows of dy and x run through a kTcStages-deep cp.async
// pipeline into padded shared memory (as the product's), and each 16-row step multiplies dy^T (a
// column-major A fragment, ldmatrix.trans) by x (a row-major B fragment) into the fragment's
// accumulator. Every dy block of the thread block's stage is loaded once and feeds all its
// diagonals, every x block all its wraps. Rows past the end of a split are zero-filled in shared
// memory (they would add to the sums). The epilogue writes each 16x16 tile, through a float tile that reuses the stages, with
// 16-byte stores: 8 outputs of T, or 4 float32 partial sums.
template <int kB>
struct TcSddmm {
  static_assert(kB % 16 == 0 && kB <= kBlockMaxCols && (kB & (kB - 1)) == 0, "b in {16, 32, 64, 128}");
  static constexpr int kRows = tc_sddmm_stage_rows(kB);  // rows per stage (launch_plan.h)
  static constexpr int kLogRows = ilog2(kRows);
  static constexpr int kSteps = kRows / 16;         // m16n16k16 steps per stage
  // Padding: as TcPanel, 8 elements per row make the row stride an odd number of 16-byte units.
  static constexpr int kLd = kB + kTcPad;
  static constexpr int kBlockElems = kRows * kLd;   // one block of one stage
  static constexpr int kLogRowChunks = ilog2(kB / 8);  // 16-byte chunks per block row
  static constexpr int kLogBlockChunks = kLogRows + kLogRowChunks;
  // At most kPer chunks per thread and stage (a fourth spills at b = 64); the plan counts the
  // blocks a stage holds with the same rule (launch_plan.h).
  static constexpr int kPer = kTcSddmmChunks;
  static constexpr int kMaxBlocks = static_cast<int>(tc_sddmm_max_blocks(kB));
  static_assert(kMaxBlocks * kBlockElems * 2 <= kBlockSddmmStageBytes &&
                    kMaxBlocks << kLogBlockChunks <= kPer * kBlockThreads,
                "the plan's block count fits the stage's bytes and chunks");
  static constexpr int kLogTileFrags = 2 * ilog2(kB / 16);  // 16x16 fragments per b x b tile
  static_assert(kMaxBlocks >= 2 && kMaxBlocks * kBlockElems < 65536, "a stage holds 2 blocks, 16-bit offsets");
};

// The operand of table entry q (long blocks first): dy holds the output features.
template <class T>
__device__ __forceinline__ bool sddmm_reads_dy(const BlockSddmmArgs<T>& a, int q, int n_long) {
  return (q < n_long) == (a.tall != 0);
}

template <class T, int kB>
__global__ void __launch_bounds__(kBlockThreads, 2) block_sddmm_tc_kernel(BlockSddmmArgs<T> a) {
  namespace wmma = nvcuda::wmma;
  using S = TcSddmm<kB>;
  static_assert(kBlockWarps * 256 * 4 <= kTcStages * S::kMaxBlocks * S::kBlockElems * int(sizeof(T)),
                "the epilogue tiles fit in the stages");
  SIMT_SHARED_ALIGNED(T[kTcStages][S::kMaxBlocks * S::kBlockElems], buf, 32);
  SIMT_SHARED(int32_t[S::kMaxBlocks], col_t);
  Tally tally;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const SddmmTile s = sddmm_tile(a);
  const int n_blocks = s.n_long > 0 ? s.n_long + s.n_diags : 0;  // no long block: no tiles
  if (tid == 0) tally.cta();
  if (tid < n_blocks) {
    int col = -1;
    if (tid < s.n_long) {
      col = (s.r + (s.chunk * a.per_cta + tid) * a.P_b) * kB;
    } else {
      const int d = a.offsets[s.g * a.diags + tid - s.n_long];
      tally.load(4);
      if (valid_offset(d, a.P_b)) col = (s.r + d < a.P_b ? s.r + d : s.r + d - a.P_b) * kB;
    }
    col_t[tid] = col;
  }
  __syncthreads();

  // This thread's chunks e of every stage: source (advanced by a stage per issue), destination,
  // row within the stage; `live` is false past the table and for out-of-range diagonals.
  const T* src[S::kPer];
  int dst[S::kPer], row_e[S::kPer];
  bool live[S::kPer], from_dy[S::kPer];
#pragma unroll
  for (int e = 0; e < S::kPer; ++e) {
    const int c = tid + e * kBlockThreads, q = c >> S::kLogBlockChunks;
    const int rem = c & ((1 << S::kLogBlockChunks) - 1), ch = rem & ((1 << S::kLogRowChunks) - 1);
    row_e[e] = rem >> S::kLogRowChunks;
    const int col = q < n_blocks ? int(col_t[q]) : -1;
    live[e] = col >= 0;
    from_dy[e] = sddmm_reads_dy(a, q, s.n_long);
    const int64_t width = from_dy[e] ? a.out_f : a.in_f;
    src[e] = (from_dy[e] ? a.dy : a.x) + (s.row0 + row_e[e]) * width + (live[e] ? col : 0) + ch * 8;
    dst[e] = q * S::kBlockElems + row_e[e] * S::kLd + ch * 8;
  }
  const int64_t dy_step = int64_t(S::kRows) * a.out_f, x_step = int64_t(S::kRows) * a.in_f;

  // This warp's fragments f = warp + 8 m: shared offsets of their dy (A) and x (B) columns in a
  // stage, packed as A | B << 16; -1 for none (past the tiles, or an out-of-range diagonal).
  const int n_frags = s.n_long * s.n_diags << S::kLogTileFrags;
  int desc[kBlockSddmmMaxFrags];
#pragma unroll
  for (int m = 0; m < kBlockSddmmMaxFrags; ++m) {
    const int f = warp + m * kBlockWarps, tile = f >> S::kLogTileFrags;
    const int io = (f >> (S::kLogTileFrags / 2)) & (kB / 16 - 1), jo = f & (kB / 16 - 1);
    const int jd = s.n_long > 0 ? tile / s.n_long : 0, w = tile - jd * s.n_long;  // before the loop
    desc[m] = -1;
    if (f < n_frags && col_t[s.n_long + jd] >= 0) {
      const int long_at = w * S::kBlockElems, short_at = (s.n_long + jd) * S::kBlockElems;
      const int dy_at = a.tall ? long_at : short_at, x_at = a.tall ? short_at : long_at;
      desc[m] = (dy_at + io * 16) | (x_at + jo * 16) << 16;
    }
  }

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kBlockSddmmMaxFrags];
#pragma unroll
  for (int m = 0; m < kBlockSddmmMaxFrags; ++m) wmma::fill_fragment(acc[m], 0.0f);

  // Stage rows at or past `left` lie beyond the split: zeros instead of a copy.
  auto issue = [&](int b, int64_t left) {
#pragma unroll
    for (int e = 0; e < S::kPer; ++e) {
      if (!live[e]) continue;
      if (row_e[e] < left) {
        simt::copy_async16(&buf[b][dst[e]], src[e]);
        tally.load(16);
      } else {
        *simt::pointer_cast<uint4>(&buf[b][dst[e]]) = uint4{0u, 0u, 0u, 0u};
      }
      src[e] += from_dy[e] ? dy_step : x_step;
    }
  };

  const int64_t n_rows = s.row1 - s.row0;
  const int n_stages = static_cast<int>((n_rows + S::kRows - 1) >> S::kLogRows);
  // As in the product: stages 0 .. kTcStages - 2 first, then one group per trip.
#pragma unroll
  for (int j = 0; j < kTcStages - 1; ++j) {
    if (j < n_stages) issue(j, n_rows - (int64_t(j) << S::kLogRows));
    simt::copy_async_commit();
  }
  int cur = 0;  // buffer of stage st; stage st + kTcStages - 1 goes to the one before it
  for (int st = 0; st < n_stages; ++st) {
    simt::copy_async_wait_prior<kTcStages - 2>();
    __syncthreads();  // stage st has landed, and every warp is done with stage st - 1's buffer
    const int ahead = st + kTcStages - 1;
    if (ahead < n_stages) issue(cur == 0 ? kTcStages - 1 : cur - 1, n_rows - (int64_t(ahead) << S::kLogRows));
    simt::copy_async_commit();
#pragma unroll
    for (int ks = 0; ks < S::kSteps; ++ks) {
#pragma unroll
      for (int m = 0; m < kBlockSddmmMaxFrags; ++m) {
        if (desc[m] < 0) continue;
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
        simt::load_shared(fa, &buf[cur][(desc[m] & 0xffff) + ks * 16 * S::kLd], S::kLd);
        simt::load_shared(fb, &buf[cur][(desc[m] >> 16) + ks * 16 * S::kLd], S::kLd);
        wmma::mma_sync(acc[m], fa, fb, acc[m]);
        if (lane == 0) tally.mma(1);
      }
    }
    cur = cur == kTcStages - 1 ? 0 : cur + 1;
  }
  simt::copy_async_wait();  // the trailing groups are empty; nothing may land in the tiles below
  __syncthreads();          // every warp is done with the stages the epilogue tiles reuse
  const auto cs = simt::pointer_cast<float>(&buf[0][0]) + warp * 256;

  // Tile (io, jo) of result block (jd, w): dvalues[k, t][16 io + i][16 jo + j].
  const int64_t n_out = int64_t(a.K) * a.L_b * kB * kB;
#pragma unroll
  for (int m = 0; m < kBlockSddmmMaxFrags; ++m) {
    const int f = warp + m * kBlockWarps, tile = f >> S::kLogTileFrags;
    if (f >= n_frags) continue;
    wmma::store_matrix_sync(cs, acc[m], 16, wmma::mem_row_major);
    __syncwarp();
    const int io = (f >> (S::kLogTileFrags / 2)) & (kB / 16 - 1), jo = f & (kB / 16 - 1);
    const int jd = tile / s.n_long, w = tile - jd * s.n_long;
    const int k = s.g * a.diags + jd;
    const int64_t t = s.r + int64_t(s.chunk * a.per_cta + w) * a.P_b;
    const bool bad = col_t[s.n_long + jd] < 0;
    const int64_t at = ((int64_t(k) * a.L_b + t) * kB + io * 16) * kB + jo * 16;
    if (a.splits == 1) {  // row lane / 2, columns 8 (lane % 2)..: 8 outputs of T
      const int er = lane >> 1, eh = (lane & 1) * 8;
      float4 lo = *simt::pointer_cast<float4>(cs + er * 16 + eh);
      float4 hi = *simt::pointer_cast<float4>(cs + er * 16 + eh + 4);
      if (bad) lo = hi = float4{quiet_nan(), quiet_nan(), quiet_nan(), quiet_nan()};
      const uint4 v{pack2<T>(lo.x, lo.y), pack2<T>(lo.z, lo.w), pack2<T>(hi.x, hi.y), pack2<T>(hi.z, hi.w)};
      simt::store(simt::pointer_cast<uint4>(&a.out[at + er * kB + eh]), v);
      tally.store(16);
    } else {  // rows lane / 4 and 8 + lane / 4, columns 4 (lane % 4)..: 4 float32 partial sums
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int er = (lane >> 2) + h * 8, ec = (lane & 3) * 4;
        float4 v = *simt::pointer_cast<float4>(cs + er * 16 + ec);
        if (bad) v = float4{quiet_nan(), quiet_nan(), quiet_nan(), quiet_nan()};
        simt::store(simt::pointer_cast<float4>(&a.partial[s.z * n_out + at + er * kB + ec]), v);
        tally.store(16);
      }
    }
    __syncwarp();  // this warp's tile is overwritten by the next one
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
