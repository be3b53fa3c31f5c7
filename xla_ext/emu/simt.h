// SIMT emulation: compiles CUDA kernel sources with a host C++17 compiler and runs them on the CPU,
// checking what a GPU would let pass silently.
//
// ======================= Writing kernels the emulation can run and check =======================
// (docs/emulation.md says the same with examples.) Kernel sources include "emu/simt_api.h", which
// gives the CUDA headers on the device and this file on the host, and follow these rules; each
// construct below is plain CUDA on the device.
//
// 1. Shared memory is declared with SIMT_SHARED or SIMT_SHARED_ALIGNED; `__shared__` itself does
//    not compile on the host:
//        SIMT_SHARED_ALIGNED(T[kRows * kTile], xs, 32);  // __shared__ __align__(32) T xs[kRows*kTile]
//        SIMT_SHARED(float[kWarps][kLanes], red);         // __shared__ float red[kWarps][kLanes]
//        SIMT_SHARED(int32_t, count);                     // __shared__ int32_t count
//    On the host every resident block gets its own copy, filled with a poison pattern when the
//    block starts. Each access is checked: an index outside the array, a misaligned access, and a
//    read of bytes no thread of this block has written are reported, naming the kernel, the array
//    and the element. The names are proxies on the host, so:
//      - index, assign, compound-assign and read them as usual, but read an element into a typed
//        variable (`const float v = red[w][l];`), never `auto v = red[w][l];` (a proxy that reads
//        later);
//      - pointers into shared memory are `auto p = xs + i;` / `&xs[i]`, or `simt::shared_ptr<T>`
//        (T* on the device) as a parameter type; a `T*` cannot point into shared memory;
//      - reinterpret with `simt::pointer_cast<U>(p)` (e.g. 16-byte copies as uint4), never
//        reinterpret_cast; the access must be aligned for U, as on the GPU;
//      - whole elements only: no `sizeof(name)`, no member access of a struct in place.
//    wmma::load_matrix_sync / store_matrix_sync and the atomics take these pointers and check every
//    element they touch.
// 2. A kernel *output* - memory the launch sequence must write exactly once per element, declared
//    by the host code with `launch.output(ptr, count, row_length, "name")` - is written only with
//        simt::store(&out[i], value);                     // out[i] = value on the device
//    The emulated launcher keeps the writer of every element: a second store to an element, and a
//    store outside every output of the sequence, are reported with the output's name, the element
//    and both storing call sites (function, file:line); when the sequence ends (status()/finish())
//    an element nobody wrote is reported. Scratch memory (workspace counters, lists) takes plain
//    stores; a memset through the launcher is the one write of the output elements it covers.
// 3. No inline PTX, dynamic (extern) shared memory, cooperative groups or grid-wide sync, and no
//    reliance on the order of blocks or on shared memory outliving a block: blocks run in a
//    shuffled order (seeded; the seed is printed with every report, emu::set_schedule changes it),
//    several of them at once, interleaved.
//
// How problems surface. The checks above are *reports*: the first one is kept, no further block is
// started, and emu::last_error() / last_error_message() return it after the launch (EmuLauncher
// turns it into the handlers' ffi::Error, i.e. a Python exception). A divergent barrier or a
// deadlock cannot be continued and aborts the process with a message.
//
// What else is modelled:
// * Threads: by default real OS threads (a persistent pool per resident block), so ThreadSanitizer
//   sees the races a missing barrier causes. With -DSIMT_FIBERS they are ucontext fibers on the
//   launching thread: deterministic (a fiber runs until it waits at a barrier; low threads run
//   ahead of high ones, or the reverse, see Runtime::pick), several times faster, invisible to TSan.
// * `__syncthreads()` is a block barrier that records the call site: threads arriving at different
//   `__syncthreads` in the same phase abort with both locations. A thread that returns from the
//   kernel leaves the barrier, as on hardware. A barrier that cannot complete (fibers) or does not
//   within kDeadlockSeconds (threads) aborts.
// * Warp collectives (`__syncwarp`, `__shfl*_sync`, `nvcuda::wmma::*_sync`) rendezvous the lanes of
//   the warp at a warp barrier with the same divergence check. The `mask` arguments are ignored:
//   all lanes of the warp must participate.
// * `nvcuda::wmma` m16n16k16 with half or bfloat16 inputs and float accumulators. Each lane keeps
//   the whole tile in its fragment (`num_elements` = rows * cols, a different element mapping from
//   the GPU's) and computes the whole product in float, adding the products in k order. Loads and
//   stores check the 256-bit pointer alignment and the `ldm` rule; `store_matrix_sync` writes from
//   lane 0 only, so a read of stored data by another lane without `__syncwarp` is a race here too.
// * `cudaGetLastError` analogue: emu::last_error() reports an invalid launch configuration.
//
// Not modelled: inline PTX, cooperative groups, grid-wide sync, dynamic shared memory, streams.
// Missing builtins fail at compile time, which is the point. Linux only (futexes, ucontext).
#pragma once

#ifdef __CUDACC__
#error "simt.h emulates CUDA on the host; device builds include the CUDA headers instead"
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
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
// Shared memory must be declared with SIMT_SHARED / SIMT_SHARED_ALIGNED (see the top of this file).
#define __shared__ static_assert(false, "declare shared memory with SIMT_SHARED(type, name) (emu/simt.h)");
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// CUDA's vector types with their alignment (for 8- and 16-byte copies).
struct __attribute__((aligned(8))) int2 {
  int x, y;
};
struct __attribute__((aligned(16))) int4 {
  int x, y, z, w;
};
struct __attribute__((aligned(8))) uint2 {
  unsigned x, y;
};
struct __attribute__((aligned(16))) uint4 {
  unsigned x, y, z, w;
};
struct __attribute__((aligned(8))) float2 {
  float x, y;
};
struct __attribute__((aligned(16))) float4 {
  float x, y, z, w;
};

// Launch-wide sizes are written by the launching thread while no kernel thread runs; the block and
// thread indices are per (emulated) thread, as several blocks run at once.
inline dim3 blockDim;
inline dim3 gridDim;
inline thread_local uint3 blockIdx;
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

enum class Error { kSuccess, kInvalidConfiguration, kCheckFailed };

inline const char* error_string(Error e) {
  switch (e) {
    case Error::kSuccess: return "no error";
    case Error::kInvalidConfiguration: return "invalid launch configuration (block or grid size)";
    default: return "an emulation check failed";
  }
}

class OutputCheck;

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

template <class... A>
std::string format(const char* fmt, A... args) {
  const int n = std::snprintf(nullptr, 0, fmt, args...);
  std::string s(static_cast<size_t>(n), '\0');
  std::snprintf(s.data(), s.size() + 1, fmt, args...);
  return s;
}

