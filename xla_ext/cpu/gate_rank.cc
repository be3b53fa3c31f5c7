// The CPU target dynadiag_gate_rank_v1 (docs/kernel_abi.md, "Gate ranking"): everything a
// search-phase layer needs from its scores alone, in one call per layer.
//
// Per row of alpha[R, P]: the diagonals by descending score (order, and its inverse rank), the
// top-K offsets ascending, how many of them are new against the previous top-K, and for the sparse
// gate the non-differentiable part of its projection (kth, tau, share). The pure-JAX reference is
// dynadiag_jax/ops/ranking.py: reference(); tests/test_ranking.py compares the two.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ffi_handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace dynadiag {
namespace {

constexpr const char* kTarget = "dynadiag_gate_rank_v1";

ffi::Error Invalid(const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(kTarget) + ": " + message);
}

// f(t) = sum_i clip(z_i - t, 0, 1), accumulated in T as the reference does.
template <typename T>
T CappedSum(const std::vector<T>& z, T t) {
  T f = 0;
  for (T zi : z) f += std::min<T>(std::max<T>(zi - t, 0), 1);
  return f;
}

// An unsigned integer whose ascending order is the descending order of `v` (never NaN; -0 is
// taken as +0, which compares equal to it).
template <typename T>
auto DescendingKey(T v) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  constexpr U kSign = U{1} << (8 * sizeof(T) - 1);
  U u;
  const T w = v == 0 ? T(0) : v;
  std::memcpy(&u, &w, sizeof(T));
  const U ascending = (u & kSign) ? ~u : (u | kSign);
  return static_cast<U>(~ascending);
}

// One row; see the reference for the definitions.
//
// Two sorts set the cost of a row (a search step ranks every sparse layer): the order is one
// sort of (key, index) pairs, which is the stable sort by descending score without an indirect
// comparison; and the projection's breakpoints {z_i - 1} and {z_i} need no sort of their own,
// since z is non-decreasing in alpha: both halves come sorted from the order, and one merge joins
// them.
template <typename T>
void RankRow(const T* alpha, T hyper, const int32_t* old_topk, int64_t p, int64_t k, bool sparse,
             int32_t* order, int32_t* rank, int32_t* topk, float* changed, T* kth, T* tau,
             T* share) {
  using Key = decltype(DescendingKey(T(0)));
  std::vector<std::pair<Key, int32_t>> keyed(p);
  for (int64_t i = 0; i < p; ++i) {
    const T key = std::isnan(alpha[i]) ? -std::numeric_limits<T>::infinity() : alpha[i];
    keyed[i] = {DescendingKey(key), static_cast<int32_t>(i)};
  }
  std::sort(keyed.begin(), keyed.end());
  for (int64_t j = 0; j < p; ++j) order[j] = keyed[j].second;
  for (int64_t j = 0; j < p; ++j) rank[order[j]] = static_cast<int32_t>(j);
  std::copy(order, order + k, topk);
  std::sort(topk, topk + k);
  int64_t kept = 0;
  for (int64_t j = 0; j < k; ++j) {
    const int32_t o = old_topk[j];
    kept += (o >= 0 && o < p && rank[o] < k) ? 1 : 0;
  }
  *changed = static_cast<float>(k - kept);
  *kth = 0;
  *tau = 0;
  *share = 0;
  if (!sparse) return;

  const T kk = static_cast<T>(k);
  const T kth_value = alpha[order[k - 1]];
  int64_t above = 0, tied = 0;
  for (int64_t i = 0; i < p; ++i) {
    above += alpha[i] > kth_value ? 1 : 0;
    tied += alpha[i] == kth_value ? 1 : 0;
  }
  *kth = kth_value;
  *share = (kk - static_cast<T>(above)) / static_cast<T>(std::max<int64_t>(tied, 1));
  if (k == p) return;  // the gate is 1 everywhere

  // !(hyper > 0) also catches NaN: the soft branch then runs with 1 (its value is not used).
  const T safe = hyper > 0 ? hyper : T(1);
  std::vector<T> z(p), ascending, breaks(2 * p);
  ascending.reserve(p);
  for (int64_t i = 0; i < p; ++i) {
    z[i] = std::min<T>(std::max<T>((alpha[i] - kth_value) / safe, -2), 2);
  }
  // z ascending is the order reversed; a NaN score gives a NaN z, which sorts last, as in XLA.
  int64_t nans = 0;
  for (int64_t j = p - 1; j >= 0; --j) {
    const T zj = z[order[j]];
    if (std::isnan(zj)) {
      ++nans;
    } else {
      ascending.push_back(zj);
    }
  }
  const int64_t n = static_cast<int64_t>(ascending.size());
  int64_t a = 0, c = 0, out = 0;
  while (a < n || c < n) {  // merge {z - 1} (index a) and {z} (index c), both ascending
    if (c == n || (a < n && ascending[a] - 1 <= ascending[c])) {
      breaks[out++] = ascending[a++] - 1;
    } else {
      breaks[out++] = ascending[c++];
    }
  }
  std::fill(breaks.begin() + out, breaks.end(), std::numeric_limits<T>::quiet_NaN());
  // f(breaks[0]) = p >= k > 0 = f(breaks[2p - 1]); keep f(breaks[lo]) >= k > f(breaks[hi]).
  int64_t lo = 0, hi = 2 * p - 1;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (CappedSum(z, breaks[mid]) >= kk ? lo : hi) = mid;
  }
  const T b_lo = breaks[lo], b_hi = breaks[hi];
  int64_t n_free = 0, n_ones = 0;
  T sum_free = 0;
  for (int64_t i = 0; i < p; ++i) {
    const bool one = z[i] - 1 >= b_hi;
    const bool free = z[i] >= b_hi && !one;
    n_ones += one ? 1 : 0;
    n_free += free ? 1 : 0;
    sum_free += free ? z[i] : T(0);
  }
  *tau = n_free > 0 ? (sum_free + static_cast<T>(n_ones) - kk) / static_cast<T>(n_free) : b_lo;
}

