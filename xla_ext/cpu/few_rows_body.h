// The few-row kernels (a handful of batch rows: online inference), included by every
// kernels_*.cc inside its anonymous namespace after block_kernels_body.h and instantiated over an
// 8-lane vector type V (Ymm, or the portable Lanes<8>), which adds to the body's operations
// Load(const Bf16*) (widened), Add(a, b) and SumLanes(acc) (lane i = the sum of the lanes of
// acc[i], for 8 registers). They read `values` in place, a diagonal or block (or, for the
// element product of several rows, a group of diagonals) at a time, so a call costs one pass over
// the kept values and nothing that grows with W (no plan, no packing): at a few rows that pass is
// the whole of the work. No include guard and no includes (as
// block_kernels_body.h).

// dst[j] += v[j] * src[j] for j < n: one straight run of a diagonal, for a single row. One row
// streams the diagonals one after the other: the output-stationary loop below keeps a dozen
// streams of values open at a time, which costs more than it saves where a value feeds one FMA.
// bfloat16 values are widened a piece of 64 at a time.
template <typename T>
DYNADIAG_TARGET void FewTriad(const T* __restrict v, const float* __restrict src,
                              float* __restrict dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < n; ++j) dst[j] += v[j] * src[j];
  } else {
    constexpr int64_t kPiece = 64;
    alignas(64) float widened[kPiece];
    for (int64_t j0 = 0; j0 < n; j0 += kPiece) {
      const int64_t m = std::min(kPiece, n - j0);
      for (int64_t j = 0; j < m; ++j) widened[j] = ToFloat(v[j0 + j]);
      for (int64_t j = 0; j < m; ++j) dst[j0 + j] += widened[j] * src[j0 + j];
    }
  }
}

// Output columns [o, o + n) of diagonal k, for every row: out[r, l] += v[k, j] * src[r, s] for
// the columns l whose diagonal entry (value index j, source column s) exists, one at a time. The
// vector loop below takes the windows that wrap or cross the end of the diagonal here.
template <typename T>
DYNADIAG_TARGET void FewLanes(const FewElements<T>& e, int64_t k, const float* src,
                              int64_t src_stride, float* out, int64_t out_stride, int64_t rows,
                              int64_t o, int64_t n) {
  const int64_t d = e.offsets[k];
  const T* v = e.values + k * e.len;
  for (int64_t l = 0; l < n; ++l) {
    int64_t j, s;
    if (e.long_dst) {
      j = o + l - d;
      if (j < 0) j += e.p;
      if (j >= e.len) continue;
      s = j;
    } else {
      j = o + l;
      s = j + d;
      if (s >= e.p) s -= e.p;
    }
    const float w = ToFloat(v[j]);
    for (int64_t r = 0; r < rows; ++r) out[r * out_stride + l] += w * src[r * src_stride + s];
  }
}

// A straight piece of diagonal k in output columns [a, b): column o reads values[k, o + vdelta]
// and src[o + sdelta]. A diagonal has one piece, or two where it wraps.
struct FewSpan {
  int64_t k, a, b, vdelta, sdelta;
};

inline int Ctz(uint64_t m) { return __builtin_ctzll(m); }

template <typename T>
int FewSpans(const FewElements<T>& e, int64_t k, FewSpan* spans) {
  const int64_t d = e.offsets[k];
  if (e.long_dst) {  // column o holds j = (o - d) mod p where that is below len
    if (d + e.len <= e.p) {
      spans[0] = {k, d, d + e.len, -d, -d};
      return 1;
    }
    spans[0] = {k, 0, d + e.len - e.p, e.p - d, e.p - d};
    spans[1] = {k, d, e.p, -d, -d};
    return 2;
  }
  const int64_t split = std::min(e.len, e.p - d);  // column j reads src[(j + d) mod p]
  spans[0] = {k, 0, split, 0, d};
  if (split == e.len) return 1;
  spans[1] = {k, split, e.len, 0, d - e.p};
  return 2;
}