// "a/b/c/file.cuh" -> "c/file.cuh": enough to find the line, short enough to read.
inline std::string short_path(const char* file) {
  const std::string f(file);
  const size_t last = f.rfind('/');
  if (last == std::string::npos || last == 0) return f;
  const size_t prev = f.rfind('/', last - 1);
  return prev == std::string::npos ? f : f.substr(prev + 1);
}

// __PRETTY_FUNCTION__ of a kernel -> "name [with T = ...]" without return and parameter types.
inline std::string kernel_name(const char* pretty) {
  const std::string p(pretty);
  const size_t paren = p.find('(');
  const size_t space = p.rfind(' ', paren);
  std::string name = p.substr(space == std::string::npos ? 0 : space + 1, paren - (space + 1));
  const size_t with = p.find("[with ");
  if (with != std::string::npos) name += " " + p.substr(with);
  return name;
}

// The schedule of every launch: the blocks of a grid are shuffled with a generator seeded from
// `seed` and the grid's shape, and up to `resident` blocks run at a time.
struct Schedule {
  uint64_t seed = 0x5eed;
  int resident = 3;
};
inline Schedule& schedule() {
  static Schedule s;
  return s;
}

// What one launch has found: the first report (later ones are counted), and the outputs its
// stores are checked against.
struct LaunchState {
  std::mutex mu;
  std::string first;
  int reports = 0;
  std::atomic<bool> failed{false};
  OutputCheck* outputs = nullptr;
};

// ---- shared memory -----------------------------------------------------------------------------
// One SIMT_SHARED declaration (one per kernel instantiation: a function-local static).
struct SharedDecl {
  const char* name;
  const char* type;
  const char* function;  // __PRETTY_FUNCTION__ of the declaring kernel
  const char* file;
  int line;
  size_t elem_size, count, align;
  int rank;
  size_t extent[4];
};

template <class A>
SharedDecl make_decl(const char* name, const char* type, const char* function, const char* file,
                     int line, size_t align) {
  using E = std::remove_all_extents_t<A>;
  static_assert(std::rank_v<A> <= 4, "shared arrays of rank > 4");
  static_assert(std::is_trivially_copyable_v<E>, "shared memory holds trivially copyable types");
  SharedDecl d{name, type, function, file, line, sizeof(E), sizeof(A) / sizeof(E),
               std::max(align, alignof(E)), static_cast<int>(std::rank_v<A>), {0, 0, 0, 0}};
  if constexpr (std::rank_v<A> > 0) d.extent[0] = std::extent_v<A, 0>;
  if constexpr (std::rank_v<A> > 1) d.extent[1] = std::extent_v<A, 1>;
  if constexpr (std::rank_v<A> > 2) d.extent[2] = std::extent_v<A, 2>;
  if constexpr (std::rank_v<A> > 3) d.extent[3] = std::extent_v<A, 3>;
  return d;
}

constexpr unsigned char kPoison = 0xff;  // NaN in every float type, -1 in every integer type

// The copy of one declaration in one resident block. `written` has one byte per byte of data.
struct SharedArray {
  const SharedDecl* decl;
  size_t bytes;
  unsigned char* data;
  std::unique_ptr<unsigned char[]> raw, written;
  uint64_t generation = 0;

  explicit SharedArray(const SharedDecl* d) : decl(d), bytes(d->elem_size * d->count) {
    // Aligned to exactly the declared alignment and not to twice it, so that a kernel relying on
    // more alignment than it declared (a wmma pointer into an array declared without
    // __align__(32)) fails here even where the GPU's layout happens to give it.
    const size_t a = d->align;
    raw.reset(new unsigned char[bytes + 2 * a]);
    const uintptr_t base = reinterpret_cast<uintptr_t>(raw.get());
    const uintptr_t at = (base + a + 2 * a - 1) / (2 * a) * (2 * a) - a;
    data = raw.get() + (at >= base ? at - base : at + 2 * a - base);
    written.reset(new unsigned char[bytes]);
  }
};

// The shared memory of one resident block. A new block bumps the generation; each array is
// poisoned when the new block first binds it (before any thread of that block can touch it).
class SharedStore {
 public:
  void begin_block() { ++generation_; }
  SharedArray* bind(const SharedDecl* d) {
    std::lock_guard<std::mutex> lk(mu_);
    SharedArray* a = nullptr;
    for (auto& p : arrays_)
      if (p->decl == d) a = p.get();
    if (a == nullptr) {
      arrays_.push_back(std::make_unique<SharedArray>(d));
      a = arrays_.back().get();
    }
    if (a->generation != generation_) {
      std::memset(a->data, kPoison, a->bytes);
      std::memset(a->written.get(), 0, a->bytes);
      a->generation = generation_;
    }
    return a;
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<SharedArray>> arrays_;
  uint64_t generation_ = 0;
};

// ---- barriers ----------------------------------------------------------------------------------
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
      fail(format("divergent %s: a thread waits at %s:%d while others wait at %s:%d", name_, site.file,
                  site.line, site_.file, site_.line)
               .c_str());
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
    fail(format("deadlock at %s %s:%d: %d of %d threads arrived", name_, site_.file, site_.line,
                arrived_, expected_)
             .c_str());
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
struct Fiber;
class Barrier;
void block_current_fiber(Barrier* on);
void make_ready(Fiber* fiber);
Fiber* current_fiber();

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
    for (Fiber* f : waiting_) make_ready(f);
    waiting_.clear();
  }
  BarrierState state_;
  std::vector<Fiber*> waiting_;
};
#endif

// Per-warp state: the warp barrier and the slots shuffles exchange values through.
struct Warp {
  Barrier barrier;
  alignas(16) unsigned char slots[warpSize][16];
  int lanes = 0;
};

// A thread's cp.async copies not yet landed: the open group and the committed groups, oldest
// first. A copy lands (its bytes are written to shared memory) only when a wait retires its group,
// so a read that a kernel's pipeline lets run ahead of its wait finds the old bytes, as it may on
// the GPU.
struct AsyncCopy {
  SharedArray* array;
  ptrdiff_t offset;
  uint4 value;
};
struct AsyncCopies {
  std::vector<AsyncCopy> open;
  std::deque<std::vector<AsyncCopy>> committed;
};

// One resident block: what its threads share.
struct Block {
  uint3 idx{0, 0, 0};
  Barrier barrier;
  std::vector<std::unique_ptr<Warp>> warps;  // grown while no thread of the block runs
  SharedStore shared;
  std::vector<AsyncCopies> copies;  // per thread of the block
  bool upward = true;  // fibers: which end of the block runs ahead

