// Decode and validate the operands of the CPU targets, then run the kernels' job on XLA's
// intra-op thread pool (the handlers are asynchronous: they return an ffi::Future).
//
// Every check of a shape or dtype returns InvalidArgument naming the operand and the expected
// shape; nothing here aborts. Offsets out of range and a perm that is not a permutation are values
// that may only exist inside jit, so they are not errors: the targets poison their results as the
// Python products define it (docs/kernel_abi.md), and the products send such values here as they
// are, with no guard of their own around the call. Operand order and meaning follow docs/kernel_abi.md: rank-2 values (or dvalues) are
// element diagonals, rank-4 values[K, L_b, b, b] block diagonals.
#include "ffi_handlers.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "diag_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace dynadiag {

using Dims = ffi::AnyBuffer::Dimensions;

std::string ShapeString(Dims dims) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < dims.size(); ++i) s << (i ? ", " : "") << dims[i];
  s << "]";
  return s.str();
}

// Outside the unnamed namespace: declared in there it would hide the overload above.
std::string ShapeString(const std::vector<int64_t>& dims) {
  return ShapeString(Dims(dims.data(), dims.size()));
}

namespace {

ffi::Error Invalid(const char* target, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + message);
}

// The floating operands must share one dtype, F32 or BF16 on CPU.
std::optional<ffi::Error> CheckFloat(const char* target, const char* name, ffi::DataType dtype,
                                     ffi::DataType expected) {
  if (dtype != expected) {
    return Invalid(target, std::string(name) + " must have the dtype of the first operand (" +
                               (expected == ffi::DataType::F32 ? "F32" : "BF16") + ")");
  }
  return std::nullopt;
}

std::optional<ElemType> ElemTypeOf(ffi::DataType dtype) {
  if (dtype == ffi::DataType::F32) return ElemType::kF32;
  if (dtype == ffi::DataType::BF16) return ElemType::kBF16;
  return std::nullopt;
}

// A rows operand `[..., width]`: at least rank 1; its leading dimensions are rows.
std::optional<ffi::Error> CheckRowsOperand(const char* target, const char* name, Dims dims,
                                           const char* width_name) {
  if (dims.size() < 1) {
    return Invalid(target, std::string(name) + " must have shape [..., " + width_name +
                               "], got a scalar");
  }
  return std::nullopt;
}

// `b` must be `[..., b_width]` with the leading dimensions of `a` (same rows, same order): the
// kernels sweep every rows operand of a call with one row count and one row stride per operand,
// so a wrong width anywhere reads or writes past a buffer, or leaves part of a result unwritten.
std::optional<ffi::Error> CheckSameRows(const char* target, const char* a_name, Dims a,
                                        const char* b_name, Dims b, int64_t b_width,
                                        const char* b_width_name) {
  std::vector<int64_t> expected(a.begin(), a.end() - 1);
  expected.push_back(b_width);
  if (!std::equal(b.begin(), b.end(), expected.begin(), expected.end())) {
    return Invalid(target, std::string(b_name) + " must have shape [..., " + b_width_name +
                               "] = " + ShapeString(expected) + " with the leading dimensions of " +
                               a_name + " " + ShapeString(a) + ", got " + ShapeString(b));
  }
  return std::nullopt;
}

// The plans divide by the widths (and by P_b, 0 for a width of 0) and hold column positions,
// perm entries and offsets as int32.
std::optional<ffi::Error> CheckFeatures(const char* target, const char* in_name, Dims in_dims,
                                        const char* out_name, Dims out_dims) {
  constexpr int64_t kLimit = int64_t{1} << 31;
  const int64_t in = in_dims.back(), out = out_dims.back();
  if (in < 1 || out < 1 || in >= kLimit || out >= kLimit) {
    return Invalid(target, "feature dimensions must lie in [1, 2^31): in = " +
                               std::to_string(in) + " (" + in_name + " " + ShapeString(in_dims) +
                               "), out = " + std::to_string(out) + " (" + out_name + " " +
                               ShapeString(out_dims) + ")");
  }
  return std::nullopt;
}

int64_t Rows(Dims dims) {
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) rows *= dims[i];
  return rows;
}

