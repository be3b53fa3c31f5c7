// The emulation's own checks, each shown on a small kernel with the fault it must report (linked
// into kernel_check, which runs them first; docs/emulation.md). None of these kernels races, so
// they also run clean under ThreadSanitizer.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "emu/emu_launcher.h"
#include "emu/simt_api.h"

namespace {

using dynadiag::emu_host::EmuLauncher;

int failures = 0;

void expect_report(const char* scenario, const std::string& got, const char* want) {
  if (got.find(want) != std::string::npos) return;
  ++failures;
  std::printf("FAIL selftest %s: expected a report containing \"%s\", got \"%s\"\n", scenario, want, got.c_str());
}

// Block 0 fills the shared array; the other blocks read what a block before them may have left.
__global__ void leftover_kernel(float* out) {
  SIMT_SHARED(float[32], carry);
  if (blockIdx.x == 0) carry[threadIdx.x] = 1.0f;
  __syncthreads();
  const float v = carry[threadIdx.x];
  out[blockIdx.x * 32 + threadIdx.x] = v;
}

__global__ void shared_overrun_kernel(float* out) {
  SIMT_SHARED(float[2][32], rows);
  rows[threadIdx.x / 32][threadIdx.x % 32 + 1] = 1.0f;  // one past the row for the last lane
  out[threadIdx.x] = 0.0f;
}

// wmma needs 32-byte alignment, which a __half array does not declare.
__global__ void unaligned_wmma_kernel(float* out) {
  namespace wmma = nvcuda::wmma;
  SIMT_SHARED(__half[256], tile);
  for (int i = threadIdx.x; i < 256; i += 32) tile[i] = __float2half_rn(1.0f);
  __syncthreads();
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
  wmma::load_matrix_sync(a, tile + 0, 16);
  out[threadIdx.x] = 0.0f;
}

// A 16-byte copy into a __half array declared with 2-byte alignment.
__global__ void unaligned_vector_kernel(const uint4* in, float* out) {
  SIMT_SHARED(__half[64], halves);
  *simt::pointer_cast<uint4>(&halves[8 * threadIdx.x]) = in[threadIdx.x];
  out[threadIdx.x] = 0.0f;
}

// Two cp.async stages; with `early` the second stage is read after waiting for all but the newest
// group, i.e. before it has landed.
__global__ void early_stage_kernel(const uint4* in, float* out, int early) {
  SIMT_SHARED_ALIGNED(float[2][128], stage, 16);
  for (int s = 0; s < 2; ++s) {
    simt::copy_async16(&stage[s][4 * threadIdx.x], &in[s * 32 + threadIdx.x]);
    simt::copy_async_commit();
  }
  if (early)
    simt::copy_async_wait_prior<1>();
  else
    simt::copy_async_wait();
  __syncthreads();
  const float v = stage[1][(4 * threadIdx.x + 4) % 128];
  out[threadIdx.x] = v;
}

enum WriteFault { kNone, kSkip, kTwice, kPastEnd };

__global__ void write_kernel(float* out, int n, int fault) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n || (fault == kSkip && i == 5)) return;
  simt::store(&out[i], 1.0f);
  if (fault == kTwice && i == 7) simt::store(&out[i], 2.0f);
  if (fault == kPastEnd && i == n - 1) simt::store(&out[n], 2.0f);
}

// Records the order in which blocks start and how many run at the same time.
__global__ void order_kernel(int* next, int* order, int* running, int* most) {
  if (threadIdx.x == 0) {
    order[atomicAdd(next, 1)] = static_cast<int>(blockIdx.x);
    atomicMax(most, atomicAdd(running, 1) + 1);
#ifndef SIMT_FIBERS  // OS threads: give the other resident blocks time to start, until one has

    for (int spin = 0; spin < 200000 && __atomic_load_n(most, __ATOMIC_RELAXED) < 2; ++spin)
      std::this_thread::yield();
#endif
  }
  __syncthreads();
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(running, -1);
}