template <typename T>
void RankRows(ffi::AnyBuffer alpha, ffi::AnyBuffer hyper, const int32_t* old_topk, int64_t rows,
              int64_t p, int64_t k, bool sparse, int32_t* order, int32_t* rank, int32_t* topk,
              float* changed, T* kth, T* tau, T* share) {
  const T* a = alpha.typed_data<T>();
  const T* h = hyper.typed_data<T>();
  for (int64_t r = 0; r < rows; ++r) {
    RankRow<T>(a + r * p, h[r], old_topk + r * k, p, k, sparse, order + r * p, rank + r * p,
               topk + r * k, changed + r, kth + r, tau + r, share + r);
  }
}

const char* DtypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::S32: return "S32";
    case ffi::DataType::F32: return "F32";
    case ffi::DataType::F64: return "F64";
    default: return "another dtype";
  }
}

// `buffer` must have exactly the shape `want` (spelled `form`) and dtype `dtype`.
std::optional<ffi::Error> CheckBuffer(const char* name, const ffi::AnyBuffer& buffer,
                                      const char* form, std::vector<int64_t> want,
                                      ffi::DataType dtype) {
  const auto dims = buffer.dimensions();
  if (buffer.element_type() == dtype &&
      std::equal(dims.begin(), dims.end(), want.begin(), want.end())) {
    return std::nullopt;
  }
  return Invalid(std::string(name) + " must have shape " + form + " = " +
                 ShapeString(ffi::AnyBuffer::Dimensions(want.data(), want.size())) +
                 " and dtype " + DtypeName(dtype) + ", got " + ShapeString(dims) + " " +
                 DtypeName(buffer.element_type()));
}

