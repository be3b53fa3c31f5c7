#include "diag_kernels.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace dynadiag {
namespace {

float Load(const void* p, int64_t i, ElemType type) {
  if (type == ElemType::kF32) return static_cast<const float*>(p)[i];
  uint32_t bits = uint32_t{static_cast<const uint16_t*>(p)[i]} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float32 -> bfloat16 with round-to-nearest-even (NaN stays NaN), as XLA converts.
uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

void Store(void* p, int64_t i, float v, ElemType type) {
  if (type == ElemType::kF32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = ToBf16(v);
  }
}

// One diagonal in "fixed/moving" form: entry t pairs fixed index t (width D) with moving index
// (t + d) % P (width P); values[k, t] always follows the fixed index.
// out[r, o] = sum over entries of in[r, i] * values[k, t], with (o, i) = (moving, fixed) when
// moving_on_output, else (fixed, moving).
void DiagProduct(ElemType type, int64_t rows, const DiagMatrix& w, bool moving_on_output,
                 const void* in, int64_t in_width, void* out, int64_t out_width) {
  const int64_t p = std::max(w.in, w.out), len = std::min(w.in, w.out);
  std::vector<float> acc(out_width);
  for (int64_t r = 0; r < rows; ++r) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < w.k; ++k) {
      const int64_t d = w.offsets[k];
      for (int64_t t = 0; t < len; ++t) {
        const int64_t m = (t + d) % p;
        const int64_t o = moving_on_output ? m : t, i = moving_on_output ? t : m;
        acc[o] += Load(in, r * in_width + i, type) * Load(w.values, k * len + t, type);
      }
    }
    for (int64_t o = 0; o < out_width; ++o) Store(out, r * out_width + o, acc[o], type);
  }
}

}  // namespace

void DiagMatmulFwd(const FwdArgs& a) {
  // Tall W moves along the output rows; wide W along the input columns.
  DiagProduct(a.type, a.rows, a.w, a.w.out >= a.w.in, a.x, a.w.in, a.y, a.w.out);
}

void DiagMatmulDx(const DxArgs& a) {
  // dx = dy @ W: the roles of in and out swap, so the moving side swaps too (transpose closure).
  DiagProduct(a.type, a.rows, a.w, a.w.out < a.w.in, a.dy, a.w.out, a.dx, a.w.in);
}

void DiagMatmulDvalues(const DvaluesArgs& a) {
  const int64_t p = std::max(a.w.in, a.w.out), len = std::min(a.w.in, a.w.out);
  const bool tall = a.w.out >= a.w.in;
  for (int64_t k = 0; k < a.w.k; ++k) {
    const int64_t d = a.w.offsets[k];
    for (int64_t t = 0; t < len; ++t) {
      const int64_t m = (t + d) % p;
      const int64_t row = tall ? m : t, col = tall ? t : m;
      float s = 0.0f;
      for (int64_t r = 0; r < a.rows; ++r) {
        s += Load(a.dy, r * a.w.out + row, a.type) * Load(a.x, r * a.w.in + col, a.type);
      }
      Store(a.dvalues, k * len + t, s, a.type);
    }
  }
}

}  // namespace dynadiag
