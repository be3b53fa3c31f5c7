// SIMT emulation: compiles CUDA kernel sources with a host C++17 compiler and runs them on the CPU.
//
// What is modelled (everything the dynadiag kernels use, plus shuffles and the usual atomics):
// * A launch runs the blocks of the grid one after another. By default the threads of a block are
//   real OS threads (a persistent pool, reused across blocks and launches), so ThreadSanitizer sees
//   every shared-memory race a missing barrier would cause. With -DSIMT_FIBERS they are ucontext
//   fibers on the launching thread instead: deterministic (a fiber runs until it waits at a
//   barrier; low threads run ahead of high ones, or the reverse, see Runtime::run_block), several
//   times faster, but invisible to ThreadSanitizer.
// * `__shared__` becomes a function-local `static`: one copy per kernel instantiation, shared by
//   the threads of the running block. Launches are serialised by a global lock, so two blocks never
//   share it at the same time.
// * `__syncthreads()` is a block barrier that records the call site: threads arriving at different
//   `__syncthreads` in the same phase abort with both locations (divergent barrier, undefined on a
//   GPU). A thread that returns from the kernel leaves the barrier, as on hardware. A barrier that
//   cannot complete (fibers) or does not within `kDeadlockSeconds` (threads) aborts.
// * Warp collectives (`__syncwarp`, `__shfl*_sync`, `nvcuda::wmma::*_sync`) rendezvous the lanes of
//   the warp at a warp barrier with the same divergence check. The `mask` arguments are ignored:
//   all lanes of the warp must participate.
// * `nvcuda::wmma` m16n16k16 with half or bfloat16 inputs and float accumulators. Each lane keeps
//   the whole tile in its fragment (`num_elements` = rows * cols, a different element mapping from
//   the GPU's) and computes the whole product in float, adding the products in k order. Loads and
//   stores check the 256-bit pointer alignment and the `ldm` rule; `store_matrix_sync` writes from
//   lane 0 only, so a read of stored data by another lane without `__syncwarp` is a race here too.
// * `cudaGetLastError` analogue: `emu::last_error()` reports an invalid launch configuration.
//
// Not modelled: inline PTX, cooperative groups, grid-wide sync, dynamic shared memory, streams.
// Kernel code must not use them; missing builtins fail at compile time, which is the point.
// Linux only (futexes for the thread scheduler, ucontext for the fibers).
#pragma once

#ifdef __CUDACC__
#error "simt.h emulates CUDA on the host; device builds include the CUDA headers instead"
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef SIMT_FIBERS
#include <ucontext.h>
#else
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>
#endif

// Kernel sources carry `#pragma unroll`, which the host compiler does not know.
#pragma GCC diagnostic ignored "-Wunknown-pragmas"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Block-wide values are written by the launching thread while the pool is idle (the hand-over
// goes through a mutex, so they are ordered before any kernel thread reads them).
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;
inline thread_local uint3 threadIdx;
constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------
// Numeric types: storage structs with explicit conversions only (as in kernel code that uses the
// __float2half_rn / __half2float family), so an implicit conversion in a kernel fails to compile.
struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};

inline uint32_t float_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

inline float __half2float(__half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1fu, mant = h.bits & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf, NaN
  if (exp == 0) {                                                       // zero, subnormal
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    return bits_float(sign | float_bits(v));
  }
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
}

// Round to nearest even, overflow to inf, NaN stays (quiet) NaN.
inline __half __float2half_rn(float v) {
  uint32_t u = float_bits(v);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  uint16_t out;
  if (u >= 0x47800000u) {         // |v| >= 2^16 (or inf/NaN): no finite half
    out = u > 0x7f800000u ? 0x7e00 : 0x7c00;
  } else if (u < 0x38800000u) {   // below 2^-14: a subnormal half; let float addition round
    const float magic = bits_float(126u << 23);  // 0.5: its ulp is the half subnormal step 2^-24
    out = static_cast<uint16_t>(float_bits(bits_float(u) + magic) - (126u << 23));
  } else {                        // normal: rebias the exponent, round the 13 dropped bits
    const uint32_t odd = (u >> 13) & 1u;
    u += 0xc8000fffu + odd;       // (15 - 127) << 23, plus the rounding bias
    out = static_cast<uint16_t>(u >> 13);  // a carry into the exponent gives inf correctly
  }
  return __half{static_cast<uint16_t>(out | sign)};
}
inline __half __float2half(float v) { return __float2half_rn(v); }