// The number of candidate diagonals: P = max(in, out), or P_b = min(in, out) / b for blocks.
int64_t Candidates(const DiagMatrix& w) {
  return w.block > 1 ? std::min(w.in, w.out) / w.block : std::max(w.in, w.out);
}

// What the kernels must not read through, found while decoding: the diagonals whose offset is
// outside [0, P) (they run on offset 0 and their results are poisoned) and a perm that is not a
// bijection (every result is poisoned, nothing runs).
struct Guard {
  std::vector<int64_t> bad;      // k with offsets[k] outside [0, P) (or [0, P_b))
  std::vector<int32_t> clamped;  // offsets with those set to 0; w.offsets points here if any
  bool bad_perm = false;
  bool Any() const { return bad_perm || !bad.empty(); }
};

// offsets: s32[K]. Fills w.k and w.offsets; entries outside [0, P) (or [0, P_b)) go to `guard`.
std::optional<ffi::Error> CheckOffsets(const char* target, const ffi::AnyBuffer& offsets,
                                       DiagMatrix& w, Guard& guard) {
  if (offsets.element_type() != ffi::DataType::S32) {
    return Invalid(target, "offsets must be an S32 array of shape [K]");
  }
  Dims dims = offsets.dimensions();
  if (dims.size() != 1) {
    return Invalid(target, "offsets must have shape [K], got " + ShapeString(dims));
  }
  w.k = dims[0];
  w.offsets = static_cast<const int32_t*>(offsets.untyped_data());
  const int64_t p = Candidates(w);
  for (int64_t k = 0; k < w.k; ++k) {
    if (w.offsets[k] < 0 || w.offsets[k] >= p) guard.bad.push_back(k);
  }
  if (!guard.bad.empty()) {
    guard.clamped.assign(w.offsets, w.offsets + w.k);
    for (int64_t k : guard.bad) guard.clamped[k] = 0;
    w.offsets = guard.clamped.data();
  }
  return std::nullopt;
}

constexpr int64_t kBlockSizes[] = {8, 16, 32, 64, 128};

// Fills w.block from a values (or dvalues) operand: b = its last dimension when it has rank 4,
// else 1. A block must be b x b with b in kBlockSizes, dividing in and out.
std::optional<ffi::Error> CheckBlockSize(const char* target, const char* name, Dims dims,
                                         DiagMatrix& w) {
  w.block = 1;
  if (dims.size() != 4) return std::nullopt;
  const int64_t b = dims[3];
  if (dims[2] != b) {
    return Invalid(target, std::string(name) +
                               " must have shape [K, L_b, b, b] (square blocks), got " +
                               ShapeString(dims));
  }
  if (std::find(std::begin(kBlockSizes), std::end(kBlockSizes), b) == std::end(kBlockSizes)) {
    return Invalid(target, std::string(name) + " has blocks of b=" + std::to_string(b) +
                               " (shape " + ShapeString(dims) +
                               "); block diagonals take b in {8, 16, 32, 64, 128}");
  }
  if (w.in % b != 0 || w.out % b != 0) {
    return Invalid(target, "block size b=" + std::to_string(b) + " (from " + name + " " +
                               ShapeString(dims) + ") must divide in=" + std::to_string(w.in) +
                               " and out=" + std::to_string(w.out));
  }
  w.block = b;
  return std::nullopt;
}

// A values (or dvalues) operand: [K, D] for element diagonals, [K, L_b, b, b] for blocks.
std::optional<ffi::Error> CheckDiagShape(const char* target, const char* name, Dims dims,
                                         const DiagMatrix& w) {
  if (w.block > 1) {
    const int64_t len = std::max(w.in, w.out) / w.block;
    if (dims.size() != 4 || dims[0] != w.k || dims[1] != len || dims[2] != w.block ||
        dims[3] != w.block) {
      return Invalid(target, std::string(name) + " must have shape [K, L_b, b, b] = [" +
                                 std::to_string(w.k) + ", " + std::to_string(len) + ", " +
                                 std::to_string(w.block) + ", " + std::to_string(w.block) +
                                 "] (K from offsets, L_b = max(in, out) / b), got " +
                                 ShapeString(dims));
    }
    return std::nullopt;
  }
  const int64_t len = std::min(w.in, w.out);
  if (dims.size() != 2 || dims[0] != w.k || dims[1] != len) {
    return Invalid(target, std::string(name) + " must have shape [K, min(in, out)] = [" +
                               std::to_string(w.k) + ", " + std::to_string(len) +
                               "] (K from offsets), got " + ShapeString(dims));
  }
  return std::nullopt;
}

