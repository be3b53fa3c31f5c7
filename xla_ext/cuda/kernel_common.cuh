// What every CUDA kernel of diag_matmul shares: element conversions, small integer helpers, the
// block-wide prefix sum, and the work counters of the emulated build.
//
// Counters. Under the host emulation each kernel tallies its work per thread - CTAs, warp-level
// m16n16k16 MMAs, float32 FMAs, bytes loaded from and stored to global memory (operands, outputs,
// lists and tiles; per-block scalars are not counted) - and adds it to a per-kernel total that the
// tests read (emu/module.cc: kernel_counters) and compare with the cost model
// (dynadiag_jax/gpu_cost.py, tests/test_cuda_counts.py). On the device a Tally is an empty struct
// whose calls compile to nothing.
#pragma once

#include <cstdint>

#include "emu/simt_api.h"

#ifndef __CUDACC__
#include <atomic>
#endif

namespace dynadiag {
namespace cuda {

// ---- element conversions (float accumulation for every input type) -----------------------------
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ bool valid_offset(int d, int P) { return d >= 0 && d < P; }

// ---- counters -----------------------------------------------------------------------------------
enum CountedKernel {
  kCountElementPlan,
  kCountElementProduct,
  kCountElementSddmm,
  kCountSddmmReduce,
  kCountBlockProduct,
  kCountBlockSddmm,
  kNumCountedKernels
};

#ifndef __CUDACC__
struct KernelCounter {
  std::atomic<int64_t> ctas{0}, mma{0}, fma{0}, load_bytes{0}, store_bytes{0};
};
inline KernelCounter* kernel_counters() {
  static KernelCounter counters[kNumCountedKernels];
  return counters;
}
#endif

// Per-thread work of one kernel, added to the kernel's counter by flush().
class Tally {
 public:
  __device__ __forceinline__ void cta() { add(ctas_, 1); }
  __device__ __forceinline__ void mma(int64_t n) { add(mma_, n); }
  __device__ __forceinline__ void fma(int64_t n) { add(fma_, n); }
  __device__ __forceinline__ void load(int64_t bytes) { add(load_, bytes); }
  __device__ __forceinline__ void store(int64_t bytes) { add(store_, bytes); }
  __device__ __forceinline__ void flush(CountedKernel kernel) {
#ifndef __CUDACC__
    KernelCounter& c = kernel_counters()[kernel];
    c.ctas.fetch_add(ctas_, std::memory_order_relaxed);
    c.mma.fetch_add(mma_, std::memory_order_relaxed);
    c.fma.fetch_add(fma_, std::memory_order_relaxed);
    c.load_bytes.fetch_add(load_, std::memory_order_relaxed);
    c.store_bytes.fetch_add(store_, std::memory_order_relaxed);
    ctas_ = mma_ = fma_ = load_ = store_ = 0;
#else
    (void)kernel;
#endif
  }

 private:
#ifndef __CUDACC__
  static void add(int64_t& field, int64_t n) { field += n; }
  int64_t ctas_ = 0, mma_ = 0, fma_ = 0, load_ = 0, store_ = 0;
#else
  struct Nothing {};
  __device__ __forceinline__ static void add(Nothing, int64_t) {}
  Nothing ctas_, mma_, fma_, load_, store_;
#endif
};

// ---- block-wide exclusive prefix sum ------------------------------------------------------------
// Every thread of a kNThreads block passes `v`; returns the sum of the values of lower threads and
// the block's total in *total. `buf` is a SIMT_SHARED int32_t[kNThreads] array. Begins and ends
// with a barrier, so buf may be reused right away.
template <int kNThreads, class Buf>
__device__ __forceinline__ int block_exclusive_scan(Buf buf, int v, int* total) {
  const int tid = threadIdx.x;
  __syncthreads();
  buf[tid] = v;
  __syncthreads();
  for (int step = 1; step < kNThreads; step *= 2) {
    const int mine = buf[tid];
    const int add = tid >= step ? int(buf[tid - step]) : 0;
    __syncthreads();
    buf[tid] = mine + add;
    __syncthreads();
  }
  const int inclusive = buf[tid];
  *total = buf[kNThreads - 1];
  __syncthreads();
  return inclusive - v;
}

}  // namespace cuda
}  // namespace dynadiag