inline float __bfloat162float(__nv_bfloat16 h) { return bits_float(static_cast<uint32_t>(h.bits) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float v) {
  const uint32_t u = float_bits(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  return __nv_bfloat16{static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};  // nearest even
}
inline __nv_bfloat16 __float2bfloat16(float v) { return __float2bfloat16_rn(v); }

inline float __int_as_float(int v) { return bits_float(static_cast<uint32_t>(v)); }
inline int __float_as_int(float v) { return static_cast<int>(float_bits(v)); }
template <class T>
inline T __ldg(const T* p) {
  return *p;
}

namespace emu {

// Seconds a barrier may wait before the run is declared deadlocked.
constexpr int kDeadlockSeconds = 60;
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxGridYZ = 65535;

enum class Error { kSuccess, kInvalidConfiguration };

inline const char* error_string(Error e) {
  return e == Error::kSuccess ? "no error" : "invalid launch configuration (block or grid size)";
}

namespace detail {

struct Site {
  const char* file;
  int line;
  bool operator!=(const Site& o) const { return line != o.line || std::strcmp(file, o.file) != 0; }
};

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "simt emulation: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

// Arrival bookkeeping of one barrier (both schedulers): all arrivals of a phase must come from
// one call site; threads that finished the kernel no longer count.
class BarrierState {
 public:
  void reset(int expected, const char* name) {
    expected_ = expected;
    arrived_ = 0;
    name_ = name;
  }
  // Records an arrival; true if it completes the phase.
  bool arrive(Site site) {
    if (arrived_ == 0) {
      site_ = site;
    } else if (site_ != site) {
      char msg[1024];
      std::snprintf(msg, sizeof msg, "divergent %s: a thread waits at %s:%d while others wait at %s:%d",
                    name_, site.file, site.line, site_.file, site_.line);
      fail(msg);
    }
    if (++arrived_ < expected_) return false;
    arrived_ = 0;
    return true;
  }
  // A thread finished; true if the waiting threads now complete the phase.
  bool drop() {
    --expected_;
    if (arrived_ == 0 || arrived_ < expected_) return false;
    arrived_ = 0;
    return true;
  }
  [[noreturn]] void deadlock() const {
    char msg[1024];
    std::snprintf(msg, sizeof msg, "deadlock at %s %s:%d: %d of %d threads arrived", name_, site_.file,
                  site_.line, arrived_, expected_);
    fail(msg);
  }

 private:
  int expected_ = 0;
  int arrived_ = 0;
  Site site_{"", 0};
  const char* name_ = "";
};

#ifndef SIMT_FIBERS
// ---- scheduler: one OS thread per CUDA thread ---------------------------------------------------
// Waits use futexes on atomic counters: a condition variable makes every woken thread queue on its
// mutex, which costs milliseconds per barrier with 128 threads on two cores.
inline void futex_wait(std::atomic<uint32_t>& a, uint32_t old, const timespec* timeout) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&a), FUTEX_WAIT_PRIVATE, old, timeout, nullptr, 0);
}
inline void futex_wake(std::atomic<uint32_t>& a, int n) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&a), FUTEX_WAKE_PRIVATE, n, nullptr, nullptr, 0);
}
// Blocks while a == old; false if that lasted kDeadlockSeconds.
inline bool wait_change(std::atomic<uint32_t>& a, uint32_t old, bool bounded) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kDeadlockSeconds);
  const timespec step{1, 0};
  while (a.load(std::memory_order_acquire) == old) {
    futex_wait(a, old, bounded ? &step : nullptr);
    if (bounded && std::chrono::steady_clock::now() > deadline)
      return a.load(std::memory_order_acquire) != old;
  }
  return true;
}