// perm: s32[in] (x's column j is input perm[j]). Fills w.perm, or sets guard.bad_perm when it is
// not a permutation of [0, in) (one pass with a bitmap): dx is scattered through it, and a
// repeated entry would leave columns of dx unwritten.
std::optional<ffi::Error> CheckPerm(const char* target, const ffi::AnyBuffer& perm, DiagMatrix& w,
                                    Guard& guard) {
  if (perm.element_type() != ffi::DataType::S32) {
    return Invalid(target, "perm must be an S32 array of shape [in] = [" + std::to_string(w.in) +
                               "]");
  }
  Dims dims = perm.dimensions();
  if (dims.size() != 1 || dims[0] != w.in) {
    return Invalid(target, "perm must have shape [in] = [" + std::to_string(w.in) + "], got " +
                               ShapeString(dims));
  }
  const int32_t* p = static_cast<const int32_t*>(perm.untyped_data());
  std::vector<bool> seen(w.in, false);
  for (int64_t j = 0; j < w.in; ++j) {
    if (p[j] < 0 || p[j] >= w.in || seen[p[j]]) {
      guard.bad_perm = true;
      return std::nullopt;
    }
    seen[p[j]] = true;
  }
  w.perm = p;
  return std::nullopt;
}

// A result must not share memory with an operand (input_output_aliases in a direct call): the
// kernels read the operands while they write it, and returned garbage.
std::optional<ffi::Error> CheckNoAlias(
    const char* target, const char* result_name, const ffi::AnyBuffer& result,
    std::initializer_list<std::pair<const char*, const ffi::AnyBuffer*>> operands) {
  const char* lo = static_cast<const char*>(result.untyped_data());
  const char* hi = lo + result.size_bytes();
  for (const auto& [name, operand] : operands) {
    if (operand == nullptr || operand->size_bytes() == 0 || result.size_bytes() == 0) continue;
    const char* a = static_cast<const char*>(operand->untyped_data());
    if (a < hi && lo < a + operand->size_bytes()) {
      return Invalid(target, std::string(result_name) + " must not share memory with " + name +
                                 " (no input_output_aliases)");
    }
  }
  return std::nullopt;
}

// The targets without and with the input permutation (an extra last operand perm[in]).
struct Names {
  const char* fwd;
  const char* dx;
  const char* dvalues;
  const char* bwd;
};
constexpr Names kPlain = {"dynadiag_diag_matmul_v2_fwd", "dynadiag_diag_matmul_v2_dx",
                          "dynadiag_diag_matmul_v2_dvalues", "dynadiag_diag_matmul_v2_bwd"};
constexpr Names kPermuted = {
    "dynadiag_diag_matmul_permuted_v1_fwd", "dynadiag_diag_matmul_permuted_v1_dx",
    "dynadiag_diag_matmul_permuted_v1_dvalues", "dynadiag_diag_matmul_permuted_v1_bwd"};

#define DYNADIAG_RETURN_IF_ERROR(expr)      \
  if (auto error = (expr)) return *error;