  void begin(uint3 i, int nthreads) {
    idx = i;
    barrier.reset(nthreads, "__syncthreads");
    copies.resize(nthreads);
    for (AsyncCopies& c : copies) {
      c.open.clear();
      c.committed.clear();
    }
    while (static_cast<int>(warps.size()) * warpSize < nthreads) warps.push_back(std::make_unique<Warp>());
    for (int w = 0; w * warpSize < nthreads; ++w) {
      warps[w]->lanes = std::min(warpSize, nthreads - w * warpSize);
      warps[w]->barrier.reset(warps[w]->lanes, "warp collective");
    }
    shared.begin_block();
    upward = (i.x + i.y + i.z) % 2 == 0;
  }
};

// Like CUDA's per-host-thread error state.
inline thread_local Error last_launch_error = Error::kSuccess;
inline thread_local std::string last_launch_message;

struct ThreadContext {
  Block* block = nullptr;
  Warp* warp = nullptr;
  int lane = 0;
  const char* op = nullptr;  // the collective being checked (wmma), for reports
  Site op_site{"", 0};
};
inline thread_local ThreadContext tls;

inline void enter_thread(Block& b, int id) {
  const unsigned bx = blockDim.x, by = blockDim.y;
  threadIdx = uint3{id % bx, (id / bx) % by, id / (bx * by)};
  blockIdx = b.idx;
  tls.block = &b;
  tls.warp = b.warps[id / warpSize].get();
  tls.lane = id % warpSize;
}
inline void leave_thread() {
  tls.warp->barrier.drop();
  tls.block->barrier.drop();
}

// The running thread's cp.async copies.
inline AsyncCopies& thread_copies() {
  if (tls.block == nullptr) fail("cp.async outside a kernel launched by emu::launch");
  return tls.block->copies[threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)];
}

// What both schedulers share.
class RuntimeBase {
 public:
  std::mutex launch_mu;          // one launch at a time: the scheduler and launch state are global
  LaunchState* launch = nullptr;  // the running launch, set while holding launch_mu

 protected:
  const std::function<void()>* body_ = nullptr;
  bool stopped() const { return launch != nullptr && launch->failed.load(std::memory_order_relaxed); }
};

#ifndef SIMT_FIBERS
// Resident blocks ("slots"), each with a pool of OS threads grown to the largest block seen; the
// launching thread starts a block in a slot whenever one finishes.
class Runtime : public RuntimeBase {
 public:
  void run_grid(const std::vector<uint3>& order, int nthreads, int resident, uint64_t /*seed*/,
                const std::function<void()>& body) {
    body_ = &body;
    while (static_cast<int>(slots_.size()) < resident) slots_.push_back(std::make_unique<Slot>());
    size_t next = 0;
    int active = 0;
    std::vector<char> busy(resident, 0);
    auto dispatch = [&](int s) {
      if (next >= order.size() || stopped()) return;
      start(*slots_[s], order[next++], nthreads);
      busy[s] = 1;
      ++active;
    };
    for (int s = 0; s < resident; ++s) dispatch(s);
    while (active > 0) {
      const uint32_t seen = finished_.load(std::memory_order_acquire);
      bool progressed = false;
      for (int s = 0; s < resident; ++s)
        if (busy[s] && slots_[s]->remaining.load(std::memory_order_acquire) == 0) {
          busy[s] = 0;
          --active;
          progressed = true;
          dispatch(s);
        }
      if (!progressed) futex_wait(finished_, seen, nullptr);
    }
  }

 private:
  struct Slot {
    Block block;
    std::vector<std::unique_ptr<std::atomic<uint32_t>>> go;  // wake-up counters, one per worker
    std::atomic<uint32_t> remaining{0};
  };

  void start(Slot& s, uint3 idx, int nthreads) {
    s.block.begin(idx, nthreads);
    while (static_cast<int>(s.go.size()) < nthreads) {
      s.go.push_back(std::make_unique<std::atomic<uint32_t>>(0));
      const int id = static_cast<int>(s.go.size()) - 1;
      std::atomic<uint32_t>* go = s.go.back().get();
      Slot* slot = &s;
      std::thread([this, slot, id, go] { worker(*slot, id, *go); }).detach();  // lives until exit
    }
    s.remaining.store(static_cast<uint32_t>(nthreads), std::memory_order_relaxed);
    for (int i = 0; i < nthreads; ++i) {
      s.go[i]->fetch_add(1, std::memory_order_release);
      futex_wake(*s.go[i], 1);
    }
  }

  void worker(Slot& s, int id, std::atomic<uint32_t>& go) {
    uint32_t seen = 0;
    for (;;) {
      wait_change(go, seen, false);
      seen = go.load(std::memory_order_acquire);
      enter_thread(s.block, id);
      (*body_)();
      leave_thread();
      if (s.remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        finished_.fetch_add(1, std::memory_order_release);
        futex_wake(finished_, INT32_MAX);
      }
    }
  }

  std::vector<std::unique_ptr<Slot>> slots_;  // elements never move
  std::atomic<uint32_t> finished_{0};
};
#else
struct Fiber {
  static constexpr size_t kStackBytes = 256 * 1024;
  enum State { kReady, kBlocked, kDone };
  ucontext_t ctx;
  std::unique_ptr<char[]> stack{new char[kStackBytes]};
  State state = kDone;
  Barrier* waiting_on = nullptr;
  Block* block = nullptr;
  int slot = 0;
  int id = 0;
};

// Resident blocks ("slots"), each with its fibers. The scheduler resumes one ready fiber at a
// time: it picks a slot at random (seeded), and in it the lowest-numbered ready thread (the
// highest in every other block), so low threads run ahead of high ones as far as the barriers
// allow, then the other way round - a read of data another thread writes before a missing
// barrier sees stale data in one of them - while the blocks interleave at every barrier.
class Runtime : public RuntimeBase {
 public:
  void run_grid(const std::vector<uint3>& order, int nthreads, int resident, uint64_t seed,
                const std::function<void()>& body) {
    body_ = &body;
    while (static_cast<int>(slots_.size()) < resident) slots_.push_back(std::make_unique<Slot>());
    std::mt19937_64 rng(seed);
    size_t next = 0;
    int active = 0;
    auto dispatch = [&](int s) {
      if (next >= order.size() || stopped()) return;
      start(s, order[next++], nthreads);
      ++active;
    };
    for (int s = 0; s < resident; ++s) dispatch(s);
    while (active > 0) {
      const int first = static_cast<int>(rng() % static_cast<uint64_t>(resident));
      Fiber* f = nullptr;
      for (int j = 0; j < resident && f == nullptr; ++j) f = pick(*slots_[(first + j) % resident], nthreads);
      current_ = f;
      enter_thread(*f->block, f->id);
      swapcontext(&scheduler_, &f->ctx);
      Slot& s = *slots_[f->slot];
      if (s.live == 0 && s.busy) {
        s.busy = false;
        --active;
        dispatch(f->slot);
      }
    }
  }
  void block_current(Barrier* on) {
    Fiber& f = *current_;
    f.state = Fiber::kBlocked;
    f.waiting_on = on;
    swapcontext(&f.ctx, &scheduler_);
  }
  Fiber* current() const { return current_; }

