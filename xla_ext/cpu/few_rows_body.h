// The few-row kernels (a handful of batch rows: online inference), included by every
// kernels_*.cc inside its anonymous namespace after block_kernels_body.h and instantiated over an
// 8-lane vector type V (Ymm, or the portable Lanes<8>), which adds to the body's operations
// Load(const Bf16*) (widened), Add(a, b) and SumLanes(acc) (lane i = the sum of the lanes of
// acc[i], for 8 registers). They read `values` in place, one diagonal or block at a time, so a
// call costs one pass over the kept values and nothing that grows with W (no plan, no packing):
// at a few rows that pass is the whole of the work. No include guard and no includes (as
// block_kernels_body.h).

// dst[r, j] += v[j] * src[r, j] for r < rows, j < n (rows `src_stride` and `dst_stride` apart):
// one straight run of a diagonal for every row. bfloat16 values are widened once per piece of 64
// and stay in L1 while the rows pass.
template <typename T>
DYNADIAG_TARGET void FewTriad(const T* __restrict v, const float* __restrict src,
                              int64_t src_stride, float* __restrict dst, int64_t dst_stride,
                              int64_t rows, int64_t n) {
  constexpr int64_t kPiece = 64;
  alignas(64) float widened[kPiece];
  for (int64_t j0 = 0; j0 < n; j0 += kPiece) {
    const int64_t m = std::min(kPiece, n - j0);
    const float* __restrict w;
    if constexpr (std::is_same_v<T, float>) {
      w = v + j0;
    } else {
      for (int64_t j = 0; j < m; ++j) widened[j] = ToFloat(v[j0 + j]);
      w = widened;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* __restrict s = src + r * src_stride + j0;
      float* __restrict d = dst + r * dst_stride + j0;
      for (int64_t j = 0; j < m; ++j) d[j] += w[j] * s[j];
    }
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

template <class V, typename T>
constexpr FewRowTable<T> kFewRowTable{FewTriad<T>, FewRowDot<V>,
                                      FewBlockDispatch<V, T, FewBlockFwd>,
                                      FewBlockDispatch<V, T, FewBlockDx>};