// `perm` is null for the targets without an input permutation.
std::optional<ffi::Error> DecodeFwd(const char* target, const ffi::AnyBuffer* perm,
                                    ffi::AnyBuffer x, ffi::AnyBuffer values,
                                    ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> y,
                                    FwdArgs& args, Guard& guard) {
  auto type = ElemTypeOf(x.element_type());
  if (!type) return Invalid(target, "x must be F32 or BF16 on CPU");
  DYNADIAG_RETURN_IF_ERROR(CheckFloat(target, "values", values.element_type(), x.element_type()));
  DYNADIAG_RETURN_IF_ERROR(CheckFloat(target, "y", y->element_type(), x.element_type()));
  DYNADIAG_RETURN_IF_ERROR(CheckRowsOperand(target, "x", x.dimensions(), "in"));
  DYNADIAG_RETURN_IF_ERROR(CheckRowsOperand(target, "y", y->dimensions(), "out"));
  DiagMatrix w{};
  w.in = x.dimensions().back();
  w.out = y->dimensions().back();
  w.values = values.untyped_data();
  DYNADIAG_RETURN_IF_ERROR(CheckSameRows(target, "x", x.dimensions(), "y", y->dimensions(), w.out,
                                         "out"));
  DYNADIAG_RETURN_IF_ERROR(CheckFeatures(target, "x", x.dimensions(), "y", y->dimensions()));
  DYNADIAG_RETURN_IF_ERROR(CheckBlockSize(target, "values", values.dimensions(), w));
  DYNADIAG_RETURN_IF_ERROR(CheckOffsets(target, offsets, w, guard));
  if (perm != nullptr) {
    DYNADIAG_RETURN_IF_ERROR(CheckPerm(target, *perm, w, guard));
  }
  DYNADIAG_RETURN_IF_ERROR(CheckDiagShape(target, "values", values.dimensions(), w));
  DYNADIAG_RETURN_IF_ERROR(CheckNoAlias(
      target, "y", *y, {{"x", &x}, {"values", &values}, {"offsets", &offsets}, {"perm", perm}}));
  args = FwdArgs{*type, Rows(x.dimensions()), w, x.untyped_data(), y->untyped_data()};
  return std::nullopt;
}

std::optional<ffi::Error> DecodeDx(const char* target, const ffi::AnyBuffer* perm,
                                   ffi::AnyBuffer dy, ffi::AnyBuffer values,
                                   ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> dx,
                                   DxArgs& args, Guard& guard) {
  auto type = ElemTypeOf(dy.element_type());
  if (!type) return Invalid(target, "dy must be F32 or BF16 on CPU");
  DYNADIAG_RETURN_IF_ERROR(CheckFloat(target, "values", values.element_type(), dy.element_type()));
  DYNADIAG_RETURN_IF_ERROR(CheckFloat(target, "dx", dx->element_type(), dy.element_type()));
  DYNADIAG_RETURN_IF_ERROR(CheckRowsOperand(target, "dy", dy.dimensions(), "out"));
  DYNADIAG_RETURN_IF_ERROR(CheckRowsOperand(target, "dx", dx->dimensions(), "in"));
  DiagMatrix w{};
  w.in = dx->dimensions().back();
  w.out = dy.dimensions().back();
  w.values = values.untyped_data();
  DYNADIAG_RETURN_IF_ERROR(CheckSameRows(target, "dy", dy.dimensions(), "dx", dx->dimensions(),
                                         w.in, "in"));
  DYNADIAG_RETURN_IF_ERROR(CheckFeatures(target, "dx", dx->dimensions(), "dy", dy.dimensions()));
  DYNADIAG_RETURN_IF_ERROR(CheckBlockSize(target, "values", values.dimensions(), w));
  DYNADIAG_RETURN_IF_ERROR(CheckOffsets(target, offsets, w, guard));
  if (perm != nullptr) {
    DYNADIAG_RETURN_IF_ERROR(CheckPerm(target, *perm, w, guard));
  }
  DYNADIAG_RETURN_IF_ERROR(CheckDiagShape(target, "values", values.dimensions(), w));
  DYNADIAG_RETURN_IF_ERROR(CheckNoAlias(
      target, "dx", *dx, {{"dy", &dy}, {"values", &values}, {"offsets", &offsets}, {"perm", perm}}));
  args = DxArgs{*type, Rows(dy.dimensions()), w, dy.untyped_data(), dx->untyped_data()};
  return std::nullopt;
}