class Barrier {
 public:
  void reset(int expected, const char* name) {
    std::lock_guard<std::mutex> lk(mu_);
    state_.reset(expected, name);
  }
  void arrive_and_wait(Site site) {
    uint32_t gen;
    {
      std::lock_guard<std::mutex> lk(mu_);
      gen = generation_.load(std::memory_order_relaxed);
      if (state_.arrive(site)) return release(gen);
    }
    if (!wait_change(generation_, gen, true)) {
      std::lock_guard<std::mutex> lk(mu_);
      state_.deadlock();
    }
  }
  void drop() {
    std::lock_guard<std::mutex> lk(mu_);
    if (state_.drop()) release(generation_.load(std::memory_order_relaxed));
  }

 private:
  void release(uint32_t gen) {
    generation_.store(gen + 1, std::memory_order_release);
    futex_wake(generation_, INT32_MAX);
  }
  std::mutex mu_;
  BarrierState state_;
  std::atomic<uint32_t> generation_{0};
};
#else
class Barrier;
void block_current_fiber(Barrier* on);
void make_ready(int fiber);
int current_fiber();

// ---- scheduler: fibers (ucontext) on the launching thread ---------------------------------------
// Deterministic and much faster than OS threads; a fiber runs until it waits at a barrier.
class Barrier {
 public:
  void reset(int expected, const char* name) {
    state_.reset(expected, name);
    waiting_.clear();
  }
  void arrive_and_wait(Site site) {
    if (state_.arrive(site)) return release();
    waiting_.push_back(current_fiber());
    block_current_fiber(this);
  }
  void drop() {
    if (state_.drop()) release();
  }
  const BarrierState& state() const { return state_; }

 private:
  void release() {
    for (int f : waiting_) make_ready(f);
    waiting_.clear();
  }
  BarrierState state_;
  std::vector<int> waiting_;
};
#endif

// Per-warp state: the warp barrier and the slots shuffles exchange values through.
struct Warp {
  Barrier barrier;
  alignas(16) unsigned char slots[warpSize][16];
  int lanes = 0;
};

// Like CUDA's per-host-thread error state.
inline thread_local Error last_launch_error = Error::kSuccess;

struct ThreadContext {
  Warp* warp = nullptr;
  int lane = 0;
};
inline thread_local ThreadContext tls;

// What both schedulers share: the warps of the block and the per-thread context.
class RuntimeBase {
 public:
  std::mutex launch_mu;  // one launch at a time: __shared__ statics and the scheduler are global

  void sync_block(Site site) { block_barrier_.arrive_and_wait(site); }

 protected:
  void reset_barriers(int nthreads) {
    block_barrier_.reset(nthreads, "__syncthreads");
    while (static_cast<int>(warps_.size()) * warpSize < nthreads) warps_.push_back(std::make_unique<Warp>());
    for (int w = 0; w * warpSize < nthreads; ++w) {
      warps_[w]->lanes = std::min(warpSize, nthreads - w * warpSize);
      warps_[w]->barrier.reset(warps_[w]->lanes, "warp collective");
    }
  }
  void enter_thread(int id) {
    const unsigned bx = blockDim.x, by = blockDim.y;
    threadIdx = uint3{id % bx, (id / bx) % by, id / (bx * by)};
    tls.warp = warps_[id / warpSize].get();
    tls.lane = id % warpSize;
  }
  void leave_thread() {
    tls.warp->barrier.drop();
    block_barrier_.drop();
  }

  Barrier block_barrier_;
  // Grown by the launching thread while no kernel thread runs; elements never move.
  std::vector<std::unique_ptr<Warp>> warps_;
  const std::function<void()>* body_ = nullptr;
};

#ifndef SIMT_FIBERS
// A pool of OS threads, grown to the largest block seen, that play one block at a time.
class Runtime : public RuntimeBase {
 public:
  void run_block(int nthreads, const std::function<void()>& body) {
    reset_barriers(nthreads);
    while (static_cast<int>(slots_.size()) < nthreads) {
      slots_.push_back(std::make_unique<std::atomic<uint32_t>>(0));
      const int id = static_cast<int>(slots_.size()) - 1;
      std::atomic<uint32_t>* go = slots_.back().get();
      std::thread([this, id, go] { worker(id, *go); }).detach();  // lives as long as the process
    }
    body_ = &body;
    remaining_.store(static_cast<uint32_t>(nthreads), std::memory_order_relaxed);
    for (int i = 0; i < nthreads; ++i) {
      slots_[i]->fetch_add(1, std::memory_order_release);
      futex_wake(*slots_[i], 1);
    }
    for (uint32_t r; (r = remaining_.load(std::memory_order_acquire)) != 0;)
      futex_wait(remaining_, r, nullptr);
  }