 private:
  struct Slot {
    Block block;
    std::vector<std::unique_ptr<Fiber>> fibers;
    int live = 0;
    bool busy = false;
  };

  void start(int slot, uint3 idx, int nthreads) {
    Slot& s = *slots_[slot];
    s.block.begin(idx, nthreads);
    while (static_cast<int>(s.fibers.size()) < nthreads) s.fibers.push_back(std::make_unique<Fiber>());
    for (int i = 0; i < nthreads; ++i) {
      Fiber& f = *s.fibers[i];
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.get();
      f.ctx.uc_stack.ss_size = Fiber::kStackBytes;
      f.ctx.uc_link = &scheduler_;
      makecontext(&f.ctx, &Runtime::fiber_main, 0);
      f.state = Fiber::kReady;
      f.block = &s.block;
      f.slot = slot;
      f.id = i;
    }
    s.live = nthreads;
    s.busy = true;
  }

  // The next ready fiber of a busy slot; aborts if its live threads all wait at barriers that
  // cannot complete.
  Fiber* pick(Slot& s, int nthreads) {
    if (!s.busy) return nullptr;
    for (int j = 0; j < nthreads; ++j) {
      Fiber* f = s.fibers[s.block.upward ? j : nthreads - 1 - j].get();
      if (f->state == Fiber::kReady) return f;
    }
    for (int i = 0; i < nthreads; ++i)
      if (s.fibers[i]->state == Fiber::kBlocked) s.fibers[i]->waiting_on->state().deadlock();
    return nullptr;
  }

  static void fiber_main();
  void finish() {
    current_->state = Fiber::kDone;
    --slots_[current_->slot]->live;
    leave_thread();
  }

  std::vector<std::unique_ptr<Slot>> slots_;
  ucontext_t scheduler_;
  Fiber* current_ = nullptr;
};
#endif

inline Runtime& runtime() {
  static Runtime* rt = new Runtime;  // never destroyed: pool threads stay parked until exit
  return *rt;
}

#ifdef SIMT_FIBERS
inline void block_current_fiber(Barrier* on) { runtime().block_current(on); }
inline void make_ready(Fiber* fiber) { fiber->state = Fiber::kReady; }
inline Fiber* current_fiber() { return runtime().current(); }
inline void Runtime::fiber_main() {
  Runtime& rt = runtime();
  (*rt.body_)();
  rt.finish();  // returning switches to uc_link, the scheduler
}
#endif

// Records a failed check of the running launch: the first report is kept with where it happened
// (block, thread, the schedule's seed); no further block is started.
inline void report(const std::string& what) {
  LaunchState* s = runtime().launch;
  if (s == nullptr) fail(what.c_str());  // a check outside any launch: a bug in the emulator's caller
  std::string where;
  if (tls.block != nullptr)
    where = format(" [block (%u, %u, %u), thread (%u, %u, %u)", blockIdx.x, blockIdx.y, blockIdx.z,
                   threadIdx.x, threadIdx.y, threadIdx.z);
  if (tls.op != nullptr) where += format(", in %s at %s:%d", tls.op, short_path(tls.op_site.file).c_str(), tls.op_site.line);
  where += format("%sblock order seed %llu]", where.empty() ? " [" : "; ",
                  static_cast<unsigned long long>(schedule().seed));
  std::lock_guard<std::mutex> lk(s->mu);
  if (s->reports++ == 0) s->first = what + where;
  s->failed.store(true, std::memory_order_relaxed);
}

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

// ---- output checks -----------------------------------------------------------------------------
namespace detail {

// Where a store came from; id 0 means "not written", id 1 is a memset through the launcher.
struct StoreSite {
  const char* function;
  const char* file;
  int line;
};

class SiteTable {
 public:
  SiteTable() {
    sites_[0] = {"a memset", "the launcher", 0};
    n_.store(1, std::memory_order_release);
  }
  uint16_t id(const char* function, const char* file, int line) {
    const int n = n_.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i)
      if (same(sites_[i], function, file, line)) return static_cast<uint16_t>(i + 1);
    std::lock_guard<std::mutex> lk(mu_);
    const int m = n_.load(std::memory_order_relaxed);
    for (int i = n; i < m; ++i)
      if (same(sites_[i], function, file, line)) return static_cast<uint16_t>(i + 1);
    if (m == kMax) return kMax;  // out of ids: reports name the last site
    sites_[m] = {function, file, line};
    n_.store(m + 1, std::memory_order_release);
    return static_cast<uint16_t>(m + 1);
  }
  std::string describe(uint16_t id) const {
    const StoreSite& s = sites_[id - 1];
    if (s.line == 0) return std::string(s.function) + " through " + s.file;
    return format("%s (%s:%d)", s.function, short_path(s.file).c_str(), s.line);
  }

 private:
  static bool same(const StoreSite& s, const char* function, const char* file, int line) {
    return s.line == line && (s.file == file || std::strcmp(s.file, file) == 0) &&
           (s.function == function || std::strcmp(s.function, function) == 0);
  }
  static constexpr int kMax = 4096;
  StoreSite sites_[kMax];
  std::atomic<int> n_{0};
  std::mutex mu_;
};

inline SiteTable& sites() {
  static SiteTable* t = new SiteTable;
  return *t;
}

}  // namespace detail

// The outputs of one launch sequence, each to be written exactly once per element: simt::store
// records the writer of every element (from kernel threads), memset marks whole ranges (host),
// finish() looks for elements nobody wrote.
class OutputCheck {
 public:
  void add(const void* p, size_t elem_size, size_t count, size_t row_length, const char* name) {
    if (count == 0) return;
    Region r{static_cast<const unsigned char*>(p), elem_size, count, row_length, name,
             std::unique_ptr<uint16_t[]>(new uint16_t[count]()), 0};
    regions_.push_back(std::move(r));
  }