std::optional<ffi::Error> DecodeDvalues(const char* target, const ffi::AnyBuffer* perm,
                                        ffi::AnyBuffer dy, ffi::AnyBuffer x,
                                        ffi::AnyBuffer offsets,
                                        ffi::Result<ffi::AnyBuffer> dvalues,
                                        DvaluesArgs& args, Guard& guard) {
  auto type = ElemTypeOf(dy.element_type());
  if (!type) return Invalid(target, "dy must be F32 or BF16 on CPU");
  DYNADIAG_RETURN_IF_ERROR(CheckFloat(target, "x", x.element_type(), dy.element_type()));
  DYNADIAG_RETURN_IF_ERROR(
      CheckFloat(target, "dvalues", dvalues->element_type(), dy.element_type()));
  DYNADIAG_RETURN_IF_ERROR(CheckRowsOperand(target, "dy", dy.dimensions(), "out"));
  DYNADIAG_RETURN_IF_ERROR(CheckRowsOperand(target, "x", x.dimensions(), "in"));
  DiagMatrix w{};
  w.in = x.dimensions().back();
  w.out = dy.dimensions().back();
  DYNADIAG_RETURN_IF_ERROR(CheckSameRows(target, "dy", dy.dimensions(), "x", x.dimensions(),
                                         w.in, "in"));
  DYNADIAG_RETURN_IF_ERROR(CheckFeatures(target, "x", x.dimensions(), "dy", dy.dimensions()));
  DYNADIAG_RETURN_IF_ERROR(CheckBlockSize(target, "dvalues", dvalues->dimensions(), w));
  DYNADIAG_RETURN_IF_ERROR(CheckOffsets(target, offsets, w, guard));
  if (perm != nullptr) {
    DYNADIAG_RETURN_IF_ERROR(CheckPerm(target, *perm, w, guard));
  }
  DYNADIAG_RETURN_IF_ERROR(CheckDiagShape(target, "dvalues", dvalues->dimensions(), w));
  DYNADIAG_RETURN_IF_ERROR(CheckNoAlias(
      target, "dvalues", *dvalues, {{"dy", &dy}, {"x", &x}, {"offsets", &offsets}, {"perm", perm}}));
  args = DvaluesArgs{*type, Rows(dy.dimensions()), w, dy.untyped_data(), x.untyped_data(),
                     dvalues->untyped_data()};
  return std::nullopt;
}

std::optional<ffi::Error> DecodeBwd(const char* target, const ffi::AnyBuffer* perm,
                                    ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer values,
                                    ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> dx,
                                    ffi::Result<ffi::AnyBuffer> dvalues, BwdArgs& args,
                                    Guard& guard) {
  auto type = ElemTypeOf(dy.element_type());
  if (!type) return Invalid(target, "dy must be F32 or BF16 on CPU");
  DYNADIAG_RETURN_IF_ERROR(CheckFloat(target, "x", x.element_type(), dy.element_type()));
  DYNADIAG_RETURN_IF_ERROR(CheckFloat(target, "values", values.element_type(), dy.element_type()));
  DYNADIAG_RETURN_IF_ERROR(CheckFloat(target, "dx", dx->element_type(), dy.element_type()));
  DYNADIAG_RETURN_IF_ERROR(
      CheckFloat(target, "dvalues", dvalues->element_type(), dy.element_type()));
  DYNADIAG_RETURN_IF_ERROR(CheckRowsOperand(target, "dy", dy.dimensions(), "out"));
  DYNADIAG_RETURN_IF_ERROR(CheckRowsOperand(target, "x", x.dimensions(), "in"));
  DiagMatrix w{};
  w.in = x.dimensions().back();
  w.out = dy.dimensions().back();
  w.values = values.untyped_data();
  DYNADIAG_RETURN_IF_ERROR(CheckSameRows(target, "dy", dy.dimensions(), "x", x.dimensions(), w.in,
                                         "in"));
  DYNADIAG_RETURN_IF_ERROR(CheckFeatures(target, "x", x.dimensions(), "dy", dy.dimensions()));
  DYNADIAG_RETURN_IF_ERROR(CheckSameRows(target, "dy", dy.dimensions(), "dx", dx->dimensions(),
                                         w.in, "in"));
  DYNADIAG_RETURN_IF_ERROR(CheckBlockSize(target, "values", values.dimensions(), w));
  DYNADIAG_RETURN_IF_ERROR(CheckOffsets(target, offsets, w, guard));
  if (perm != nullptr) {
    DYNADIAG_RETURN_IF_ERROR(CheckPerm(target, *perm, w, guard));
  }
  DYNADIAG_RETURN_IF_ERROR(CheckDiagShape(target, "values", values.dimensions(), w));
  DYNADIAG_RETURN_IF_ERROR(CheckDiagShape(target, "dvalues", dvalues->dimensions(), w));
  for (const auto& [name, result] :
       {std::pair<const char*, ffi::AnyBuffer*>{"dx", &*dx}, {"dvalues", &*dvalues}}) {
    DYNADIAG_RETURN_IF_ERROR(CheckNoAlias(target, name, *result,
                                          {{"dy", &dy}, {"x", &x}, {"values", &values},
                                           {"offsets", &offsets}, {"perm", perm}}));
  }
  args = BwdArgs{*type, Rows(dy.dimensions()), w, dy.untyped_data(), x.untyped_data(),
                 dx->untyped_data(), dvalues->untyped_data()};
  return std::nullopt;
}