template <class... P, class... A>
std::string launch_report(dim3 grid, dim3 block, void (*kernel)(P...), A... args) {
  emu::launch(grid, block, kernel, args...);
  return emu::last_error() == emu::Error::kCheckFailed ? emu::last_error_message() : "";
}

std::string write_report(int fault, bool memset_after) {
  const int n = 40;
  std::vector<float> out(n);
  EmuLauncher launch;
  launch.output(out.data(), n, 0, "out");
  launch(dim3(2), dim3(32), write_kernel, out.data(), n, fault);
  if (memset_after) launch.memset(out.data(), sizeof(float) * 4);
  return launch.finish() == emu::Error::kSuccess ? "" : launch.message();
}

void check_shared_memory() {
  std::vector<float> out(4 * 64);
  expect_report("shared memory left by another block", launch_report(dim3(4), dim3(32), leftover_kernel, out.data()),
                "read of shared carry[");
  expect_report("shared memory left by another block", emu::last_error_message(),
                "leftover_kernel, declared float[32] carry at emu/simt_selftest.cc:");
  expect_report("shared index out of bounds", launch_report(dim3(1), dim3(64), shared_overrun_kernel, out.data()),
                "index 32 outside [0, 32) in dimension 1 of shared rows");
  expect_report("wmma on an unaligned shared array", launch_report(dim3(1), dim3(32), unaligned_wmma_kernel, out.data()),
                "wmma needs a 256-bit aligned pointer, got a pointer to byte 0 of shared tile, declared with "
                "2-byte alignment");
  std::vector<uint4> in(8);
  expect_report("vector access to an unaligned shared array",
                launch_report(dim3(1), dim3(8), unaligned_vector_kernel, in.data(), out.data()),
                "misaligned 16-byte access to shared halves at byte offset ");
  expect_report("vector access to an unaligned shared array", emu::last_error_message(),
                ": it needs 16-byte alignment, the declaration guarantees 2 (");
  // a stage read before the wait that lands it holds no bytes yet
  std::vector<uint4> staged(64);
  expect_report("a cp.async stage read before its wait",
                launch_report(dim3(1), dim3(32), early_stage_kernel, staged.data(), out.data(), 1),
                "read of shared stage[1][");
  expect_report("a cp.async stage read after its wait",
                launch_report(dim3(1), dim3(32), early_stage_kernel, staged.data(), out.data(), 0) + "<none>", "<none>");
}

void check_outputs() {
  expect_report("an output element written by no thread", write_report(kSkip, false),
                "output out[5] was never written (1 of its 40 elements were not); stores into it came from "
                "write_kernel (emu/simt_selftest.cc:");
  expect_report("an output element written twice", write_report(kTwice, false),
                "output out[7] written twice: by write_kernel (emu/simt_selftest.cc:");
  expect_report("a store past the end of the output", write_report(kPastEnd, false),
                "stores outside every output of the launch sequence: 0 bytes past the end of out (40 elements)");
  expect_report("a memset over written elements", write_report(kNone, true),
                "output out[0] written twice: by a memset through the launcher after write_kernel");
  expect_report("a clean sequence", write_report(kNone, false) + "<none>", "<none>");
}

void check_schedule() {
  const int n = 64;
  std::vector<int> order(n, -1);
  int next = 0, running = 0, most = 0;
  emu::launch(dim3(n), dim3(32), order_kernel, &next, order.data(), &running, &most);
  std::vector<int> seen(n, 0);
  bool identity = true, permutation = next == n;
  for (int i = 0; i < n; ++i) {
    identity = identity && order[i] == i;
    if (order[i] < 0 || order[i] >= n || seen[order[i]]++) permutation = false;
  }
  const int concurrent = std::min(2, emu::detail::schedule().resident);  // --resident 1: one at a time
  if (!permutation || identity || most < concurrent) {
    ++failures;
    std::printf("FAIL selftest schedule: every block once %d, shuffled %d, most blocks at once %d\n", permutation,
                !identity, most);
  }
}

}  // namespace

// Runs every scenario; the number of scenarios whose fault went unreported (or misreported).
int simt_selftest() {
  check_shared_memory();
  check_outputs();
  check_schedule();
  return failures;
}