  // A store of `bytes` bytes at p from a kernel; false if it must not happen (outside every output).
  bool store(const void* p, size_t bytes, uint16_t site) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    for (Region& r : regions_) {
      if (c < r.begin || c >= r.begin + r.elem_size * r.count) continue;
      const size_t off = static_cast<size_t>(c - r.begin);
      // a vector store (bytes a multiple of the element size) writes each of its elements once
      if (off % r.elem_size != 0 || bytes % r.elem_size != 0 || off + bytes > r.elem_size * r.count) {
        detail::report(detail::format("%s stores %zu bytes at byte %zu of output %s, whose elements have %zu",
                                      detail::sites().describe(site).c_str(), bytes, off, r.name, r.elem_size));
        return false;
      }
      __atomic_fetch_or(&r.site_mask, site < 64 ? uint64_t(1) << site : 0, __ATOMIC_RELAXED);
      for (size_t i = off / r.elem_size; i < (off + bytes) / r.elem_size; ++i) {
        uint16_t first = 0;
        // acquire/release: a failed exchange sees the first writer's site registered (describe())
        if (!__atomic_compare_exchange_n(&r.writer[i], &first, site, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
          detail::report(detail::format("output %s written twice: by %s after %s", element(r, i).c_str(),
                                        detail::sites().describe(site).c_str(),
                                        detail::sites().describe(first).c_str()));
      }
      return true;
    }
    detail::report(detail::sites().describe(site) + " stores outside every output of the launch sequence" +
                   nearest(c) + " (simt::store is for registered outputs; scratch memory takes plain stores)");
    return false;
  }

  // A memset through the launcher: the one write of the output elements it covers.
  void memset(const void* p, size_t bytes) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    for (Region& r : regions_) {
      const unsigned char* end = r.begin + r.elem_size * r.count;
      if (c + bytes <= r.begin || c >= end) continue;
      const size_t lo = c <= r.begin ? 0 : static_cast<size_t>(c - r.begin) / r.elem_size;
      const size_t hi = std::min(r.count, static_cast<size_t>(c + bytes - r.begin) / r.elem_size);
      r.site_mask |= 2;
      for (size_t i = lo; i < hi; ++i) {
        if (r.writer[i] != 0 && error_.empty())
          error_ = "output " + element(r, i) + " written twice: by a memset through the launcher after " +
                   detail::sites().describe(r.writer[i]);
        r.writer[i] = 1;
      }
    }
  }

  // After the last launch of the sequence: the first problem found by memset() or an unwritten
  // element, or "" when every element of every output was written once.
  std::string finish() const {
    if (!error_.empty()) return error_;
    for (const Region& r : regions_) {
      size_t missing = 0, first = 0;
      for (size_t i = r.count; i-- > 0;)
        if (r.writer[i] == 0) {
          ++missing;
          first = i;
        }
      if (missing == 0) continue;
      std::string writers;
      for (uint16_t s = 1; s < 64; ++s)
        if (r.site_mask & (uint64_t(1) << s)) writers += (writers.empty() ? "" : ", ") + detail::sites().describe(s);
      return detail::format("output %s was never written (%zu of its %zu elements were not); ", element(r, first).c_str(),
                            missing, r.count) +
             (writers.empty() ? std::string("nothing stored into it") : "stores into it came from " + writers);
    }
    return "";
  }

 private:
  struct Region {
    const unsigned char* begin;
    size_t elem_size, count, row_length;
    const char* name;
    std::unique_ptr<uint16_t[]> writer;  // the site of the store that wrote each element
    uint64_t site_mask;                  // the sites (ids < 64) that stored into the region
  };

  static std::string element(const Region& r, size_t i) {
    if (r.row_length == 0 || r.row_length == r.count) return detail::format("%s[%zu]", r.name, i);
    return detail::format("%s[%zu, %zu]", r.name, i / r.row_length, i % r.row_length);
  }

  std::string nearest(const unsigned char* c) const {
    std::string best;
    size_t dist = SIZE_MAX;
    for (const Region& r : regions_) {
      const unsigned char* end = r.begin + r.elem_size * r.count;
      if (c >= end && static_cast<size_t>(c - end) < dist) {
        dist = static_cast<size_t>(c - end);
        best = detail::format(": %zu bytes past the end of %s (%zu elements)", dist, r.name, r.count);
      } else if (c < r.begin && static_cast<size_t>(r.begin - c) < dist) {
        dist = static_cast<size_t>(r.begin - c);
        best = detail::format(": %zu bytes before the start of %s", dist, r.name);
      }
    }
    return best;
  }

  std::vector<Region> regions_;
  std::string error_;
};

// Returns and clears the error of the last failed launch from this host thread.
inline Error last_error() {
  Error e = detail::last_launch_error;
  detail::last_launch_error = Error::kSuccess;
  return e;
}
// The report behind the last kCheckFailed (kept until the next failed launch).
inline const std::string& last_error_message() { return detail::last_launch_message; }

// Block order and concurrency of every later launch (kernel_check --seed/--resident). resident = 1
// runs one block at a time.
inline void set_schedule(uint64_t seed, int resident) {
  detail::schedule().seed = seed;
  detail::schedule().resident = std::max(1, resident);
}

// kernel<<<grid, block>>>(args...) with the stores to `outputs` checked (nullptr: unchecked).
// Arguments are converted once to the parameter types; each thread receives its own copy, as
// kernel parameters are per thread on a GPU.
template <class... P, class... A>
void launch_checked(OutputCheck* outputs, dim3 grid, dim3 block, void (*kernel)(P...), A&&... args) {
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
  std::vector<uint3> order;
  order.reserve(size_t(grid.x) * grid.y * grid.z);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) order.push_back(uint3{x, y, z});
  const detail::Schedule sched = detail::schedule();
  const uint64_t seed = sched.seed ^ (uint64_t(grid.x) * 0x9e3779b97f4a7c15ull) ^
                        (uint64_t(grid.y) << 21) ^ (uint64_t(grid.z) << 42) ^ (nthreads << 52);
  std::mt19937_64 rng(seed);
  std::shuffle(order.begin(), order.end(), rng);
  detail::LaunchState state;
  state.outputs = outputs;
  rt.launch = &state;
  const std::function<void()> body = [&] { std::apply(kernel, params); };
  rt.run_grid(order, static_cast<int>(nthreads), sched.resident, rng(), body);
  rt.launch = nullptr;
  if (state.failed.load()) {
    detail::last_launch_error = Error::kCheckFailed;
    detail::last_launch_message = state.first;
    if (state.reports > 1) detail::last_launch_message += detail::format(" (and %d more reports)", state.reports - 1);
  }
}

// kernel<<<grid, block>>>(args...) without output checks.
template <class... P, class... A>
void launch(dim3 grid, dim3 block, void (*kernel)(P...), A&&... args) {
  launch_checked(nullptr, grid, block, kernel, std::forward<A>(args)...);
}