#undef DYNADIAG_RETURN_IF_ERROR

ffi::Future ReadyFuture(std::optional<ffi::Error> error = std::nullopt) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (error) {
    promise.SetError(std::move(*error));
  } else {
    promise.SetAvailable();
  }
  return future;
}

// Runs the job's tasks on XLA's intra-op thread pool; the returned future completes when the
// last task has finished, and the job (plan and scratch) lives until then.
template <typename MakeJob>
ffi::Future Launch(const char* target, ffi::ThreadPool& pool, MakeJob make_job) {
  std::shared_ptr<Job> job;
  try {
    job = make_job(std::max<int64_t>(pool.num_threads(), 1));
  } catch (const std::bad_alloc&) {
    return ReadyFuture(ffi::Error(ffi::ErrorCode::kResourceExhausted,
                                  std::string(target) + ": out of memory for the kernel plan"));
  }
  const int64_t tasks = job->num_tasks();
  if (tasks <= 1) {
    if (tasks == 1) job->RunTask(0);
    return ReadyFuture();
  }
  ffi::CountDownPromise done(tasks);
  ffi::Future future(done);
  for (int64_t i = 0; i < tasks; ++i) {
    pool.Schedule([job, done, i]() mutable {
      job->RunTask(i);
      done.CountDown(1);
    });
  }
  return future;
}

// NaN in `count` elements of a result of `type`.
void FillNaN(ElemType type, void* data, int64_t count) {
  if (type == ElemType::kF32) {
    std::fill_n(static_cast<float*>(data), count, std::numeric_limits<float>::quiet_NaN());
  } else {
    std::fill_n(static_cast<uint16_t*>(data), count, uint16_t{0x7FC0});  // bfloat16 quiet NaN
  }
}

// NaN in the rows of `dvalues[K, ...]` whose offset was out of range.
void PoisonRows(ElemType type, ffi::Result<ffi::AnyBuffer>& dvalues, const Guard& guard) {
  const int64_t k = dvalues->dimensions()[0];
  const int64_t row = k ? static_cast<int64_t>(dvalues->element_count()) / k : 0;
  const int64_t bytes = type == ElemType::kF32 ? 4 : 2;
  auto* base = static_cast<char*>(dvalues->untyped_data());
  for (int64_t bad : guard.bad) FillNaN(type, base + bad * row * bytes, row);
}

// Runs every task of the job on the calling thread, so that the caller can poison its results
// afterwards (only with offsets out of range: nothing else waits on it).
template <typename MakeJob>
std::optional<ffi::Error> RunHere(const char* target, ffi::ThreadPool& pool, MakeJob make_job) {
  try {
    std::shared_ptr<Job> job = make_job(std::max<int64_t>(pool.num_threads(), 1));
    for (int64_t i = 0; i < job->num_tasks(); ++i) job->RunTask(i);
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(target) + ": out of memory for the kernel plan");
  }
  return std::nullopt;
}

// y and dx: any offset out of range, or a perm that is not a permutation, makes the whole result
// NaN, so nothing runs.
ffi::Future Fwd(const Names& names, ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer values,
                ffi::AnyBuffer offsets, const ffi::AnyBuffer* perm, ffi::Result<ffi::AnyBuffer> y) {
  FwdArgs args;
  Guard guard;
  if (auto error = DecodeFwd(names.fwd, perm, x, values, offsets, y, args, guard)) {
    return ReadyFuture(std::move(error));
  }
  if (guard.Any()) {
    FillNaN(args.type, y->untyped_data(), y->element_count());
    return ReadyFuture();
  }
  return Launch(names.fwd, pool,
                [&](int64_t workers) { return MakeFwdJob(args, workers, BestIsa()); });
}