 private:
  void worker(int id, std::atomic<uint32_t>& go) {
    uint32_t seen = 0;
    for (;;) {
      wait_change(go, seen, false);
      seen = go.load(std::memory_order_acquire);
      enter_thread(id);
      (*body_)();
      leave_thread();
      if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) futex_wake(remaining_, 1);
    }
  }

  // Wake-up counters, one per worker; a worker holds a pointer to its own (a stable heap object).
  std::vector<std::unique_ptr<std::atomic<uint32_t>>> slots_;
  std::atomic<uint32_t> remaining_{0};
};
#else
class Runtime : public RuntimeBase {
 public:
  void run_block(int nthreads, const std::function<void()>& body) {
    reset_barriers(nthreads);
    while (static_cast<int>(fibers_.size()) < nthreads) fibers_.push_back(std::make_unique<Fiber>());
    body_ = &body;
    for (int i = 0; i < nthreads; ++i) {
      Fiber& f = *fibers_[i];
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.get();
      f.ctx.uc_stack.ss_size = kStackBytes;
      f.ctx.uc_link = &scheduler_;
      makecontext(&f.ctx, &Runtime::fiber_main, 0);
      f.state = kReady;
    }
    live_ = nthreads;
    // Always resume the lowest-numbered ready thread (the highest in every other block): low
    // threads run ahead of high ones as far as the barriers allow, then the other way round, so a
    // read of data another thread writes before a missing barrier sees stale data in one of them.
    const bool upward = (blockIdx.x + blockIdx.y + blockIdx.z) % 2 == 0;
    while (live_ > 0) {
      int next = -1;
      for (int j = 0; j < nthreads && next < 0; ++j) {
        const int i = upward ? j : nthreads - 1 - j;
        if (fibers_[i]->state == kReady) next = i;
      }
      if (next < 0) {  // every live thread waits at a barrier that cannot complete
        for (int i = 0; i < nthreads; ++i)
          if (fibers_[i]->state == kBlocked) fibers_[i]->waiting_on->state().deadlock();
      }
      current_ = next;
      enter_thread(next);
      swapcontext(&scheduler_, &fibers_[next]->ctx);
    }
  }
  void block_current(Barrier* on) {
    Fiber& f = *fibers_[current_];
    f.state = kBlocked;
    f.waiting_on = on;
    swapcontext(&f.ctx, &scheduler_);
  }
  void make_ready(int i) { fibers_[i]->state = kReady; }
  int current() const { return current_; }

 private:
  static constexpr size_t kStackBytes = 256 * 1024;
  enum State { kReady, kBlocked, kDone };
  struct Fiber {
    ucontext_t ctx;
    std::unique_ptr<char[]> stack{new char[kStackBytes]};
    State state = kDone;
    Barrier* waiting_on = nullptr;
  };
  static void fiber_main();

  std::vector<std::unique_ptr<Fiber>> fibers_;
  ucontext_t scheduler_;
  int current_ = 0;
  int live_ = 0;
  void finish() {
    fibers_[current_]->state = kDone;
    --live_;
    leave_thread();
  }
};
#endif

inline Runtime& runtime() {
  static Runtime* rt = new Runtime;  // never destroyed: pool threads stay parked until exit
  return *rt;
}

#ifdef SIMT_FIBERS
inline void block_current_fiber(Barrier* on) { runtime().block_current(on); }
inline void make_ready(int fiber) { runtime().make_ready(fiber); }
inline int current_fiber() { return runtime().current(); }
inline void Runtime::fiber_main() {
  Runtime& rt = runtime();
  (*rt.body_)();
  rt.finish();  // returning switches to uc_link, the scheduler
}
#endif

inline void warp_sync(Site site) { tls.warp->barrier.arrive_and_wait(site); }

