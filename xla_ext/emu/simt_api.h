// What kernel sources include instead of the CUDA headers: on the device (nvcc) the CUDA headers
// plus plain-CUDA definitions of the checked-kernel vocabulary below; on the host the SIMT emulation
// (emu/simt.h), where the same words are checked. The rules for using them are at the top of
// emu/simt.h and in docs/emulation.md.
//
//   SIMT_SHARED(type, name)                 __shared__ type name   (type may be an array: T[N][M])
//   SIMT_SHARED_ALIGNED(type, name, bytes)  __shared__ __align__(bytes) type name
//   simt::store(&out[i], value)             out[i] = value, for the outputs a launch must write
//                                           exactly once (registered with launch.output)
//   simt::shared_ptr<T>                     T*: a pointer into shared memory, as a parameter type
//   simt::pointer_cast<U>(p)                reinterpret_cast<U*>(p), for shared or global pointers
//   simt::copy_async16(dst, src)            cp.async of 16 bytes from global src to shared dst (both
//                                           16-byte aligned)
//   simt::load_shared(frag, p, ldm)         wmma::load_matrix_sync of a half/bfloat16 A or B fragment
//                                           from a pointer into shared memory
//   simt::copy_async_commit()               closes this thread's group of cp.async copies
//   simt::copy_async_wait()                 waits for all of this thread's committed copies; a
//                                           __syncthreads() after it publishes them to the block
//   simt::copy_async_wait_prior<N>()        the same for all but the N most recent groups (a
//                                           pipeline keeps N stages in flight)
// simt::store may write several consecutive output elements at once (e.g. a uint4 of 8 bfloat16),
// each of them exactly once.
#pragma once

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <mma.h>

#include <type_traits>

namespace simt {

template <class T>
using decl_t = T;  // lets the macros take array types: decl_t<float[4][8]> name;
template <class T>
struct type_identity {
  using type = T;
};
template <class T>
using shared_ptr = T*;

template <class T>
__device__ __forceinline__ void store(T* dst, typename type_identity<T>::type value) {
  *dst = value;
}
// A 16-byte store as one instruction: nvcc splits the struct copy into four 4-byte stores when
// the value is assembled from separate words, even at an aligned address.
__device__ __forceinline__ void store(uint4* dst, uint4 value) {
  asm("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(value.x), "r"(value.y), "r"(value.z),
      "r"(value.w)
      : "memory");
}

template <class U, class T>
__device__ __forceinline__ U* pointer_cast(T* p) {
  return reinterpret_cast<U*>(p);
}

template <class T>
__device__ __forceinline__ void copy_async16(T* dst, const T* src) {
  __pipeline_memcpy_async(dst, src, 16);
}
__device__ __forceinline__ void copy_async_commit() { __pipeline_commit(); }

// For bfloat16 nvcc loads wmma fragments through generic addresses (four LD.E per fragment) even
// from shared memory; naming the state space gives ldmatrix, as it does for half.
template <class Use, class Layout>
__device__ __forceinline__ void load_shared(nvcuda::wmma::fragment<Use, 16, 16, 16, __nv_bfloat16, Layout>& f,
                                            const __nv_bfloat16* p, unsigned ldm) {
  namespace wmma = nvcuda::wmma;
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(p));
  unsigned* r = reinterpret_cast<unsigned*>(&f.x[0]);
  if constexpr (std::is_same<Use, wmma::matrix_a>::value && std::is_same<Layout, wmma::row_major>::value)
    asm volatile("wmma.load.a.sync.aligned.row.m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at), "r"(ldm));
  else if constexpr (std::is_same<Use, wmma::matrix_b>::value && std::is_same<Layout, wmma::col_major>::value)
    asm volatile("wmma.load.b.sync.aligned.col.m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at), "r"(ldm));
  else if constexpr (std::is_same<Use, wmma::matrix_a>::value)  // column-major: ldmatrix.trans
    asm volatile("wmma.load.a.sync.aligned.col.m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at), "r"(ldm));
  else
    asm volatile("wmma.load.b.sync.aligned.row.m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at), "r"(ldm));
}
template <class F>
__device__ __forceinline__ void load_shared(F& f, const __half* p, unsigned ldm) {
  nvcuda::wmma::load_matrix_sync(f, p, ldm);
}
__device__ __forceinline__ void copy_async_wait() { __pipeline_wait_prior(0); }
template <int kPending>
__device__ __forceinline__ void copy_async_wait_prior() {
  __pipeline_wait_prior(kPending);
}

}  // namespace simt

#define SIMT_SHARED(type, name) __shared__ ::simt::decl_t<type> name
#define SIMT_SHARED_ALIGNED(type, name, bytes) __shared__ __align__(bytes) ::simt::decl_t<type> name
#else
#include "emu/simt.h"
#endif