ffi::Future Dx(const Names& names, ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer values,
               ffi::AnyBuffer offsets, const ffi::AnyBuffer* perm, ffi::Result<ffi::AnyBuffer> dx) {
  DxArgs args;
  Guard guard;
  if (auto error = DecodeDx(names.dx, perm, dy, values, offsets, dx, args, guard)) {
    return ReadyFuture(std::move(error));
  }
  if (guard.Any()) {
    FillNaN(args.type, dx->untyped_data(), dx->element_count());
    return ReadyFuture();
  }
  return Launch(names.dx, pool,
                [&](int64_t workers) { return MakeDxJob(args, workers, BestIsa()); });
}

// dvalues: the rows of the offsets out of range are NaN, the others computed as usual (their
// diagonals do not depend on the bad ones); a perm that is not a permutation makes all of it NaN.
ffi::Future Dvalues(const Names& names, ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                    ffi::AnyBuffer offsets, const ffi::AnyBuffer* perm,
                    ffi::Result<ffi::AnyBuffer> dvalues) {
  DvaluesArgs args;
  Guard guard;
  if (auto error = DecodeDvalues(names.dvalues, perm, dy, x, offsets, dvalues, args, guard)) {
    return ReadyFuture(std::move(error));
  }
  auto make = [&](int64_t workers) { return MakeDvaluesJob(args, workers, BestIsa()); };
  if (guard.bad_perm) {
    FillNaN(args.type, dvalues->untyped_data(), dvalues->element_count());
    return ReadyFuture();
  }
  if (guard.Any()) {
    if (auto error = RunHere(names.dvalues, pool, make)) return ReadyFuture(std::move(error));
    PoisonRows(args.type, dvalues, guard);
    return ReadyFuture();
  }
  return Launch(names.dvalues, pool, make);
}

ffi::Future Bwd(const Names& names, ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                ffi::AnyBuffer values, ffi::AnyBuffer offsets, const ffi::AnyBuffer* perm,
                ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dvalues) {
  BwdArgs args;
  Guard guard;
  if (auto error = DecodeBwd(names.bwd, perm, dy, x, values, offsets, dx, dvalues, args, guard)) {
    return ReadyFuture(std::move(error));
  }
  auto make = [&](int64_t workers) { return MakeBwdJob(args, workers, BestIsa()); };
  if (guard.bad_perm) {
    FillNaN(args.type, dvalues->untyped_data(), dvalues->element_count());
  } else if (guard.Any()) {
    if (auto error = RunHere(names.bwd, pool, make)) return ReadyFuture(std::move(error));
    PoisonRows(args.type, dvalues, guard);
  }
  if (guard.Any()) {
    FillNaN(args.type, dx->untyped_data(), dx->element_count());
    return ReadyFuture();
  }
  return Launch(names.bwd, pool, make);
}

ffi::Future FwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer values,
                    ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> y) {
  return Fwd(kPlain, pool, x, values, offsets, nullptr, y);
}

ffi::Future DxImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer values,
                   ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> dx) {
  return Dx(kPlain, pool, dy, values, offsets, nullptr, dx);
}

ffi::Future DvaluesImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                        ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> dvalues) {
  return Dvalues(kPlain, pool, dy, x, offsets, nullptr, dvalues);
}

ffi::Future BwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                    ffi::AnyBuffer values, ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> dx,
                    ffi::Result<ffi::AnyBuffer> dvalues) {
  return Bwd(kPlain, pool, dy, x, values, offsets, nullptr, dx, dvalues);
}

ffi::Future PermutedFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer values,
                            ffi::AnyBuffer offsets, ffi::AnyBuffer perm,
                            ffi::Result<ffi::AnyBuffer> y) {
  return Fwd(kPermuted, pool, x, values, offsets, &perm, y);
}

ffi::Future PermutedDxImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer values,
                           ffi::AnyBuffer offsets, ffi::AnyBuffer perm,
                           ffi::Result<ffi::AnyBuffer> dx) {
  return Dx(kPermuted, pool, dy, values, offsets, &perm, dx);
}