// R rows of the 16 output columns from o: the spans in `active` (each covers the columns) and the
// diagonals in `edges` (FewLanes, through a side buffer).
template <class V, int R, typename T>
DYNADIAG_TARGET void FewTile(const FewElements<T>& e, const float* src, int64_t src_stride,
                             float* dst, int64_t dst_stride, int64_t o,
                             const FewSpan* const* active, int num_active, const int64_t* edges,
                             int num_edges) {
  using Reg = typename V::Reg;
  constexpr int64_t kTile = 2 * V::kWidth, kPrefetchTiles = 4;
  Reg acc[R][2];
  DYNADIAG_UNROLL
  for (int r = 0; r < R; ++r) {
    acc[r][0] = V::Load(dst + r * dst_stride + o);
    acc[r][1] = V::Load(dst + r * dst_stride + o + V::kWidth);
  }
  for (int i = 0; i < num_active; ++i) {
    const FewSpan& sp = *active[i];
    const T* v = e.values + sp.k * e.len + o + sp.vdelta;
    const float* x = src + o + sp.sdelta;
    // A tile reads one line of each of a group's dozens of value streams, more than the hardware
    // prefetchers follow: ask for the lines kPrefetchTiles tiles ahead (past the end is harmless).
    __builtin_prefetch(v + kPrefetchTiles * kTile);
    const Reg v0 = V::Load(v), v1 = V::Load(v + V::kWidth);
    DYNADIAG_UNROLL
    for (int r = 0; r < R; ++r) {
      acc[r][0] = V::Fma(v0, V::Load(x + r * src_stride), acc[r][0]);
      acc[r][1] = V::Fma(v1, V::Load(x + r * src_stride + V::kWidth), acc[r][1]);
    }
  }
  if (num_edges > 0) {
    alignas(64) float edge_sums[R][kTile];
    std::fill(&edge_sums[0][0], &edge_sums[0][0] + R * kTile, 0.0f);
    for (int i = 0; i < num_edges; ++i) {
      FewLanes(e, edges[i], src, src_stride, &edge_sums[0][0], kTile, R, o, kTile);
    }
    DYNADIAG_UNROLL
    for (int r = 0; r < R; ++r) {
      acc[r][0] = V::Add(acc[r][0], V::Load(edge_sums[r]));
      acc[r][1] = V::Add(acc[r][1], V::Load(edge_sums[r] + V::kWidth));
    }
  }
  DYNADIAG_UNROLL
  for (int r = 0; r < R; ++r) {
    V::Store(dst + r * dst_stride + o, acc[r][0]);
    V::Store(dst + r * dst_stride + o + V::kWidth, acc[r][1]);
  }
}

// dst[r, o] += the element product of R rows over dst columns [lo, hi) (lo a multiple of 16, hi a
// multiple of 16 or the row's end). Output-stationary: 16 columns of every row stay in registers
// while a group of diagonals passes, so an FMA costs one load of `src`, 1/R of a load of the
// values and a share of one load and store of dst; the group's values are G streams, which the
// prefetchers follow, and the columns of a chunk (all R rows) stay in L1 across the groups. A
// group's diagonals are cut into spans; per tile, a bit mask holds the spans that cover it whole
// (summed in the order of k, so a tile's sums do not depend on where a task starts) and one the
// diagonals that start, end or wrap inside it (FewLanes, through a side buffer).
template <class V, int R, typename T>
DYNADIAG_TARGET void FewElementRows(const FewElements<T>& e, const float* src, int64_t src_stride,
                                    float* dst, int64_t dst_stride, int64_t lo, int64_t hi) {
  constexpr int64_t kTile = 2 * V::kWidth, kMaxGroup = 32;
  constexpr int64_t kChunk = std::max<int64_t>(kTile, 4096 / R / kTile * kTile);
  constexpr int64_t kChunkTiles = kChunk / kTile;
  // A diagonal covers len / p of the long side: larger groups there keep about 8 of them on a tile.
  const int64_t group =
      e.long_dst ? std::min(kMaxGroup, 8 * ((e.p + e.len - 1) / e.len)) : int64_t{8};
  FewSpan spans[2 * kMaxGroup];
  const FewSpan* active[2 * kMaxGroup];
  int64_t edges[kMaxGroup];
  uint64_t flips[kChunkTiles + 1];  // spans starting or stopping to cover whole tiles at a tile
  uint32_t crossed[kChunkTiles];    // diagonals (bit k - k0) crossing a tile
  for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {
    const int64_t c1 = std::min(hi, c0 + kChunk);
    const int64_t t0 = c0 / kTile, t1 = c1 / kTile;  // whole tiles; the ragged end after
    for (int64_t k0 = 0; k0 < e.k; k0 += group) {
      const int64_t k1 = std::min(e.k, k0 + group);
      std::fill(flips, flips + (t1 - t0 + 1), uint64_t{0});
      std::fill(crossed, crossed + (t1 - t0), uint32_t{0});
      int num_spans = 0;
      for (int64_t k = k0; k < k1; ++k) {
        const int n = FewSpans(e, k, spans + num_spans);
        for (int i = num_spans; i < num_spans + n; ++i) {
          const int64_t ta = std::max(t0, (spans[i].a + kTile - 1) / kTile);
          const int64_t tb = std::min(t1, spans[i].b / kTile);
          if (ta < tb) {
            flips[ta - t0] ^= uint64_t{1} << i;
            flips[tb - t0] ^= uint64_t{1} << i;
          }
          for (const int64_t end : {spans[i].a, spans[i].b}) {
            const int64_t t = end / kTile;
            if (end % kTile != 0 && t >= t0 && t < t1) crossed[t - t0] |= 1u << (k - k0);
          }
        }
        num_spans += n;
      }
      uint64_t covering = 0;
      int num_active = 0;
      for (int64_t t = t0; t < t1; ++t) {
        if (flips[t - t0] != 0) {
          covering ^= flips[t - t0];
          num_active = 0;
          for (uint64_t m = covering; m != 0; m &= m - 1) active[num_active++] = &spans[Ctz(m)];
        }
        int num_edges = 0;
        for (uint32_t m = crossed[t - t0]; m != 0; m &= m - 1) edges[num_edges++] = k0 + Ctz(m);
        if (num_active + num_edges > 0) {
          FewTile<V, R>(e, src, src_stride, dst, dst_stride, t * kTile, active, num_active, edges,
                        num_edges);
        }
      }
      if (t1 * kTile < c1) {  // the ragged end of the row: no full vector fits in dst
        const int64_t o = t1 * kTile;
        for (int64_t k = k0; k < k1; ++k) {
          FewLanes(e, k, src, src_stride, dst + o, dst_stride, R, o, c1 - o);
        }
      }
    }
  }
}