// Every lane publishes `value` and reads lane `src` (or keeps its own value if src < 0).
template <class T>
T warp_exchange(T value, int src, Site site) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 16, "shuffle of an unsupported type");
  Warp& w = *tls.warp;
  std::memcpy(w.slots[tls.lane], &value, sizeof(T));
  warp_sync(site);
  T out = value;
  if (src >= 0 && src < w.lanes) std::memcpy(&out, w.slots[src], sizeof(T));
  warp_sync(site);  // nobody overwrites a slot before every lane has read
  return out;
}

}  // namespace detail

// Returns and clears the error of the last failed launch from this host thread.
inline Error last_error() {
  Error e = detail::last_launch_error;
  detail::last_launch_error = Error::kSuccess;
  return e;
}

// kernel<<<grid, block>>>(args...): arguments are converted once to the parameter types; each
// thread receives its own copy, as kernel parameters are per thread on a GPU.
template <class... P, class... A>
void launch(dim3 grid, dim3 block, void (*kernel)(P...), A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "wrong number of kernel arguments");
  std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
  detail::Runtime& rt = detail::runtime();
  std::lock_guard<std::mutex> guard(rt.launch_mu);
  const unsigned long long nthreads = 1ull * block.x * block.y * block.z;
  if (nthreads == 0 || nthreads > kMaxThreadsPerBlock || block.z > 64 || grid.x == 0 ||
      grid.y == 0 || grid.z == 0 || grid.y > kMaxGridYZ || grid.z > kMaxGridYZ) {
    detail::last_launch_error = Error::kInvalidConfiguration;
    return;
  }
  gridDim = grid;
  blockDim = block;
  const std::function<void()> body = [&] { std::apply(kernel, params); };
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = uint3{x, y, z};
        rt.run_block(static_cast<int>(nthreads), body);
      }
}

}  // namespace emu

// ---------------------------------------------------------------------------------------------
// Synchronisation. Default arguments capture the call site of the kernel code.
inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  emu::detail::runtime().sync_block({file, line});
}
inline void __syncwarp(unsigned /*mask*/ = 0xffffffffu, const char* file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
  emu::detail::warp_sync({file, line});
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// Shuffles; `width` splits the warp into segments as on the GPU.
template <class T>
T __shfl_sync(unsigned /*mask*/, T var, int src_lane, int width = warpSize,
              const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  const int lane = emu::detail::tls.lane;
  const int src = (lane & ~(width - 1)) + (src_lane & (width - 1));
  return emu::detail::warp_exchange(var, src, {file, line});
}
template <class T>
T __shfl_down_sync(unsigned /*mask*/, T var, unsigned delta, int width = warpSize,
                   const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  const int lane = emu::detail::tls.lane;
  const int in_seg = (lane & (width - 1)) + static_cast<int>(delta);
  return emu::detail::warp_exchange(var, in_seg < width ? lane + static_cast<int>(delta) : -1,
                                    {file, line});
}
template <class T>
T __shfl_up_sync(unsigned /*mask*/, T var, unsigned delta, int width = warpSize,
                 const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  const int lane = emu::detail::tls.lane;
  const int in_seg = (lane & (width - 1)) - static_cast<int>(delta);
  return emu::detail::warp_exchange(var, in_seg >= 0 ? lane - static_cast<int>(delta) : -1,
                                    {file, line});
}
template <class T>
T __shfl_xor_sync(unsigned /*mask*/, T var, int lane_mask, int width = warpSize,
                  const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  const int lane = emu::detail::tls.lane;
  const int src = lane ^ lane_mask;
  // Lanes may read earlier segments but not later ones (they keep their own value).
  const bool ok = (src & ~(width - 1)) <= (lane & ~(width - 1));
  return emu::detail::warp_exchange(var, ok ? src : -1, {file, line});
}

// Atomics: relaxed read-modify-writes, as on the GPU; they return the old value.
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline float atomicAdd(float* p, float v) {
  uint32_t* u = reinterpret_cast<uint32_t*>(p);
  uint32_t old = __atomic_load_n(u, __ATOMIC_RELAXED), next;
  do {
    float f;
    std::memcpy(&f, &old, 4);
    f += v;
    std::memcpy(&next, &f, 4);
  } while (!__atomic_compare_exchange_n(u, &old, next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
  uint32_t prev = old;
  float r;
  std::memcpy(&r, &prev, 4);
  return r;
}
inline int atomicOr(int* p, int v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
inline int atomicCAS(int* p, int expected, int desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return expected;
}
inline int atomicMax(int* p, int v) {
  int old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (old < v &&
         !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}

// ---------------------------------------------------------------------------------------------
// nvcuda::wmma, shape m16n16k16, __half / __nv_bfloat16 inputs, float accumulators.
namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

namespace detail {
template <class Use, int M, int N, int K>
struct extent;
template <int M, int N, int K>
struct extent<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct extent<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct extent<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N;
};

inline float to_float(float v) { return v; }
inline float to_float(__half v) { return __half2float(v); }
inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T>
T from_float(float v) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(v);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return static_cast<T>(v);
  }
}

template <class T>
void check_pointer(const T* p, unsigned ldm, const char* op) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0)
    emu::detail::fail((std::string("wmma::") + op + ": pointer not 256-bit aligned").c_str());
  if ((ldm * sizeof(T)) % 16 != 0)
    emu::detail::fail((std::string("wmma::") + op + ": ldm * sizeof(T) not a multiple of 16 bytes").c_str());
}
}  // namespace detail