namespace detail {
// simt::store's check: false if the store must not happen.
inline bool check_output_store(const void* p, size_t bytes, const char* function, const char* file, int line) {
  LaunchState* s = runtime().launch;
  if (s == nullptr || s->outputs == nullptr) return true;
  return s->outputs->store(p, bytes, sites().id(function, file, line));
}
}  // namespace detail

// ---- shared memory proxies ---------------------------------------------------------------------
template <class E>
class SharedPtr;

namespace detail {

// An offset no index can bring back into an array: where a bad index (already reported) leads.
constexpr ptrdiff_t kBadOffset = PTRDIFF_MIN / 4;

// "xs[3]", "red[1][0][7]", "count": the element at byte `off` of a declaration.
inline std::string shared_element(const SharedDecl& d, ptrdiff_t off) {
  if (d.rank == 0) return d.name;
  if (off < 0 || off % static_cast<ptrdiff_t>(d.elem_size) != 0)
    return format("%s (byte %td)", d.name, off);
  size_t flat = static_cast<size_t>(off) / d.elem_size;
  std::string index;
  for (int k = d.rank - 1; k >= 0; --k) {
    const size_t e = k == 0 ? flat : flat % d.extent[k];
    index = format("[%zu]", e) + index;
    flat = k == 0 ? 0 : flat / d.extent[k];
  }
  return d.name + index;
}

inline std::string shared_where(const SharedDecl& d) {
  return format("%s, declared %s %s at %s:%d", kernel_name(d.function).c_str(), d.type, d.name,
                short_path(d.file).c_str(), d.line);
}

// Checks one access of `size` bytes at byte `off` of a shared array and records a write; false if
// the access must not happen (reported).
inline bool check_shared(SharedArray* a, ptrdiff_t off, size_t size, size_t align, bool read) {
  const SharedDecl& d = *a->decl;
  if (off < 0 || static_cast<size_t>(off) + size > a->bytes) {
    if (off != kBadOffset && off > kBadOffset / 2)
      report(format("%s shared memory outside %s: %zu bytes at byte offset %td of %zu (%s)",
                    read ? "read of" : "write to", d.name, size, off, a->bytes, shared_where(d).c_str()));
    return false;
  }
  if ((reinterpret_cast<uintptr_t>(a->data) + static_cast<uintptr_t>(off)) % align != 0) {
    report(format("misaligned %zu-byte access to shared %s at byte offset %td: it needs %zu-byte alignment, "
                  "the declaration guarantees %zu (%s)",
                  size, d.name, off, align, d.align, shared_where(d).c_str()));
    return false;
  }
  unsigned char* w = a->written.get() + off;
  if (!read) {
    std::memset(w, 1, size);
    return true;
  }
  for (size_t i = 0; i < size; ++i)
    if (w[i] == 0) {
      report(format("read of shared %s before any thread of its block wrote it (%s); shared memory is "
                    "undefined when a block starts",
                    shared_element(d, off + static_cast<ptrdiff_t>(i) / static_cast<ptrdiff_t>(d.elem_size) *
                                                static_cast<ptrdiff_t>(d.elem_size))
                        .c_str(),
                    shared_where(d).c_str()));
      return false;
    }
  return true;
}

inline void report_index(const SharedArray* a, ptrdiff_t i, size_t extent, int dims_left) {
  const SharedDecl& d = *a->decl;
  report(format("index %td outside [0, %zu) in dimension %d of shared %s (%s)", i, extent, d.rank - dims_left, d.name,
                shared_where(d).c_str()));
}

}  // namespace detail

// An element of shared memory (also the name of a scalar declaration): reads and writes are
// checked. Copying the proxy does not copy the element: read into a typed variable.
template <class E>
class SharedRef {
 public:
  SharedRef(detail::SharedArray* a, ptrdiff_t off) : a_(a), off_(off) {}
  SharedRef(const SharedRef&) = default;

  E load() const {
    E v{};
    if (detail::check_shared(a_, off_, sizeof(E), alignof(E), true)) std::memcpy(&v, a_->data + off_, sizeof(E));
    return v;
  }
  operator E() const { return load(); }
  SharedRef& operator=(const E& v) {
    if (detail::check_shared(a_, off_, sizeof(E), alignof(E), false)) std::memcpy(a_->data + off_, &v, sizeof(E));
    return *this;
  }
  SharedRef& operator=(const SharedRef& o) { return *this = o.load(); }
  template <class U>
  SharedRef& operator+=(const U& u) {
    return *this = static_cast<E>(load() + u);
  }
  template <class U>
  SharedRef& operator-=(const U& u) {
    return *this = static_cast<E>(load() - u);
  }
  template <class U>
  SharedRef& operator*=(const U& u) {
    return *this = static_cast<E>(load() * u);
  }
  template <class U>
  SharedRef& operator/=(const U& u) {
    return *this = static_cast<E>(load() / u);
  }
  template <class U>
  SharedRef& operator|=(const U& u) {
    return *this = static_cast<E>(load() | u);
  }
  template <class U>
  SharedRef& operator&=(const U& u) {
    return *this = static_cast<E>(load() & u);
  }
  template <class U>
  SharedRef& operator^=(const U& u) {
    return *this = static_cast<E>(load() ^ u);
  }
  SharedRef& operator++() { return *this += 1; }
  SharedRef& operator--() { return *this -= 1; }
  E operator++(int) {
    const E v = load();
    *this = static_cast<E>(v + 1);
    return v;
  }
  E operator--(int) {
    const E v = load();
    *this = static_cast<E>(v - 1);
    return v;
  }
  SharedPtr<E> operator&() const { return SharedPtr<E>(a_, off_); }

 private:
  detail::SharedArray* a_;
  ptrdiff_t off_;
};

// A pointer into shared memory (simt::shared_ptr<E>): pointer arithmetic, indexing, comparisons.
template <class E>
class SharedPtr {
 public:
  SharedPtr() = default;
  SharedPtr(detail::SharedArray* a, ptrdiff_t off) : a_(a), off_(off) {}

