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
#pragma once

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

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

template <class U, class T>
__device__ __forceinline__ U* pointer_cast(T* p) {
  return reinterpret_cast<U*>(p);
}

}  // namespace simt

#define SIMT_SHARED(type, name) __shared__ ::simt::decl_t<type> name
#define SIMT_SHARED_ALIGNED(type, name, bytes) __shared__ __align__(bytes) ::simt::decl_t<type> name
#else
#include "emu/simt.h"
#endif