template <class Use, int M, int N, int K, class T, class Layout = void>
class fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulation covers m16n16k16 only");

 public:
  static constexpr int rows = detail::extent<Use, M, N, K>::rows;
  static constexpr int cols = detail::extent<Use, M, N, K>::cols;
  static constexpr int num_elements = rows * cols;
  T x[num_elements];  // the whole tile, row-major
};

template <class Use, int M, int N, int K, class T, class L>
void fill_fragment(fragment<Use, M, N, K, T, L>& f, T v) {
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = v;
}

template <class Use, int M, int N, int K, class T, class L>
void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, const T* p, unsigned ldm,
                      const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(std::is_same_v<L, row_major> || std::is_same_v<L, col_major>,
                "matrix_a/matrix_b fragments need a layout");
  emu::detail::warp_sync({file, line});
  detail::check_pointer(p, ldm, "load_matrix_sync");
  using F = fragment<Use, M, N, K, T, L>;
  for (int r = 0; r < F::rows; ++r)
    for (int c = 0; c < F::cols; ++c)
      f.x[r * F::cols + c] = std::is_same_v<L, row_major> ? p[r * ldm + c] : p[r + c * ldm];
}

template <int M, int N, int K>
void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const float* p, unsigned ldm,
                      layout_t layout, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  emu::detail::warp_sync({file, line});
  detail::check_pointer(p, ldm, "load_matrix_sync");
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c)
      f.x[r * N + c] = layout == mem_row_major ? p[r * ldm + c] : p[r + c * ldm];
}

template <int M, int N, int K>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm,
                       layout_t layout, const char* file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
  emu::detail::warp_sync({file, line});
  detail::check_pointer(p, ldm, "store_matrix_sync");
  if (emu::detail::tls.lane != 0) return;
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) (layout == mem_row_major ? p[r * ldm + c] : p[r + c * ldm]) = f.x[r * N + c];
}

template <int M, int N, int K, class T, class LA, class LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, T, LA>& a,
              const fragment<matrix_b, M, N, K, T, LB>& b,
              const fragment<accumulator, M, N, K, float>& c, const char* file = __builtin_FILE(),
              int line = __builtin_LINE()) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                "the emulation covers half and bfloat16 inputs");
  emu::detail::warp_sync({file, line});
  float fa[M * K], fb[K * N], out[M * N];
  for (int i = 0; i < M * K; ++i) fa[i] = detail::to_float(a.x[i]);
  for (int i = 0; i < K * N; ++i) fb[i] = detail::to_float(b.x[i]);
  // k-outer loop order: vectorisable, and each out[i][j] still adds its products in k order
  for (int i = 0; i < M * N; ++i) out[i] = c.x[i];
  for (int i = 0; i < M; ++i)
    for (int k = 0; k < K; ++k)
      for (int j = 0; j < N; ++j) out[i * N + j] += fa[i * K + k] * fb[k * N + j];
  std::memcpy(d.x, out, sizeof out);  // d may alias c
}

}  // namespace wmma
}  // namespace nvcuda
