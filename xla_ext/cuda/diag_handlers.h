// FFI handler bodies of the CUDA targets (docs/kernel_abi.md), written once for the CUDA build
// (ffi_handlers.cu, launching on XLA's stream) and the host emulation (emu/ffi_handlers.cc):
// decode and validate the buffers, then run the launch sequence of diag_launch.cuh through the
// given launcher. Every problem is returned as an ffi::Error; nothing here aborts.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "cuda/diag_launch.cuh"
#include "xla/ffi/api/ffi.h"

namespace dynadiag {
namespace cuda {

namespace ffi = xla::ffi;

inline std::string shape_str(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::PRED: return "bool";
    default: return "an unsupported dtype";
  }
}

inline bool supported_dtype(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

template <class T>
struct Tag {
  using type = T;
};

// Calls fn(Tag<T>{}) for the element type T of `t` (one of supported_dtype).
template <class Fn>
ffi::Error dispatch(ffi::DataType t, Fn&& fn) {
  switch (t) {
    case ffi::DataType::F32: return fn(Tag<float>{});
    case ffi::DataType::BF16: return fn(Tag<__nv_bfloat16>{});
    case ffi::DataType::F16: return fn(Tag<__half>{});
    default: return ffi::Error::InvalidArgument("unsupported dtype");
  }
}

inline ffi::Error invalid(const std::string& msg) { return ffi::Error::InvalidArgument(msg); }

// `a[..., n]` and `b[..., m]` with the same leading dimensions; on success rows = their product.
inline ffi::Error check_rows(const char* an, ffi::AnyBuffer::Dimensions a, const char* bn,
                             ffi::AnyBuffer::Dimensions b, int64_t* rows) {
  if (a.size() < 1) return invalid(std::string(an) + " must have rank >= 1, got a scalar");
  if (b.size() != a.size())
    return invalid(std::string(bn) + " must have the rank of " + an + " " + shape_str(a) + ", got " +
                   shape_str(b));
  int64_t r = 1;
  for (size_t i = 0; i + 1 < a.size(); ++i) {
    if (a[i] != b[i])
      return invalid(std::string(bn) + " " + shape_str(b) + " must have the leading dimensions of " + an +
                     " " + shape_str(a));
    r *= a[i];
  }
  const int64_t n = a.back(), m = b.back(), lim = std::numeric_limits<int32_t>::max();
  if (n < 1 || m < 1 || n > lim || m > lim)
    return invalid(std::string("feature dimensions must lie in [1, 2^31): ") + an + " " + shape_str(a) +
                   ", " + bn + " " + shape_str(b));
  *rows = r;
  return ffi::Error::Success();
}

inline ffi::Error check_same_dtype(ffi::DataType want, const char* name, ffi::DataType got,
                                   const char* ref) {
  if (got == want) return ffi::Error::Success();
  return invalid(std::string(name) + " must have the dtype of " + ref + " (" + dtype_name(want) + "), got " +
                 dtype_name(got));
}

// offsets[K] int32 (bound as AnyBuffer: XLA's own dtype check names the operand by its index).
inline ffi::Error check_offsets(const ffi::AnyBuffer& offsets, int64_t K) {
  if (offsets.element_type() != ffi::DataType::S32)
    return invalid(std::string("offsets must be an int32 array [K], got ") + dtype_name(offsets.element_type()));
  auto d = offsets.dimensions();
  if (d.size() != 1 || (K >= 0 && d[0] != K))
    return invalid("offsets must have shape [K]" + (K >= 0 ? " = [" + std::to_string(K) + "]" : std::string()) +
                   ", got " + shape_str(d));
  return ffi::Error::Success();
}

inline ffi::Error check_workspace(const ffi::AnyBuffer& workspace) {
  if (workspace.element_type() != ffi::DataType::U8 || workspace.dimensions().size() != 1)
    return invalid(std::string("workspace must be a uint8 array [W], got ") + dtype_name(workspace.element_type()) +
                   " " + shape_str(workspace.dimensions()));
  return ffi::Error::Success();
}

// A result sharing memory with an operand (input_output_aliases) would be read while it is
// written: refused as on the CPU. Device addresses compare like host ones, without a sync.
inline ffi::Error check_no_alias(const char* result_name, const ffi::AnyBuffer& result,
                                 std::initializer_list<std::pair<const char*, const ffi::AnyBuffer*>> operands) {
  const char* lo = static_cast<const char*>(result.untyped_data());
  const char* hi = lo + result.size_bytes();
  for (const auto& [name, operand] : operands) {
    if (operand->size_bytes() == 0 || result.size_bytes() == 0) continue;
    const char* a = static_cast<const char*>(operand->untyped_data());
    if (a < hi && lo < a + operand->size_bytes())
      return invalid(std::string(result_name) + " must not share memory with " + name + " (no input_output_aliases)");
  }
  return ffi::Error::Success();
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline bool kernel_block_size(int64_t b) { return b == 8 || b == 16 || b == 32 || b == 64 || b == 128; }

// The kernels add int32 positions such as t + d (< P + D); larger layers are rejected.
inline ffi::Error check_index_range(int64_t in_f, int64_t out_f) {
  if (in_f + out_f < (int64_t(1) << 31)) return ffi::Error::Success();
  return invalid("in_features + out_features = " + std::to_string(in_f) + " + " + std::to_string(out_f) +
                 " must be below 2^31 (the CUDA kernels add indices along both axes in 32 bits)");
}

// values[K, L_b, b, b] (or dvalues) of W[out_f, in_f]: b from the last dimension; sets *g.
inline ffi::Error check_block_values(const char* name, ffi::AnyBuffer::Dimensions vd, int64_t in_f,
                                     int64_t out_f, int64_t K_expected, BlockGeometry* g) {
  const int64_t b = vd[3];
  if (vd[2] != b || !kernel_block_size(b))
    return invalid(std::string(name) + " must have shape [K, L_b, b, b] with b in {8, 16, 32, 64, 128}, got " +
                   shape_str(vd));
  if (in_f % b != 0 || out_f % b != 0)
    return invalid("block size b = " + std::to_string(b) + " must divide in_features = " + std::to_string(in_f) +
                   " and out_features = " + std::to_string(out_f));
  *g = block_geometry(in_f, out_f, b);
  if (vd[1] != g->L_b || (K_expected >= 0 && vd[0] != K_expected))
    return invalid(std::string(name) + " must have shape [K, L_b, b, b] = [" +
                   (K_expected >= 0 ? std::to_string(K_expected) : std::string("K")) + ", " +
                   std::to_string(g->L_b) + ", " + std::to_string(b) + ", " + std::to_string(b) + "], got " +
                   shape_str(vd));
  return ffi::Error::Success();
}

// The operands and sizes shared by ProductArgs and BlockProductArgs.
template <class Args>
void set_product_operands(Args& a, ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer>& out, ffi::AnyBuffer values,
                          ffi::AnyBuffer offsets, int64_t rows, int64_t q_dim, int64_t o_dim, int64_t K) {
  using T = std::remove_const_t<std::remove_pointer_t<decltype(a.in)>>;
  a.in = static_cast<const T*>(in.untyped_data());
  a.out = static_cast<T*>(out->untyped_data());
  a.values = static_cast<const T*>(values.untyped_data());
  a.offsets = static_cast<const int32_t*>(offsets.untyped_data());
  a.rows = rows;
  a.q_dim = static_cast<int32_t>(q_dim);
  a.o_dim = static_cast<int32_t>(o_dim);
  a.K = static_cast<int32_t>(K);
}

// Forward (transpose = false): in = x[..., in], out = y[..., out].
// dx (transpose = true): in = dy[..., out], out = dx[..., in].
// Element diagonals for values[K, D], block diagonals for values[K, L_b, b, b].
template <class Launcher>
ffi::Error product(Launcher& launch, bool transpose, ffi::AnyBuffer in, ffi::AnyBuffer values,
                   ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace) {
  const char* in_name = transpose ? "dy" : "x";
  const char* out_name = transpose ? "dx" : "y";
  const ffi::DataType dt = in.element_type();
  if (!supported_dtype(dt))
    return invalid(std::string(in_name) + " must be float32, bfloat16 or float16, got " + dtype_name(dt));
  if (auto e = check_same_dtype(dt, "values", values.element_type(), in_name); e.failure()) return e;
  if (auto e = check_same_dtype(dt, out_name, out->element_type(), in_name); e.failure()) return e;
  if (auto e = check_offsets(offsets, -1); e.failure()) return e;
  if (auto e = check_workspace(*workspace); e.failure()) return e;
  for (const auto& [name, result] : {std::pair{out_name, &*out}, std::pair{"workspace", &*workspace}})
    if (auto e = check_no_alias(name, *result, {{in_name, &in}, {"values", &values}, {"offsets", &offsets}});
        e.failure())
      return e;
  int64_t rows = 0;
  if (auto e = check_rows(in_name, in.dimensions(), out_name, out->dimensions(), &rows); e.failure())
    return e;
  const int64_t q_dim = in.dimensions().back(), o_dim = out->dimensions().back();
  const int64_t in_f = transpose ? o_dim : q_dim, out_f = transpose ? q_dim : o_dim;
  if (auto e = check_index_range(in_f, out_f); e.failure()) return e;
  const int64_t D = in_f < out_f ? in_f : out_f;
  auto vd = values.dimensions();
  const bool blocked = vd.size() == 4;
  BlockGeometry g{};
  if (blocked) {
    if (auto e = check_block_values("values", vd, in_f, out_f, -1, &g); e.failure()) return e;
  } else if (vd.size() != 2 || vd[1] != D) {
    return invalid("values must have shape [K, min(in, out)] = [K, " + std::to_string(D) +
                   "] or [K, L_b, b, b], got " + shape_str(vd));
  }
  const int64_t K = vd[0];
  if (K > std::numeric_limits<int32_t>::max()) return invalid("too many diagonals");
  if (auto e = check_offsets(offsets, K); e.failure()) return e;
  const bool tc = dt != ffi::DataType::F32;
  uint8_t* ws = static_cast<uint8_t*>(workspace->untyped_data());
  if (blocked) {
    const BlockProductPlan plan = plan_block_product(in_f, out_f, transpose, g.b, tc);
    if (const char* e = block_product_limits(plan, rows)) return invalid(e);
    // the tensor-core kernel moves 16-byte chunks (XLA's buffers are aligned far beyond that)
    if (plan.tensor_cores && !(aligned16(in.untyped_data()) && aligned16(values.untyped_data()) &&
                               aligned16(out->untyped_data())))
      return invalid(std::string(in_name) + ", values and " + out_name + " must be 16-byte aligned");
    return dispatch(dt, [&](auto tag) {
      using T = typename decltype(tag)::type;
      BlockProductArgs<T> a{};
      set_product_operands(a, in, out, values, offsets, rows, q_dim, o_dim, K);
      launch_block_product<T>(launch, plan, transpose, a);
      return launch.status();
    });
  }
  const ProductPlan plan = plan_product(in_f, out_f, transpose, K, tc);
  if (workspace->size_bytes() < plan.workspace_bytes)
    return invalid("workspace must have at least " + std::to_string(plan.workspace_bytes) +
                   " bytes (dynadiag_jax.launch_plan.workspace_bytes), got " +
                   std::to_string(workspace->size_bytes()));
  if (const char* e = product_limits(plan, rows)) return invalid(e);
  return dispatch(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    ProductArgs<T> a{};
    set_product_operands(a, in, out, values, offsets, rows, q_dim, o_dim, K);
    a.P = plan.P;
    a.D = plan.D;
    launch_product<T>(launch, plan, a, ws);
    return launch.status();
  });
}

// dvalues[K, D] (element) or dvalues[K, L_b, b, b] (block; b read from the result) from dy[..., out]
// and x[..., in].
template <class Launcher>
ffi::Error dvalues(Launcher& launch, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer offsets,
                   ffi::Result<ffi::AnyBuffer> dvalues, ffi::Result<ffi::AnyBuffer> workspace) {
  const ffi::DataType dt = dy.element_type();
  if (!supported_dtype(dt))
    return invalid(std::string("dy must be float32, bfloat16 or float16, got ") + dtype_name(dt));
  if (auto e = check_same_dtype(dt, "x", x.element_type(), "dy"); e.failure()) return e;
  if (auto e = check_same_dtype(dt, "dvalues", dvalues->element_type(), "dy"); e.failure()) return e;
  if (auto e = check_offsets(offsets, -1); e.failure()) return e;
  if (auto e = check_workspace(*workspace); e.failure()) return e;
  for (const auto& [name, result] : {std::pair{"dvalues", &*dvalues}, std::pair{"workspace", &*workspace}})
    if (auto e = check_no_alias(name, *result, {{"dy", &dy}, {"x", &x}, {"offsets", &offsets}}); e.failure())
      return e;
  int64_t rows = 0;
  if (auto e = check_rows("dy", dy.dimensions(), "x", x.dimensions(), &rows); e.failure()) return e;
  const int64_t out_f = dy.dimensions().back(), in_f = x.dimensions().back();
  if (auto e = check_index_range(in_f, out_f); e.failure()) return e;
  const int64_t D = in_f < out_f ? in_f : out_f, P = in_f < out_f ? out_f : in_f;
  const int64_t K = offsets.dimensions()[0];
  if (K > std::numeric_limits<int32_t>::max()) return invalid("too many diagonals");
  auto vd = dvalues->dimensions();
  uint8_t* ws = static_cast<uint8_t*>(workspace->untyped_data());
  const bool tc = dt != ffi::DataType::F32;
  if (vd.size() == 4) {
    BlockGeometry g{};
    if (auto e = check_block_values("dvalues", vd, in_f, out_f, K, &g); e.failure()) return e;
    const size_t itemsize = dt == ffi::DataType::F32 ? 4 : 2;
    const BlockSddmmPlan plan = plan_block_sddmm(rows, in_f, out_f, K, g.b, itemsize, tc, workspace->size_bytes());
    if (const char* e = block_sddmm_limits(plan)) return invalid(e);
    return dispatch(dt, [&](auto tag) {
      using T = typename decltype(tag)::type;
      BlockSddmmArgs<T> a{};
      a.dy = static_cast<const T*>(dy.untyped_data());
      a.x = static_cast<const T*>(x.untyped_data());
      a.offsets = static_cast<const int32_t*>(offsets.untyped_data());
      a.out = static_cast<T*>(dvalues->untyped_data());
      a.rows = rows;
      a.in_f = static_cast<int32_t>(in_f);
      a.out_f = static_cast<int32_t>(out_f);
      a.K = static_cast<int32_t>(K);
      launch_block_sddmm<T>(launch, plan, a, ws);
      return launch.status();
    });
  }
  if (vd.size() != 2 || vd[0] != K || vd[1] != D)
    return invalid("dvalues must have shape [K, min(in, out)] = [" + std::to_string(K) + ", " +
                   std::to_string(D) + "] or [K, L_b, b, b], got " + shape_str(vd));
  if (const char* e = sddmm_limits(K, D)) return invalid(e);
  const SddmmPlan plan = plan_sddmm(rows, in_f, out_f, K, workspace->size_bytes());
  const bool tall = out_f >= in_f;
  return dispatch(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    SddmmArgs<T> a{};
    a.fixed = static_cast<const T*>(tall ? x.untyped_data() : dy.untyped_data());
    a.moving = static_cast<const T*>(tall ? dy.untyped_data() : x.untyped_data());
    a.offsets = static_cast<const int32_t*>(offsets.untyped_data());
    a.out = static_cast<T*>(dvalues->untyped_data());
    a.rows = rows;
    a.P = static_cast<int32_t>(P);
    a.D = static_cast<int32_t>(D);
    a.K = static_cast<int32_t>(K);
    launch_sddmm<T>(launch, plan, a, ws);
    return launch.status();
  });
}

}  // namespace cuda
}  // namespace dynadiag