ffi::Error GateRankImpl(ffi::AnyBuffer alpha, ffi::AnyBuffer hyper, ffi::AnyBuffer old_topk,
                        ffi::Result<ffi::AnyBuffer> order, ffi::Result<ffi::AnyBuffer> rank,
                        ffi::Result<ffi::AnyBuffer> topk, ffi::Result<ffi::AnyBuffer> changed,
                        ffi::Result<ffi::AnyBuffer> kth, ffi::Result<ffi::AnyBuffer> tau,
                        ffi::Result<ffi::AnyBuffer> share, bool sparse) {
  const auto dims = alpha.dimensions();
  // P counts a layer's candidate diagonals, max(in, out), and order and rank index them in S32.
  if (dims.size() != 2 || dims[1] < 1 || dims[1] >= (int64_t{1} << 31)) {
    return Invalid("alpha must have shape [R, P] with P in [1, 2^31), got " + ShapeString(dims));
  }
  const ffi::DataType dtype = alpha.element_type();
  if (dtype != ffi::DataType::F32 && dtype != ffi::DataType::F64) {
    return Invalid("alpha must be F32 or F64");
  }
  const int64_t rows = dims[0], p = dims[1];
  const auto old_dims = old_topk.dimensions();
  if (old_dims.size() != 2 || old_dims[0] != rows || old_dims[1] < 1 || old_dims[1] > p) {
    return Invalid("old_topk must have shape [R, K] with R = " + std::to_string(rows) +
                   " and 1 <= K <= P = " + std::to_string(p) + ", got " + ShapeString(old_dims));
  }
  const int64_t k = old_dims[1];
  for (const auto& [name, buffer, form, want, type] :
       {std::tuple{"old_topk", &old_topk, "[R, K]", std::vector<int64_t>{rows, k},
                   ffi::DataType::S32},
        {"hyper", &hyper, "[R]", {rows}, dtype},
        {"order", &*order, "[R, P]", {rows, p}, ffi::DataType::S32},
        {"rank", &*rank, "[R, P]", {rows, p}, ffi::DataType::S32},
        {"topk", &*topk, "[R, K]", {rows, k}, ffi::DataType::S32},
        {"changed", &*changed, "[R]", {rows}, ffi::DataType::F32},
        {"kth", &*kth, "[R]", {rows}, dtype},
        {"tau", &*tau, "[R]", {rows}, dtype},
        {"share", &*share, "[R]", {rows}, dtype}}) {
    if (auto error = CheckBuffer(name, *buffer, form, want, type)) return *error;
  }
  const int32_t* old = old_topk.typed_data<int32_t>();
  int32_t* o = order->typed_data<int32_t>();
  int32_t* r = rank->typed_data<int32_t>();
  int32_t* t = topk->typed_data<int32_t>();
  float* c = changed->typed_data<float>();
  if (dtype == ffi::DataType::F32) {
    RankRows<float>(alpha, hyper, old, rows, p, k, sparse, o, r, t, c,
                    kth->typed_data<float>(), tau->typed_data<float>(),
                    share->typed_data<float>());
  } else {
    RankRows<double>(alpha, hyper, old, rows, p, k, sparse, o, r, t, c,
                     kth->typed_data<double>(), tau->typed_data<double>(),
                     share->typed_data<double>());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace dynadiag

XLA_FFI_DEFINE_HANDLER_SYMBOL(DynadiagGateRankCpu, dynadiag::GateRankImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()   // alpha[R, P] F32/F64
                                  .Arg<ffi::AnyBuffer>()   // hyper[R]
                                  .Arg<ffi::AnyBuffer>()   // old_topk[R, K] S32
                                  .Ret<ffi::AnyBuffer>()   // order[R, P] S32
                                  .Ret<ffi::AnyBuffer>()   // rank[R, P] S32
                                  .Ret<ffi::AnyBuffer>()   // topk[R, K] S32
                                  .Ret<ffi::AnyBuffer>()   // changed[R] F32
                                  .Ret<ffi::AnyBuffer>()   // kth[R]
                                  .Ret<ffi::AnyBuffer>()   // tau[R]
                                  .Ret<ffi::AnyBuffer>()   // share[R]
                                  .Attr<bool>("sparse"));