ffi::Future PermutedDvaluesImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                                ffi::AnyBuffer offsets, ffi::AnyBuffer perm,
                                ffi::Result<ffi::AnyBuffer> dvalues) {
  return Dvalues(kPermuted, pool, dy, x, offsets, &perm, dvalues);
}

ffi::Future PermutedBwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                            ffi::AnyBuffer values, ffi::AnyBuffer offsets, ffi::AnyBuffer perm,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dvalues) {
  return Bwd(kPermuted, pool, dy, x, values, offsets, &perm, dx, dvalues);
}

}  // namespace
}  // namespace dynadiag

XLA_FFI_DEFINE_HANDLER_SYMBOL(DynadiagDiagMatmulFwdCpu, dynadiag::FwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // x[..., in]
                                  .Arg<ffi::AnyBuffer>()   // values[K, D] or [K, L_b, b, b]
                                  .Arg<ffi::AnyBuffer>()   // offsets[K] s32
                                  .Ret<ffi::AnyBuffer>());  // y[..., out]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DynadiagDiagMatmulDxCpu, dynadiag::DxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // dy[..., out]
                                  .Arg<ffi::AnyBuffer>()   // values[K, D] or [K, L_b, b, b]
                                  .Arg<ffi::AnyBuffer>()   // offsets[K] s32
                                  .Ret<ffi::AnyBuffer>());  // dx[..., in]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DynadiagDiagMatmulDvaluesCpu, dynadiag::DvaluesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // dy[..., out]
                                  .Arg<ffi::AnyBuffer>()   // x[..., in]
                                  .Arg<ffi::AnyBuffer>()   // offsets[K] s32
                                  .Ret<ffi::AnyBuffer>());  // dvalues[K, D] or [K, L_b, b, b]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DynadiagDiagMatmulBwdCpu, dynadiag::BwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // dy[..., out]
                                  .Arg<ffi::AnyBuffer>()   // x[..., in]
                                  .Arg<ffi::AnyBuffer>()   // values[K, D] or [K, L_b, b, b]
                                  .Arg<ffi::AnyBuffer>()   // offsets[K] s32
                                  .Ret<ffi::AnyBuffer>()   // dx[..., in]
                                  .Ret<ffi::AnyBuffer>());  // dvalues[K, D] or [K, L_b, b, b]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DynadiagDiagMatmulPermutedFwdCpu, dynadiag::PermutedFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // x[..., in]
                                  .Arg<ffi::AnyBuffer>()   // values[K, D] or [K, L_b, b, b]
                                  .Arg<ffi::AnyBuffer>()   // offsets[K] s32
                                  .Arg<ffi::AnyBuffer>()   // perm[in] s32
                                  .Ret<ffi::AnyBuffer>());  // y[..., out]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DynadiagDiagMatmulPermutedDxCpu, dynadiag::PermutedDxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // dy[..., out]
                                  .Arg<ffi::AnyBuffer>()   // values[K, D] or [K, L_b, b, b]
                                  .Arg<ffi::AnyBuffer>()   // offsets[K] s32
                                  .Arg<ffi::AnyBuffer>()   // perm[in] s32
                                  .Ret<ffi::AnyBuffer>());  // dx[..., in]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DynadiagDiagMatmulPermutedDvaluesCpu, dynadiag::PermutedDvaluesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // dy[..., out]
                                  .Arg<ffi::AnyBuffer>()   // x[..., in]
                                  .Arg<ffi::AnyBuffer>()   // offsets[K] s32
                                  .Arg<ffi::AnyBuffer>()   // perm[in] s32
                                  .Ret<ffi::AnyBuffer>());  // dvalues[K, D] or [K, L_b, b, b]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DynadiagDiagMatmulPermutedBwdCpu, dynadiag::PermutedBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // dy[..., out]
                                  .Arg<ffi::AnyBuffer>()   // x[..., in]
                                  .Arg<ffi::AnyBuffer>()   // values[K, D] or [K, L_b, b, b]
                                  .Arg<ffi::AnyBuffer>()   // offsets[K] s32
                                  .Arg<ffi::AnyBuffer>()   // perm[in] s32
                                  .Ret<ffi::AnyBuffer>()   // dx[..., in]
                                  .Ret<ffi::AnyBuffer>());  // dvalues[K, D] or [K, L_b, b, b]