// FewElementRows for n <= R rows (n fixed at compile time there).
template <class V, int R, typename T>
DYNADIAG_TARGET void FewElementRowsUpTo(int64_t n, const FewElements<T>& e, const float* src,
                                        int64_t src_stride, float* dst, int64_t dst_stride,
                                        int64_t lo, int64_t hi) {
  if constexpr (R > 1) {
    if (n < R) return FewElementRowsUpTo<V, R - 1>(n, e, src, src_stride, dst, dst_stride, lo, hi);
  }
  FewElementRows<V, R>(e, src, src_stride, dst, dst_stride, lo, hi);
}

// The element product of any number of rows: groups of as many rows as the registers hold
// accumulators for (4 with 16 registers, 8 with 32), each one pass over the values.
template <class V, typename T>
DYNADIAG_TARGET void FewElementProduct(const FewElements<T>& e, const float* src,
                                       int64_t src_stride, float* dst, int64_t dst_stride,
                                       int64_t rows, int64_t lo, int64_t hi) {
  constexpr int kMaxRows = V::kRegisters >= 32 ? 8 : 4;
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    FewElementRowsUpTo<V, kMaxRows>(std::min<int64_t>(kMaxRows, rows - r0), e,
                                    src + r0 * src_stride, src_stride, dst + r0 * dst_stride,
                                    dst_stride, lo, hi);
  }
}

// dst[j] += sum_r a[r, j] * b[r, j] for j < n: one straight run of a diagonal's dvalues, four
// registers of sums kept over the rows.
template <class V>
DYNADIAG_TARGET void FewRowDot(const float* a, int64_t a_stride, const float* b,
                               int64_t b_stride, float* dst, int64_t rows, int64_t n) {
  using Reg = typename V::Reg;
  constexpr int kRegs = 4;
  int64_t j = 0;
  for (; j + 8 * kRegs <= n; j += 8 * kRegs) {
    Reg acc[kRegs];
    DYNADIAG_UNROLL
    for (int c = 0; c < kRegs; ++c) acc[c] = V::Load(dst + j + 8 * c);
    for (int64_t r = 0; r < rows; ++r) {
      DYNADIAG_UNROLL
      for (int c = 0; c < kRegs; ++c) {
        const float* ar = a + r * a_stride + j + 8 * c;
        acc[c] = V::Fma(V::Load(ar), V::Load(b + r * b_stride + j + 8 * c), acc[c]);
      }
    }
    DYNADIAG_UNROLL
    for (int c = 0; c < kRegs; ++c) V::Store(dst + j + 8 * c, acc[c]);
  }
  for (; j < n; ++j) {
    float sum = dst[j];
    for (int64_t r = 0; r < rows; ++r) sum += a[r * a_stride + j] * b[r * b_stride + j];
    dst[j] = sum;
  }
}