  SharedRef<E> operator*() const { return SharedRef<E>(a_, off_); }
  SharedRef<E> operator[](ptrdiff_t i) const { return SharedRef<E>(a_, off_ + i * kSize); }
  SharedPtr operator+(ptrdiff_t i) const { return SharedPtr(a_, off_ + i * kSize); }
  SharedPtr operator-(ptrdiff_t i) const { return SharedPtr(a_, off_ - i * kSize); }
  friend SharedPtr operator+(ptrdiff_t i, const SharedPtr& p) { return p + i; }
  ptrdiff_t operator-(const SharedPtr& o) const { return (off_ - o.off_) / kSize; }
  SharedPtr& operator+=(ptrdiff_t i) { return *this = *this + i; }
  SharedPtr& operator-=(ptrdiff_t i) { return *this = *this - i; }
  SharedPtr& operator++() { return *this += 1; }
  SharedPtr& operator--() { return *this -= 1; }
  SharedPtr operator++(int) {
    SharedPtr p = *this;
    *this += 1;
    return p;
  }
  SharedPtr operator--(int) {
    SharedPtr p = *this;
    *this -= 1;
    return p;
  }
  bool operator==(const SharedPtr& o) const { return a_ == o.a_ && off_ == o.off_; }
  bool operator!=(const SharedPtr& o) const { return !(*this == o); }
  bool operator<(const SharedPtr& o) const { return off_ < o.off_; }
  bool operator<=(const SharedPtr& o) const { return off_ <= o.off_; }
  bool operator>(const SharedPtr& o) const { return off_ > o.off_; }
  bool operator>=(const SharedPtr& o) const { return off_ >= o.off_; }

  detail::SharedArray* array() const { return a_; }
  ptrdiff_t offset() const { return off_; }

 private:
  static constexpr ptrdiff_t kSize = static_cast<ptrdiff_t>(sizeof(E));
  detail::SharedArray* a_ = nullptr;
  ptrdiff_t off_ = 0;
};

// The name of an array declaration, or a row of it: indexing checks each dimension's bounds; a
// one-dimensional view decays to a SharedPtr like an array to a pointer.
template <class A>
class SharedArrayView {
  using Sub = std::remove_extent_t<A>;
  static constexpr size_t kExtent = std::extent_v<A>;

 public:
  SharedArrayView(detail::SharedArray* a, ptrdiff_t off) : a_(a), off_(off) {}

  auto operator[](ptrdiff_t i) const {
    ptrdiff_t off = off_ + i * static_cast<ptrdiff_t>(sizeof(Sub));
    if (i < 0 || static_cast<size_t>(i) >= kExtent) {
      if (off_ != detail::kBadOffset) detail::report_index(a_, i, kExtent, std::rank_v<A>);
      off = detail::kBadOffset;
    }
    if constexpr (std::is_array_v<Sub>) {
      return SharedArrayView<Sub>(a_, off);
    } else {
      return SharedRef<Sub>(a_, off);
    }
  }
  template <class S, std::enable_if_t<std::is_same_v<S, Sub> && !std::is_array_v<S>, int> = 0>
  operator SharedPtr<S>() const {
    return SharedPtr<S>(a_, off_);
  }
  SharedPtr<Sub> operator+(ptrdiff_t i) const { return SharedPtr<Sub>(a_, off_) + i; }

 private:
  detail::SharedArray* a_;
  ptrdiff_t off_;
};

template <class A>
struct SharedHandle {
  using type = SharedRef<A>;
};
template <class E, size_t N>
struct SharedHandle<E[N]> {
  using type = SharedArrayView<E[N]>;
};
template <class A>
using shared_handle_t = typename SharedHandle<A>::type;

namespace detail {
inline SharedArray* bind_shared(const SharedDecl* d) {
  if (tls.block == nullptr) fail("SIMT_SHARED outside a kernel launched by emu::launch");
  return tls.block->shared.bind(d);
}
}  // namespace detail

}  // namespace emu

// ---------------------------------------------------------------------------------------------
// The checked-kernel vocabulary (emu/simt_api.h gives the device definitions).
namespace simt {

template <class T>
using decl_t = T;
template <class T>
struct type_identity {
  using type = T;
};
template <class T>
using shared_ptr = emu::SharedPtr<std::remove_const_t<T>>;

// out[i] = value for a registered output; the emulated launcher checks that each element is
// written exactly once (see the top of this file). The default arguments name the storing site.
template <class T>
inline void store(T* dst, typename type_identity<T>::type value, const char* function = __builtin_FUNCTION(),
                  const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  if (emu::detail::check_output_store(dst, sizeof(T), function, file, line)) *dst = value;
}

template <class U, class T>
inline U* pointer_cast(T* p) {
  return reinterpret_cast<U*>(p);
}
template <class U, class T>
inline shared_ptr<U> pointer_cast(emu::SharedPtr<T> p) {
  return shared_ptr<U>(p.array(), p.offset());
}
template <class U, class A>
inline shared_ptr<U> pointer_cast(const emu::SharedArrayView<A>& v) {
  return pointer_cast<U>(emu::SharedPtr<std::remove_extent_t<A>>(v));
}

// cp.async of 16 bytes: the source is read at issue time, the destination written when a wait
// retires the copy's committed group (see AsyncCopies), so a pipeline that reads a stage before
// waiting for it reads stale bytes here too.
template <class D, class T>
inline void copy_async16(D dst, const T* src) {
  if (reinterpret_cast<uintptr_t>(src) % 16 != 0) {
    emu::detail::report(emu::detail::format("copy_async16 from a global pointer %p that is not 16-byte aligned",
                                            static_cast<const void*>(src)));
    return;
  }
  uint4 v;
  std::memcpy(&v, src, sizeof v);
  const shared_ptr<uint4> to = pointer_cast<uint4>(dst);
  if (to.offset() % 16 != 0) {
    *to = v;  // the checked store reports the misaligned destination
    return;
  }
  emu::detail::thread_copies().open.push_back({to.array(), to.offset(), v});
}
// Closes this thread's open group of copies (an empty group is a group, as on the GPU).
inline void copy_async_commit() {
  emu::detail::AsyncCopies& c = emu::detail::thread_copies();
  c.committed.push_back(std::move(c.open));
  c.open.clear();
}
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
inline void copy_async_wait_prior() {
  static_assert(kPending >= 0, "a number of groups");
  emu::detail::AsyncCopies& c = emu::detail::thread_copies();
  while (c.committed.size() > static_cast<size_t>(kPending)) {
    for (const emu::detail::AsyncCopy& a : c.committed.front()) *shared_ptr<uint4>(a.array, a.offset) = a.value;
    c.committed.pop_front();
  }
}
inline void copy_async_wait() { copy_async_wait_prior<0>(); }

}  // namespace simt