// y[r, i] += sum_j v[i, j] x[r, j] for one B x B block: eight output rows i at a time, each
// summed along j in one register, then the eight sums transposed into one register (SumLanes).
template <class V, int B, typename T>
struct FewBlockFwd {
  DYNADIAG_TARGET static void Run(const T* v, const float* x, int64_t x_stride, float* y,
                                  int64_t y_stride, int64_t rows);
};

template <class V, int B, typename T>
DYNADIAG_TARGET void FewBlockFwd<V, B, T>::Run(const T* v, const float* x, int64_t x_stride,
                                               float* y, int64_t y_stride, int64_t rows) {
  using Reg = typename V::Reg;
  for (int64_t r = 0; r < rows; ++r, x += x_stride, y += y_stride) {
    for (int i0 = 0; i0 < B; i0 += 8) {
      Reg acc[8];
      DYNADIAG_UNROLL
      for (int i = 0; i < 8; ++i) {
        acc[i] = V::Zero();
        DYNADIAG_UNROLL
        for (int j = 0; j < B; j += 8) {
          acc[i] = V::Fma(V::Load(v + (i0 + i) * B + j), V::Load(x + j), acc[i]);
        }
      }
      V::Store(y + i0, V::Add(V::Load(y + i0), V::SumLanes(acc)));
    }
  }
}

// dx[r, j] += sum_i dy[r, i] v[i, j] for one B x B block: up to 64 columns of dx in registers
// while the block's rows pass.
template <class V, int B, typename T>
struct FewBlockDx {
  DYNADIAG_TARGET static void Run(const T* v, const float* dy, int64_t dy_stride, float* dx,
                                  int64_t dx_stride, int64_t rows);
};

template <class V, int B, typename T>
DYNADIAG_TARGET void FewBlockDx<V, B, T>::Run(const T* v, const float* dy, int64_t dy_stride,
                                              float* dx, int64_t dx_stride, int64_t rows) {
  using Reg = typename V::Reg;
  constexpr int kCols = std::min(B, 64);
  for (int64_t r = 0; r < rows; ++r, dy += dy_stride, dx += dx_stride) {
    for (int c0 = 0; c0 < B; c0 += kCols) {
      Reg acc[kCols / 8];
      DYNADIAG_UNROLL
      for (int c = 0; c < kCols / 8; ++c) acc[c] = V::Load(dx + c0 + 8 * c);
      for (int i = 0; i < B; ++i) {
        const Reg a = V::Broadcast(dy + i);
        DYNADIAG_UNROLL
        for (int c = 0; c < kCols / 8; ++c) {
          acc[c] = V::Fma(a, V::Load(v + i * B + c0 + 8 * c), acc[c]);
        }
      }
      DYNADIAG_UNROLL
      for (int c = 0; c < kCols / 8; ++c) V::Store(dx + c0 + 8 * c, acc[c]);
    }
  }
}

// The kernel of block size b (one of the kernel block sizes, 8 to 128).
template <class V, typename T, template <class, int, typename> class Kernel>
DYNADIAG_TARGET void FewBlockDispatch(const T* v, int64_t b, const float* in, int64_t in_stride,
                                      float* out, int64_t out_stride, int64_t rows) {
  switch (b) {
    case 8:
      return Kernel<V, 8, T>::Run(v, in, in_stride, out, out_stride, rows);
    case 16:
      return Kernel<V, 16, T>::Run(v, in, in_stride, out, out_stride, rows);
    case 32:
      return Kernel<V, 32, T>::Run(v, in, in_stride, out, out_stride, rows);
    case 64:
      return Kernel<V, 64, T>::Run(v, in, in_stride, out, out_stride, rows);
    default:
      return Kernel<V, 128, T>::Run(v, in, in_stride, out, out_stride, rows);
  }
}

// The family's block entries: block_kernels_body.h's over B, the few-row block loops over V.
template <class B, class V>
BlockKernels BlockKernelsOf() {
  return {kBlockTableF32<B>,
          kBlockTableBf16<B>,
          BlockSddmm<B>,
          {FewBlockDispatch<V, float, FewBlockFwd>, FewBlockDispatch<V, float, FewBlockDx>},
          {FewBlockDispatch<V, Bf16, FewBlockFwd>, FewBlockDispatch<V, Bf16, FewBlockDx>}};
}