// SIMT_SHARED(type, name): `__shared__ type name` on the device; here a per-block, checked copy.
#define SIMT_SHARED_ALIGNED(type, name, bytes)                                                          \
  static const ::emu::detail::SharedDecl simt_shared_decl_##name =                                      \
      ::emu::detail::make_decl<::simt::decl_t<type>>(#name, #type, __PRETTY_FUNCTION__, __FILE__, __LINE__, \
                                                     bytes);                                            \
  ::emu::shared_handle_t<::simt::decl_t<type>> name(::emu::detail::bind_shared(&simt_shared_decl_##name), 0)
#define SIMT_SHARED(type, name) SIMT_SHARED_ALIGNED(type, name, 1)

// ---------------------------------------------------------------------------------------------
// Synchronisation. Default arguments capture the call site of the kernel code.
inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  emu::detail::tls.block->barrier.arrive_and_wait({file, line});
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

inline int atomicMin(int* p, int v) {
  int old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (old > v &&
         !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
inline int atomicAnd(int* p, int v) { return __atomic_fetch_and(p, v, __ATOMIC_RELAXED); }

// The same atomics on shared memory: the element must have been written in this block.
namespace emu {
namespace detail {
template <class T, class Op>
T shared_rmw(SharedPtr<T> p, Op op) {
  if (!check_shared(p.array(), p.offset(), sizeof(T), alignof(T), true)) return T{};
  return op(reinterpret_cast<T*>(p.array()->data + p.offset()));
}
}  // namespace detail
}  // namespace emu

#define SIMT_SHARED_ATOMIC(name)                                                                   \
  template <class T>                                                                               \
  T name(emu::SharedPtr<T> p, typename simt::type_identity<T>::type v) {                          \
    return emu::detail::shared_rmw(p, [&](T* q) { return name(q, v); });                           \
  }
SIMT_SHARED_ATOMIC(atomicAdd)
SIMT_SHARED_ATOMIC(atomicOr)
SIMT_SHARED_ATOMIC(atomicAnd)
SIMT_SHARED_ATOMIC(atomicExch)
SIMT_SHARED_ATOMIC(atomicMax)
SIMT_SHARED_ATOMIC(atomicMin)
#undef SIMT_SHARED_ATOMIC
template <class T>
T atomicCAS(emu::SharedPtr<T> p, typename simt::type_identity<T>::type expected,
            typename simt::type_identity<T>::type desired) {
  return emu::detail::shared_rmw(p, [&](T* q) { return atomicCAS(q, expected, desired); });
}

// ---------------------------------------------------------------------------------------------
// nvcuda::wmma, shape m16n16k16, __half / __nv_bfloat16 inputs, float accumulators. Loads and
// stores take global pointers (T*) or shared ones (emu::SharedPtr<T>, every element checked).
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
uintptr_t address(const T* p) {
  return reinterpret_cast<uintptr_t>(p);
}
template <class T>
uintptr_t address(emu::SharedPtr<T> p) {
  return reinterpret_cast<uintptr_t>(p.array()->data) + static_cast<uintptr_t>(p.offset());
}
template <class T>
std::string describe(const T* p) {
  return emu::detail::format("global pointer %p", static_cast<const void*>(p));
}
template <class T>
std::string describe(emu::SharedPtr<T> p) {
  const emu::detail::SharedDecl& d = *p.array()->decl;
  return emu::detail::format("pointer to byte %td of shared %s, declared with %zu-byte alignment (%s)", p.offset(),
                             d.name, d.align, emu::detail::shared_where(d).c_str());
}

// Names the collective in reports from the element checks it makes; false if the pointer or ldm
// is invalid (reported; the operation is skipped).
class Op {
 public:
  template <class P>
  Op(const char* name, emu::detail::Site site, P p, unsigned ldm, size_t elem_size) {
    emu::detail::warp_sync(site);
    emu::detail::tls.op = name;
    emu::detail::tls.op_site = site;
    if (address(p) % 32 != 0)
      emu::detail::report("wmma needs a 256-bit aligned pointer, got a " + describe(p));
    else if ((ldm * elem_size) % 16 != 0)
      emu::detail::report(emu::detail::format("wmma ldm = %u: ldm * sizeof(T) is not a multiple of 16 bytes", ldm));
    else
      ok = true;
  }
  ~Op() { emu::detail::tls.op = nullptr; }
  bool ok = false;
};

// Element (r, c) of a rows x cols tile at p: p[r * ldm + c] (row-major) or p[r + c * ldm].
template <class F, class P>
void load_tile(F& f, P p, unsigned ldm, bool row_major) {
  for (int r = 0; r < F::rows; ++r)
    for (int c = 0; c < F::cols; ++c) f.x[r * F::cols + c] = p[row_major ? r * ldm + c : r + c * ldm];
}
template <class F, class P>
void store_tile(P p, const F& f, unsigned ldm, bool row_major) {
  if (emu::detail::tls.lane != 0) return;
  for (int r = 0; r < F::rows; ++r)
    for (int c = 0; c < F::cols; ++c) p[row_major ? r * ldm + c : r + c * ldm] = f.x[r * F::cols + c];
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
  detail::Op op("wmma::load_matrix_sync", {file, line}, p, ldm, sizeof(T));
  if (op.ok) detail::load_tile(f, p, ldm, std::is_same_v<L, row_major>);
}
template <class Use, int M, int N, int K, class T, class L>
void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, typename simt::type_identity<emu::SharedPtr<T>>::type p,
                      unsigned ldm, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(std::is_same_v<L, row_major> || std::is_same_v<L, col_major>,
                "matrix_a/matrix_b fragments need a layout");
  detail::Op op("wmma::load_matrix_sync", {file, line}, p, ldm, sizeof(T));
  if (op.ok) detail::load_tile(f, p, ldm, std::is_same_v<L, row_major>);
}

template <int M, int N, int K>
void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const float* p, unsigned ldm,
                      layout_t layout, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  detail::Op op("wmma::load_matrix_sync", {file, line}, p, ldm, sizeof(float));
  if (op.ok) detail::load_tile(f, p, ldm, layout == mem_row_major);
}
template <int M, int N, int K>
void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, emu::SharedPtr<float> p, unsigned ldm,
                      layout_t layout, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  detail::Op op("wmma::load_matrix_sync", {file, line}, p, ldm, sizeof(float));
  if (op.ok) detail::load_tile(f, p, ldm, layout == mem_row_major);
}

template <int M, int N, int K>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm,
                       layout_t layout, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  detail::Op op("wmma::store_matrix_sync", {file, line}, p, ldm, sizeof(float));
  if (op.ok) detail::store_tile(p, f, ldm, layout == mem_row_major);
}
template <int M, int N, int K>
void store_matrix_sync(emu::SharedPtr<float> p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm,
                       layout_t layout, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  detail::Op op("wmma::store_matrix_sync", {file, line}, p, ldm, sizeof(float));
  if (op.ok) detail::store_tile(p, f, ldm, layout == mem_row_major);
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

namespace simt {
// wmma::load_matrix_sync from shared memory (on the device it names the state space; see simt_api.h).
template <class F, class P>
inline void load_shared(F& f, P p, unsigned ldm, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  nvcuda::wmma::load_matrix_sync(f, p, ldm, file, line);
}
}  // namespace simt
