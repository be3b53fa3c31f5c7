// Plans, jobs and instruction-set dispatch of the diagonal products (kernels live in
// kernels_{avx512,avx2,portable}.cc and see only the plain structs of kernel_table.h).
#include "diag_kernels.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernel_table.h"

namespace dynadiag {
namespace {

constexpr int64_t kProductRowChunk = 32;   // rows a worker claims at once (forward, dx)
constexpr int64_t kSddmmRowChunk = 32;     // rows per SDDMM pass over the plan
constexpr int64_t kBackwardRowChunk = 64;  // rows per fused backward pass over the plan
// Segments per tile group of the fused backward: their packed values and partial sums (128 bytes
// per segment) stay in L2 while the group's tiles run over a chunk of rows.
constexpr int64_t kBackwardGroupSegments = 4096;

// Below this many multiply-adds per task, extra tasks cost more (scheduling, partial sums) than
// they save: small calls run in one task, inline in the handler.
constexpr int64_t kMinMacsPerTask = int64_t{1} << 21;

// How many tasks share `units` units of work (row chunks, blocks) of `macs` multiply-adds in all.
int64_t TaskCount(int64_t units, int64_t macs, int64_t workers) {
  return std::clamp<int64_t>(std::min(units, macs / kMinMacsPerTask), 1,
                             std::max<int64_t>(workers, 1));
}

// ... for `rows` rows claimed `chunk` at a time, for a plan of `segs` segments.
int64_t TaskCount(int64_t rows, int64_t chunk, int64_t segs, int64_t workers) {
  return TaskCount((rows + chunk - 1) / chunk, rows * segs * kLanes, workers);
}

// Per-call arrays (plan, packed values, partial sums) come from a small cache of 64-byte aligned
// buffers: a fresh multi-megabyte allocation is served by mmap and page-faults on first touch,
// which cost as much as a small kernel. Idle buffers are bounded in number and bytes (oldest
// freed first); a request takes the smallest idle buffer that fits without wasting over half.
class BufferCache {
 public:
  // Never destroyed: jobs may return buffers during static destruction at exit.
  static BufferCache& Get() {
    static BufferCache* cache = new BufferCache;
    return *cache;
  }

  // An uninitialised buffer of at least `bytes`; `capacity` receives its real size.
  void* Take(size_t bytes, size_t& capacity) {
    bytes = (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto best = idle_.end();
      for (auto it = idle_.begin(); it != idle_.end(); ++it) {
        if (it->second >= bytes && it->second / 2 <= bytes &&
            (best == idle_.end() || it->second < best->second)) {
          best = it;
        }
      }
      if (best != idle_.end()) {
        void* p = best->first;
        capacity = best->second;
        idle_bytes_ -= capacity;
        idle_.erase(best);
        return p;
      }
    }
    capacity = bytes;
    void* p = std::aligned_alloc(64, capacity);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }

  void Give(void* p, size_t capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    idle_.emplace_back(p, capacity);
    idle_bytes_ += capacity;
    while (idle_.size() > kMaxIdle || idle_bytes_ > kMaxIdleBytes) {
      std::free(idle_.front().first);
      idle_bytes_ -= idle_.front().second;
      idle_.erase(idle_.begin());
    }
  }

 private:
  static constexpr size_t kMaxIdle = 16;
  static constexpr size_t kMaxIdleBytes = size_t{64} << 20;
  std::mutex mutex_;
  std::vector<std::pair<void*, size_t>> idle_;  // (buffer, capacity), oldest first
  size_t idle_bytes_ = 0;
};

// A move-only, uninitialised, 64-byte aligned array of trivially copyable T from the cache.
template <typename T>
class Scratch {
 public:
  Scratch() = default;
  explicit Scratch(int64_t n) {
    data_ = static_cast<T*>(BufferCache::Get().Take(sizeof(T) * static_cast<size_t>(n), capacity_));
  }
  Scratch(Scratch&& other) noexcept : data_(other.data_), capacity_(other.capacity_) {
    other.data_ = nullptr;
  }
  Scratch& operator=(Scratch&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(capacity_, other.capacity_);
    return *this;
  }
  ~Scratch() {
    if (data_ != nullptr) BufferCache::Get().Give(data_, capacity_);
  }
  T* get() const { return data_; }
  T& operator[](int64_t i) const { return data_[i]; }

 private:
  T* data_ = nullptr;
  size_t capacity_ = 0;
};

// v as D: itself, or widened to float32 (bfloat16 -> float: the block kernels' float copies).
template <typename D, typename S>
D Convert(S v) {
  if constexpr (std::is_same_v<S, D>) {
    return v;
  } else {
    return ToFloat(v);
  }
}

// Rows of a chunk through the input permutation: dst[r, j] = src[r, perm[j]] (kScatter false: a
// chunk of x read through DiagMatrix::perm) or dst[r, perm[j]] = src[r, j] (true: a chunk of dx
// written back through it), for r < rows and j < width, rows src_stride and dst_stride apart.
// A random permutation has no vector form (AVX2/AVX-512 gathers ran no faster than scalar loads
// here), so the loop is scalar: four rows share each load of perm and four entries of perm are
// read ahead, about 1.4x faster than one row at a time (docs/cpu_kernels.md, "Input permutations").
// The gather may also widen (S = bfloat16, D = float32: the block kernels' float copies).
template <bool kScatter, typename S, typename D>
void PermuteRows(const S* src, int64_t src_stride, int64_t rows, int64_t width,
                 const int32_t* perm, D* dst, int64_t dst_stride) {
  // Column j of a row moves through p = perm[j], gathered or scattered (and widened).
  const auto move = [](const S* s, D* d, int64_t j, int32_t p) {
    if constexpr (kScatter) {
      d[p] = Convert<D>(s[j]);
    } else {
      d[j] = Convert<D>(s[p]);
    }
  };
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    const S* s = src + r * src_stride;
    D* d = dst + r * dst_stride;
    int64_t j = 0;
    for (; j + 4 <= width; j += 4) {
      const int32_t p0 = perm[j], p1 = perm[j + 1], p2 = perm[j + 2], p3 = perm[j + 3];
      for (int q = 0; q < 4; ++q) {
        const S* sq = s + q * src_stride;
        D* dq = d + q * dst_stride;
        move(sq, dq, j, p0);
        move(sq, dq, j + 1, p1);
        move(sq, dq, j + 2, p2);
        move(sq, dq, j + 3, p3);
      }
    }
    for (; j < width; ++j) {
      for (int q = 0; q < 4; ++q) move(s + q * src_stride, d + q * dst_stride, j, perm[j]);
    }
  }
  for (; r < rows; ++r) {
    for (int64_t j = 0; j < width; ++j) move(src + r * src_stride, dst + r * dst_stride, j, perm[j]);
  }
}

template <typename T>
void GatherRows(const T* src, int64_t src_stride, int64_t rows, int64_t width,
                const int32_t* perm, T* dst, int64_t dst_stride) {
  PermuteRows<false>(src, src_stride, rows, width, perm, dst, dst_stride);
}

template <typename T>
void ScatterRows(const T* src, int64_t src_stride, int64_t rows, int64_t width,
                 const int32_t* perm, T* dst, int64_t dst_stride) {
  PermuteRows<true>(src, src_stride, rows, width, perm, dst, dst_stride);
}

uint32_t LaneMask(int64_t begin, int64_t end) {  // lanes [begin, end) of 16
  if (end <= begin) return 0;
  return ((1u << end) - 1u) & ~((1u << begin) - 1u);
}

// Calls emit(c0, mask, vbase) for the segments of out[:, tile] += in[:, c0 + l] * value, for a
// product whose output side is the moving side (`moving_on_output`: out width P, in width D) or
// the fixed side (out width D, in width P), diagonals in the given order. Masks may be empty.
template <typename Emit>
void TileSegments(const DiagMatrix& w, bool moving_on_output, const int64_t* order,
                  int64_t tile, Emit&& emit) {
  const int64_t p = std::max(w.in, w.out), len = std::min(w.in, w.out);
  const int64_t o0 = tile * kLanes;
  const int64_t lane_end = std::min<int64_t>(kLanes, (moving_on_output ? p : len) - o0);
  for (int64_t i = 0; i < w.k; ++i) {
    const int64_t k = order[i], d = w.offsets[k];
    if (moving_on_output) {
      // Lane l: output o0 + l, entry t = (o0 + l - d) mod P, input column t; valid if t < D.
      const int64_t base = o0 - d;
      if (base >= 0) {
        emit(base, LaneMask(0, std::min(lane_end, len - base)), k * len + base);
      } else {
        const int64_t wrapped = base + p;  // lanes before the wrap
        emit(wrapped, LaneMask(0, std::min({lane_end, -base, len - wrapped})), k * len + wrapped);
        emit(base, LaneMask(-base, std::min(lane_end, len - base)), k * len + base);
      }
    } else {
      // Lane l: output (= entry t) o0 + l, input column (o0 + l + d) mod P.
      const int64_t base = o0 + d;
      if (base < p) {
        emit(base, LaneMask(0, std::min(lane_end, p - base)), k * len + o0);
        emit(base - p, LaneMask(p - base, lane_end), k * len + o0);
      } else {
        emit(base - p, LaneMask(0, lane_end), k * len + o0);
      }
    }
  }
}

struct Plan {
  int64_t num_tiles = 0;
  int64_t num_segs = 0;
  Scratch<int64_t> tile_begin;
  Scratch<Segment> segs;

  PlanView view() const { return PlanView{num_tiles, tile_begin.get(), segs.get(), num_segs}; }
};

// The plan of a product (see TileSegments), every tile padded with empty segments to a multiple
// of kSegmentGroup. Within a tile, segments come in increasing c0 (up to one wrap), so a kernel
// sweeps the input row once per tile.
Plan BuildPlan(const DiagMatrix& w, bool moving_on_output) {
  const int64_t p = std::max(w.in, w.out), len = std::min(w.in, w.out);
  Plan plan;
  plan.num_tiles = ((moving_on_output ? p : len) + kLanes - 1) / kLanes;
  std::vector<int64_t> order(w.k);
  std::iota(order.begin(), order.end(), 0);
  // c0 = o0 - d (moving on output) grows as d falls; c0 = o0 + d grows with d.
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return moving_on_output ? w.offsets[a] > w.offsets[b] : w.offsets[a] < w.offsets[b];
  });
  plan.tile_begin = Scratch<int64_t>(plan.num_tiles + 1);
  int64_t n = 0;
  for (int64_t tile = 0; tile < plan.num_tiles; ++tile) {
    plan.tile_begin[tile] = n;
    int64_t count = 0;
    TileSegments(w, moving_on_output, order.data(), tile,
                 [&](int64_t, uint32_t mask, int64_t) { count += mask != 0; });
    n += (count + kSegmentGroup - 1) / kSegmentGroup * kSegmentGroup;
  }
  plan.tile_begin[plan.num_tiles] = n;
  plan.num_segs = n;
  plan.segs = Scratch<Segment>(n);
  for (int64_t tile = 0; tile < plan.num_tiles; ++tile) {
    Segment* out = plan.segs.get() + plan.tile_begin[tile];
    TileSegments(w, moving_on_output, order.data(), tile,
                 [&](int64_t c0, uint32_t mask, int64_t vbase) {
                   if (mask != 0) *out++ = Segment{static_cast<int32_t>(c0), mask, vbase};
                 });
    while (out != plan.segs.get() + plan.tile_begin[tile + 1]) *out++ = Segment{0, 0, 0};
  }
  return plan;
}

const Kernels& KernelsFor(Isa isa) {
#if DYNADIAG_X86
  switch (isa) {
    case Isa::kAvx512:
      return Avx512Kernels();
    case Isa::kAvx2:
      return Avx2Kernels();
    case Isa::kPortable:
      break;
  }
#else
  (void)isa;  // BestIsa() is kPortable: the AVX kernels are x86 only and not built
#endif
  return PortableKernels();
}

template <typename T>
const KernelTable<T>& TableFor(const Kernels& kernels);
template <>
const KernelTable<float>& TableFor<float>(const Kernels& kernels) {
  return kernels.f32;
}
template <>
const KernelTable<Bf16>& TableFor<Bf16>(const Kernels& kernels) {
  return kernels.bf16;
}

// dvalues from the packed sums [num_segs][16]: every entry of dvalues is lane l of exactly one
// segment, at index vbase + l.
template <typename T>
void WriteDvalues(const PlanView& plan, const float* sums, T* dvalues) {
  for (int64_t s = 0; s < plan.num_segs; ++s) {
    const uint32_t mask = plan.segs[s].mask;
    T* dst = dvalues + plan.segs[s].vbase;
    for (int l = 0; l < kLanes; ++l) {
      if ((mask >> l) & 1u) FromFloat(sums[s * kLanes + l], dst + l);
    }
  }
}

// The partial sums of dvalues, `blocks` blocks of `size` floats, for the jobs that sum over rows.
// Each block sums a fixed set of row chunks (the element jobs: task t takes chunks t, t + tasks,
// ...; the block job: slots of chunks): dealt out statically, not claimed, so every call sums the
// same rows in the same order and gradients repeat bit for bit whichever thread runs first. The
// last of the `tasks` tasks to finish adds the blocks up in block order and writes dvalues.
class PartialSums {
 public:
  void Init(int64_t blocks, int64_t size, int64_t tasks) {
    blocks_ = blocks;
    size_ = size;
    partial_ = Scratch<float>(blocks * size_);
    pending_.store(tasks);
  }

  int64_t blocks() const { return blocks_; }

  // Block `block`, zeroed.
  float* Begin(int64_t block) {
    float* acc = partial_.get() + block * size_;
    std::memset(acc, 0, sizeof(float) * size_);
    return acc;
  }

  // write(sums) with the total, once, by the last task to call Finish.
  template <typename Write>
  void Finish(Write&& write) {
    // acq_rel: the last task sees every other task's partial sums.
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    float* sums = partial_.get();
    for (int64_t t = 1; t < blocks_; ++t) {
      const float* part = sums + t * size_;
      for (int64_t i = 0; i < size_; ++i) sums[i] += part[i];
    }
    write(static_cast<const float*>(sums));
  }

 private:
  int64_t blocks_ = 1, size_ = 0;
  Scratch<float> partial_;
  std::atomic<int64_t> pending_{0};
};

// out[rows, out_width] = in[rows, in_width] (x) diagonals: the forward and dx. Workers claim
// chunks of rows; the plan and the packed values are shared read-only. With an input permutation
// (`forward`: read `in` through it; dx: write `out` through it) each chunk passes through the
// task's own buffer, which stays in L2 between the copy and the kernel.
template <typename T>
class ProductJob : public Job {
 public:
  ProductJob(int64_t rows, const DiagMatrix& w, bool moving_on_output, bool forward,
             const void* in, void* out, int64_t workers, const Kernels& kernels)
      : rows_(rows),
        in_(static_cast<const T*>(in)),
        out_(static_cast<T*>(out)),
        gather_(forward ? w.perm : nullptr),
        scatter_(forward ? nullptr : w.perm),
        table_(TableFor<T>(kernels)) {
    const int64_t p = std::max(w.in, w.out), len = std::min(w.in, w.out);
    in_width_ = moving_on_output ? len : p;
    out_width_ = moving_on_output ? p : len;
    plan_ = BuildPlan(w, moving_on_output);
    vp_ = Scratch<float>(plan_.num_segs * kLanes);
    table_.pack(plan_.view(), static_cast<const T*>(w.values), vp_.get());
    workers_ = TaskCount(rows_, kProductRowChunk, plan_.num_segs, workers);
    if (w.perm != nullptr) {
      chunk_copy_ = Scratch<T>(workers_ * kProductRowChunk * (forward ? in_width_ : out_width_));
    }
  }

  int64_t num_tasks() const override { return workers_; }

  void RunTask(int64_t task) override {
    const PlanView plan = plan_.view();
    T* copy = chunk_copy_.get() == nullptr
                  ? nullptr
                  : chunk_copy_.get() +
                        task * kProductRowChunk * (gather_ != nullptr ? in_width_ : out_width_);
    for (;;) {
      const int64_t r0 = next_row_.fetch_add(kProductRowChunk, std::memory_order_relaxed);
      if (r0 >= rows_) return;
      const int64_t n = std::min(kProductRowChunk, rows_ - r0);
      const T* in = in_ + r0 * in_width_;
      if (gather_ != nullptr) {
        GatherRows(in, in_width_, n, in_width_, gather_, copy, in_width_);
        in = copy;
      }
      T* out = scatter_ != nullptr ? copy : out_ + r0 * out_width_;
      table_.product(plan, vp_.get(), in, in_width_, out, out_width_, n);
      if (scatter_ != nullptr) {
        ScatterRows(copy, out_width_, n, out_width_, scatter_, out_ + r0 * out_width_,
                    out_width_);
      }
    }
  }

 private:
  int64_t rows_, workers_ = 1, in_width_ = 0, out_width_ = 0;
  const T* in_;
  T* out_;
  const int32_t* gather_;   // the forward's permutation of `in`, or null
  const int32_t* scatter_;  // dx's permutation of `out`, or null
  const KernelTable<T>& table_;
  Plan plan_;
  Scratch<float> vp_;
  Scratch<T> chunk_copy_;  // [tasks][kProductRowChunk][permuted width] with a permutation
  std::atomic<int64_t> next_row_{0};
};

// dvalues[k, t] = sum_r fixed[r, t] * moving[r, (t + d) % P], the diagonal SDDMM. Tiles run
// along the moving side (width P) and segments gather from the fixed side (width D = the
// narrower operand, which stays in cache); lane l of segment s is entry vbase_s + l of dvalues.
// Tasks accumulate row chunks into their own PartialSums block. With an input permutation, each
// chunk of x is gathered through it into the task's buffer first.
template <typename T>
class DvaluesJob : public Job {
 public:
  DvaluesJob(const DvaluesArgs& a, int64_t workers, const Kernels& kernels)
      : rows_(a.rows), out_(static_cast<T*>(a.dvalues)), table_(TableFor<T>(kernels)) {
    tall_ = a.w.out >= a.w.in;
    tiled_ = static_cast<const T*>(tall_ ? a.dy : a.x);     // the moving side
    gathered_ = static_cast<const T*>(tall_ ? a.x : a.dy);  // the fixed side
    gathered_width_ = std::min(a.w.in, a.w.out);
    tiled_width_ = std::max(a.w.in, a.w.out);
    plan_ = BuildPlan(a.w, /*moving_on_output=*/true);
    const int64_t tasks = TaskCount(rows_, kSddmmRowChunk, plan_.num_segs, workers);
    sums_.Init(tasks, plan_.num_segs * kLanes, tasks);
    perm_ = a.w.perm;
    if (perm_ != nullptr) x_copy_ = Scratch<T>(tasks * kSddmmRowChunk * a.w.in);
  }

  int64_t num_tasks() const override { return sums_.blocks(); }

  void RunTask(int64_t task) override {
    const PlanView plan = plan_.view();
    float* acc = sums_.Begin(task);
    const int64_t stride = sums_.blocks() * kSddmmRowChunk;
    const int64_t x_width = tall_ ? gathered_width_ : tiled_width_;
    T* x_copy = perm_ == nullptr ? nullptr : x_copy_.get() + task * kSddmmRowChunk * x_width;
    for (int64_t r0 = task * kSddmmRowChunk; r0 < rows_; r0 += stride) {
      const int64_t n = std::min(kSddmmRowChunk, rows_ - r0);
      const T* tiled = tiled_ + r0 * tiled_width_;
      const T* gathered = gathered_ + r0 * gathered_width_;
      if (perm_ != nullptr) {
        GatherRows(tall_ ? gathered : tiled, x_width, n, x_width, perm_, x_copy, x_width);
        (tall_ ? gathered : tiled) = x_copy;
      }
      table_.sddmm(plan, tiled, tiled_width_, gathered, gathered_width_, n, acc);
    }
    sums_.Finish([&](const float* sums) { WriteDvalues(plan, sums, out_); });
  }

 private:
  int64_t rows_, tiled_width_ = 0, gathered_width_ = 0;
  bool tall_ = true;
  const T* tiled_ = nullptr;
  const T* gathered_ = nullptr;
  const int32_t* perm_ = nullptr;
  Scratch<T> x_copy_;  // [tasks][kSddmmRowChunk][in] with a permutation
  T* out_;
  const KernelTable<T>& table_;
  Plan plan_;
  PartialSums sums_;
};


// dx = dy @ W and dvalues (the SDDMM) in one sweep over dy, on the plan of dx: lane l of segment
// s pairs dx (and x) column 16 j + l with dy column c0 + l and with entry vbase + l of both values
// and dvalues, so every dy window feeds both products. Tasks accumulate row chunks into their
// PartialSums blocks, walking the tiles in groups whose packed values and partial sums stay in L2.
// With an input permutation, each chunk of x is gathered into the task's buffer and its dx
// computed into another, scattered back once the chunk is done.
template <typename T>
class BackwardJob : public Job {
 public:
  BackwardJob(const BwdArgs& a, int64_t workers, const Kernels& kernels)
      : rows_(a.rows),
        dy_(static_cast<const T*>(a.dy)),
        x_(static_cast<const T*>(a.x)),
        dx_(static_cast<T*>(a.dx)),
        dvalues_(static_cast<T*>(a.dvalues)),
        table_(TableFor<T>(kernels)) {
    dy_width_ = a.w.out;
    width_ = a.w.in;
    plan_ = BuildPlan(a.w, /*moving_on_output=*/a.w.out < a.w.in);
    const PlanView plan = plan_.view();
    vp_ = Scratch<float>(plan.num_segs * kLanes);
    table_.pack(plan, static_cast<const T*>(a.w.values), vp_.get());
    for (int64_t tile = 0; tile < plan.num_tiles; ++tile) {
      if (tile == 0 || plan.tile_begin[tile] - plan.tile_begin[group_begin_.back()] >
                           kBackwardGroupSegments) {
        group_begin_.push_back(tile);
      }
    }
    group_begin_.push_back(plan.num_tiles);
    const int64_t tasks = TaskCount(rows_, kBackwardRowChunk, plan.num_segs, workers);
    sums_.Init(tasks, plan.num_segs * kLanes, tasks);
    perm_ = a.w.perm;
    if (perm_ != nullptr) copies_ = Scratch<T>(tasks * 2 * kBackwardRowChunk * width_);
  }

  int64_t num_tasks() const override { return sums_.blocks(); }

  void RunTask(int64_t task) override {
    const PlanView plan = plan_.view();
    float* acc = sums_.Begin(task);
    const int64_t stride = sums_.blocks() * kBackwardRowChunk;
    T* x_copy = perm_ == nullptr ? nullptr : copies_.get() + task * 2 * kBackwardRowChunk * width_;
    T* dx_copy = perm_ == nullptr ? nullptr : x_copy + kBackwardRowChunk * width_;
    for (int64_t r0 = task * kBackwardRowChunk; r0 < rows_; r0 += stride) {
      const int64_t n = std::min(kBackwardRowChunk, rows_ - r0);
      const T* x = x_ + r0 * width_;
      T* dx = perm_ != nullptr ? dx_copy : dx_ + r0 * width_;
      if (perm_ != nullptr) {
        GatherRows(x, width_, n, width_, perm_, x_copy, width_);
        x = x_copy;
      }
      for (size_t g = 0; g + 1 < group_begin_.size(); ++g) {
        table_.backward(plan, group_begin_[g], group_begin_[g + 1], vp_.get(),
                        dy_ + r0 * dy_width_, dy_width_, x, dx, width_, n, acc);
      }
      if (perm_ != nullptr) {
        ScatterRows(dx_copy, width_, n, width_, perm_, dx_ + r0 * width_, width_);
      }
    }
    sums_.Finish([&](const float* sums) { WriteDvalues(plan, sums, dvalues_); });
  }

 private:
  int64_t rows_, dy_width_ = 0, width_ = 0;
  const T* dy_;
  const T* x_;
  T* dx_;
  T* dvalues_;
  const int32_t* perm_ = nullptr;
  Scratch<T> copies_;  // per task: x's chunk, then dx's, [kBackwardRowChunk][in] each
  const KernelTable<T>& table_;
  Plan plan_;
  Scratch<float> vp_;
  PartialSums sums_;
  std::vector<int64_t> group_begin_;  // tile groups: [group_begin_[g], group_begin_[g + 1])
};

// Two independent jobs as one: task i runs task i of each (where it has one). The backward of
// families without a fused kernel, and of block diagonals.
class PairJob : public Job {
 public:
  PairJob(std::unique_ptr<Job> first, std::unique_ptr<Job> second)
      : first_(std::move(first)), second_(std::move(second)) {}

  int64_t num_tasks() const override {
    return std::max(first_->num_tasks(), second_->num_tasks());
  }

  void RunTask(int64_t task) override {
    if (task < first_->num_tasks()) first_->RunTask(task);
    if (task < second_->num_tasks()) second_->RunTask(task);
  }

 private:
  std::unique_ptr<Job> first_, second_;
};



// --- Block diagonals ---------------------------------------------------------------------------

// Float32 input rows a product chunk keeps in L2 (x of the forward, dy of dx): every output block
// of the chunk reads its entries' columns from them.
constexpr int64_t kBlockChunkBytes = int64_t{192} << 10;
// Product chunks are a multiple of every family's register tile (6 or 12 rows).
constexpr int64_t kBlockChunkRows = 12;
// Bytes of the short side of W (x if tall, dy if wide) a dvalues chunk copies into strips: with
// the long strips of a group they stay in L2 while the group's blocks run.
constexpr int64_t kBlockShortBytes = int64_t{192} << 10;
// Row slots of the block SDDMM (each with its own partial sums) per task, as long as their partial
// sums together stay under kBlockSlotBytes (but at least one slot per task).
constexpr int64_t kBlockSlotsPerTask = 3;
constexpr int64_t kBlockSlotBytes = int64_t{32} << 20;
// A float32 product output at least this large is written with streaming stores: measured on
// a 2-core EPYC (32 MiB L3), 12.6 and 25 MB outputs came out 2-20% faster that way, while
// 2.6-4.5 MB ones, which the next op reads back from the caches, came out 10-40% slower.
constexpr int64_t kStreamOutputBytes = int64_t{8} << 20;

template <typename T>
const BlockKernelTable<T>& BlockTableFor(const Kernels& kernels);
template <>
const BlockKernelTable<float>& BlockTableFor<float>(const Kernels& kernels) {
  return kernels.blocks.f32;
}
template <>
const BlockKernelTable<Bf16>& BlockTableFor<Bf16>(const Kernels& kernels) {
  return kernels.blocks.bf16;
}

// rows x cols of src (row stride `stride`) as float32 rows of stride dst_stride in dst; with
// `perm`, column c of dst is column perm[c] of src.
template <typename T>
void CopyRows(const T* src, int64_t stride, int64_t rows, int64_t cols, float* dst,
              int64_t dst_stride, const int32_t* perm = nullptr) {
  if (perm != nullptr) {
    PermuteRows<false>(src, stride, rows, cols, perm, dst, dst_stride);
    return;
  }
  for (int64_t r = 0; r < rows; ++r, src += stride, dst += dst_stride) {
    for (int64_t c = 0; c < cols; ++c) dst[c] = ToFloat(src[c]);
  }
}

struct BlockPlan {
  int64_t b = 0;
  int64_t num_out_blocks = 0;
  int64_t num_entries = 0;
  int64_t max_entries = 0;  // of one output block
  bool transpose = false;
  Scratch<int64_t> entry_begin;
  Scratch<int32_t> in_block;
  Scratch<int64_t> value_block;
  Scratch<int32_t> group;
  Scratch<int32_t> group_step;

  BlockPlanView view() const {
    return BlockPlanView{b,         num_out_blocks, entry_begin.get(), in_block.get(),
                         value_block.get(), transpose, group.get(), group_step.get()};
  }
};

// BlockPlanView::group: output blocks sorted by their in_block sequences; a run of equal ones
// is one group if its blocks and their panels are equally spaced (the product steps from one to
// the next by a fixed distance), else its blocks stay alone.
void GroupBlocks(BlockPlan& plan) {
  const int64_t n = plan.num_out_blocks;
  const int64_t* begin = plan.entry_begin.get();
  const int32_t* in_block = plan.in_block.get();
  const auto less = [&](int64_t a, int64_t c) {
    return std::lexicographical_compare(in_block + begin[a], in_block + begin[a + 1],
                                        in_block + begin[c], in_block + begin[c + 1]);
  };
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), less);
  plan.group = Scratch<int32_t>(n);
  plan.group_step = Scratch<int32_t>(n);
  std::fill(plan.group.get(), plan.group.get() + n, 1);
  std::fill(plan.group_step.get(), plan.group_step.get() + n, 1);
  const auto set = [&](int64_t first, int64_t count, int64_t step) {
    plan.group[first] = static_cast<int32_t>(count);
    plan.group_step[first] = static_cast<int32_t>(step);
    for (int64_t m = 1; m < count; ++m) plan.group[first + m * step] = 0;
  };
  for (int64_t i = 0; i < n;) {
    int64_t end = i + 1;
    while (end < n && !less(order[i], order[end])) ++end;  // sorted: equal unless less
    const int64_t first = order[i], step = end - i > 1 ? order[i + 1] - first : 1;
    bool even = true;
    for (int64_t m = 1; m < end - i; ++m) {
      even = even && order[i + m] == first + m * step &&
             begin[first + m * step] - begin[first] == m * (begin[first + step] - begin[first]);
    }
    if (even) set(first, end - i, step);
    i = end;
  }
}

// The plan of the forward (`forward`: output blocks are W's block rows, input blocks its block
// columns, panels transposed) or of dx (the transpose closure: output blocks are W's block
// columns, input blocks its block rows, the blocks as they are). Every (k, t) is one entry; the
// entries of an output block come in increasing input block order, so a tile sweeps its input
// row once.
BlockPlan BuildBlockPlan(const DiagMatrix& w, bool forward) {
  const int64_t b = w.block, nb_in = w.in / b, nb_out = w.out / b;
  const int64_t len = std::max(nb_in, nb_out);
  const bool tall = w.out >= w.in;
  BlockPlan plan;
  plan.b = b;
  plan.transpose = forward;
  plan.num_out_blocks = forward ? nb_out : nb_in;
  plan.num_entries = w.k * len;
  std::vector<std::pair<int64_t, int64_t>> out_in(plan.num_entries);  // per (k, t)
  std::vector<int64_t> count(plan.num_out_blocks + 1, 0);
  for (int64_t k = 0; k < w.k; ++k) {
    const int64_t d = w.offsets[k];
    for (int64_t t = 0; t < len; ++t) {
      const int64_t row = tall ? t : (t + d) % nb_out, col = tall ? (t + d) % nb_in : t;
      out_in[k * len + t] = forward ? std::pair{row, col} : std::pair{col, row};
      ++count[out_in[k * len + t].first + 1];
    }
  }
  plan.entry_begin = Scratch<int64_t>(plan.num_out_blocks + 1);
  plan.entry_begin[0] = 0;
  for (int64_t o = 0; o < plan.num_out_blocks; ++o) {
    plan.entry_begin[o + 1] = plan.entry_begin[o] + count[o + 1];
    plan.max_entries = std::max(plan.max_entries, count[o + 1]);
  }
  std::vector<int64_t> order(plan.num_entries);  // (k, t) by output block, then input block
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t c) { return out_in[a] < out_in[c]; });
  plan.in_block = Scratch<int32_t>(plan.num_entries);
  plan.value_block = Scratch<int64_t>(plan.num_entries);
  for (int64_t e = 0; e < plan.num_entries; ++e) {
    plan.in_block[e] = static_cast<int32_t>(out_in[order[e]].second);
    plan.value_block[e] = order[e];
  }
  GroupBlocks(plan);
  return plan;
}

// out[rows, out_width] = in[rows, in_width] (x) block diagonals: the forward and dx. The values
// are packed once into the family's panels; workers claim chunks of rows and copy each (bfloat16:
// widen it) into their own buffer first. The copy pays for itself even in float32: it streams the
// rows in once, in order, where the kernel would take them from memory a few lines at a time in a
// pattern the prefetchers do not follow; the buffer then stays in L2 for every output block.
// With an input permutation the forward's copy gathers through it, and dx goes through a second
// buffer per task that is scattered back.
template <typename T>
class BlockProductJob : public Job {
 public:
  BlockProductJob(int64_t rows, const DiagMatrix& w, bool forward, const void* in, void* out,
                  int64_t workers, const Kernels& kernels)
      : rows_(rows),
        in_width_(forward ? w.in : w.out),
        out_width_(forward ? w.out : w.in),
        in_(static_cast<const T*>(in)),
        out_(static_cast<T*>(out)),
        gather_(forward ? w.perm : nullptr),
        scatter_(forward ? nullptr : w.perm),
        table_(BlockTableFor<T>(kernels)) {
    plan_ = BuildBlockPlan(w, forward);
    const int64_t bb = w.block * w.block;
    panels_ = Scratch<float>(plan_.num_entries * bb);
    table_.pack(plan_.view(), static_cast<const T*>(w.values), panels_.get());
    chunk_ = std::clamp<int64_t>(
        kBlockChunkBytes / (4 * in_width_) / kBlockChunkRows * kBlockChunkRows, kBlockChunkRows,
        20 * kBlockChunkRows);
    tasks_ = TaskCount((rows_ + chunk_ - 1) / chunk_, rows_ * plan_.num_entries * bb, workers);
    // A row stride of a multiple of 4 KiB would put a column of every row in one L1 set.
    stride_ = in_width_ % 1024 == 0 ? in_width_ + 16 : in_width_;
    rows_copy_ = Scratch<float>(tasks_ * chunk_ * stride_);
    if (scatter_ != nullptr) out_copy_ = Scratch<T>(tasks_ * chunk_ * out_width_);
    // Not into a permuted dx's chunk buffer, which the scatter reads right back.
    stream_ = scatter_ == nullptr && rows_ * out_width_ * int64_t{sizeof(T)} >= kStreamOutputBytes;
  }

  int64_t num_tasks() const override { return tasks_; }

  void RunTask(int64_t task) override {
    T* out_copy = scatter_ == nullptr ? nullptr : out_copy_.get() + task * chunk_ * out_width_;
    for (;;) {
      const int64_t r0 = next_row_.fetch_add(chunk_, std::memory_order_relaxed);
      if (r0 >= rows_) return;
      const int64_t n = std::min(chunk_, rows_ - r0);
      float* rows = rows_copy_.get() + task * chunk_ * stride_;
      CopyRows(in_ + r0 * in_width_, in_width_, n, in_width_, rows, stride_, gather_);
      T* out = scatter_ != nullptr ? out_copy : out_ + r0 * out_width_;
      table_.product(plan_.view(), panels_.get(), rows, stride_, out, out_width_, n, stream_);
      if (scatter_ != nullptr) {
        ScatterRows(out_copy, out_width_, n, out_width_, scatter_, out_ + r0 * out_width_,
                    out_width_);
      }
    }
  }

 private:
  int64_t rows_, in_width_, out_width_, chunk_ = kBlockChunkRows, tasks_ = 1, stride_ = 0;
  bool stream_ = false;
  const T* in_;
  T* out_;
  const int32_t* gather_;   // the forward's permutation of `in`, or null
  const int32_t* scatter_;  // dx's permutation of `out`, or null
  const BlockKernelTable<T>& table_;
  BlockPlan plan_;
  Scratch<float> panels_;
  Scratch<float> rows_copy_;  // [tasks][chunk][stride]
  Scratch<T> out_copy_;       // [tasks][chunk][out_width] for dx with a permutation
  std::atomic<int64_t> next_row_{0};
};

// Copies strips [s0, s1) of b columns of rows x (width) of src (row stride `width`), as float32,
// into contiguous [rows][b] strips at dst, strip s - s0 at (s - s0) * pitch; with `perm`, column
// c of the strips is column perm[c] of src.
template <typename T>
void PackStrips(const T* src, int64_t width, int64_t rows, int64_t b, int64_t s0, int64_t s1,
                float* dst, int64_t pitch, const int32_t* perm) {
  if (perm != nullptr) {  // four rows at a time (they share each load of perm), still row-major
    for (int64_t r = 0; r < rows; r += 4) {
      const int64_t n = std::min<int64_t>(4, rows - r);
      for (int64_t s = s0; s < s1; ++s) {
        PermuteRows<false>(src + r * width, width, n, b, perm + s * b,
                           dst + (s - s0) * pitch + r * b, b);
      }
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r, src += width) {
    for (int64_t s = s0; s < s1; ++s) {
      float* out = dst + (s - s0) * pitch + r * b;
      for (int64_t c = 0; c < b; ++c) out[c] = ToFloat(src[s * b + c]);
    }
  }
}

// dvalues[k, t] = dy[:, rows of block (k, t)]^T @ x[:, its columns], the block SDDMM. Block t of
// every diagonal lies in strip t of b columns of W's long side (dy if tall, x if wide) and in
// strip (t + d) % P_b of its short side. Read in place, a strip's rows are far apart: every row is
// another page, and with row strides of a multiple of 4 KiB all of them fall in one L1 set. So a
// task copies (bfloat16: widens) each of its chunks of rows into contiguous [chunk][b] strips,
// reading row after row (the prefetchers follow rows, not strips): the whole short side, then the
// long side a group of strips at a time, running the K blocks of every long strip of the group.
// The strips' pitch is an odd number of cache lines, so one row of consecutive strips spreads
// over the L1 sets. Every row is copied once. The chunks are dealt out to slots (slot s: chunks s,
// s + slots, ...), each with its own PartialSums block; tasks claim whole slots, so a task the OS
// holds back delays one slot, not half the rows. An input permutation is applied in the copy of x.
template <typename T>
class BlockDvaluesJob : public Job {
 public:
  BlockDvaluesJob(const DvaluesArgs& a, int64_t workers, const Kernels& kernels)
      : rows_(a.rows),
        b_(a.w.block),
        k_(a.w.k),
        offsets_(a.w.offsets),
        tall_(a.w.out >= a.w.in),
        dvalues_(static_cast<T*>(a.dvalues)),
        sddmm_(kernels.blocks.sddmm) {
    long_ = static_cast<const T*>(tall_ ? a.dy : a.x);
    short_ = static_cast<const T*>(tall_ ? a.x : a.dy);
    (tall_ ? short_perm_ : long_perm_) = a.w.perm;
    long_width_ = std::max(a.w.in, a.w.out);
    short_width_ = std::min(a.w.in, a.w.out);
    num_long_ = long_width_ / b_;
    chunk_ = std::clamp<int64_t>(kBlockShortBytes / (4 * short_width_) / 8 * 8, 8, 256);
    pitch_ = (chunk_ * b_ / 16 | 1) * 16;
    group_ = std::clamp<int64_t>(kBlockShortBytes / (4 * pitch_), 1, num_long_);
    task_floats_ = (short_width_ / b_ + group_) * pitch_;
    const int64_t chunks = (rows_ + chunk_ - 1) / chunk_, size = k_ * long_width_ * b_;
    tasks_ = TaskCount(chunks, rows_ * size, workers);
    const int64_t slots = std::max<int64_t>(1, std::min(chunks, kBlockSlotsPerTask * tasks_));
    sums_.Init(std::clamp<int64_t>(kBlockSlotBytes / (4 * size + 1), std::min(tasks_, slots), slots),
               size, tasks_);
    strips_ = Scratch<float>(tasks_ * task_floats_);
  }

  int64_t num_tasks() const override { return tasks_; }

  void RunTask(int64_t task) override {
    float* shorts = strips_.get() + task * task_floats_;
    float* longs = shorts + short_width_ / b_ * pitch_;
    const int64_t slots = sums_.blocks();
    for (int64_t slot = next_slot_++; slot < slots; slot = next_slot_++) {
      float* acc = sums_.Begin(slot);
      for (int64_t r0 = slot * chunk_; r0 < rows_; r0 += slots * chunk_) {
        Chunk(r0, std::min(chunk_, rows_ - r0), shorts, longs, acc);
      }
    }
    sums_.Finish([this](const float* sums) {
      const int64_t size = k_ * long_width_ * b_;
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(dvalues_, sums, sizeof(float) * size);
      } else {
        for (int64_t i = 0; i < size; ++i) FromFloat(sums[i], dvalues_ + i);
      }
    });
  }

 private:
  // acc += the products of the n rows from r0, copied through the strips.
  void Chunk(int64_t r0, int64_t n, float* shorts, float* longs, float* acc) {
    const int64_t bb = b_ * b_, num_short = short_width_ / b_;
    PackStrips(short_ + r0 * short_width_, short_width_, n, b_, 0, num_short, shorts, pitch_,
               short_perm_);
    for (int64_t t0 = 0; t0 < num_long_; t0 += group_) {
      const int64_t t1 = std::min(num_long_, t0 + group_);
      PackStrips(long_ + r0 * long_width_, long_width_, n, b_, t0, t1, longs, pitch_, long_perm_);
      for (int64_t t = t0; t < t1; ++t) {
        const float* strip = longs + (t - t0) * pitch_;
        for (int64_t k = 0; k < k_; ++k) {
          const float* other = shorts + (t + offsets_[k]) % num_short * pitch_;
          float* sums = acc + (k * num_long_ + t) * bb;
          if (tall_) {
            sddmm_(b_, strip, b_, other, b_, n, sums, true);
          } else {
            sddmm_(b_, other, b_, strip, b_, n, sums, true);
          }
        }
      }
    }
  }

  int64_t rows_, b_, k_;
  const int32_t* offsets_;
  bool tall_;
  T* dvalues_;
  decltype(BlockKernels::sddmm) sddmm_;
  const T* long_ = nullptr;
  const T* short_ = nullptr;
  const int32_t* long_perm_ = nullptr;  // x's permutation where x is the long side
  const int32_t* short_perm_ = nullptr;
  int64_t long_width_ = 0, short_width_ = 0, num_long_ = 0;
  int64_t chunk_ = 8, pitch_ = 0, group_ = 1, task_floats_ = 0, tasks_ = 1;
  Scratch<float> strips_;  // per task: the P_b short strips, then a group of long ones
  PartialSums sums_;       // float32 [K, L_b, b, b] per slot
  std::atomic<int64_t> next_slot_{0};
};

// --- A few rows (online inference) -------------------------------------------------------------

// Up to this many rows, a product reads W in place, one diagonal or block at a time, with every
// row of the batch passing over it while it is in L1 (FewRowsJob). The jobs above first build a
// plan and pack the values, a pass over W that costs about as much as the whole product at batch
// 1. The few-row loops cost nothing up front but more per row, so each path takes the rows where
// it is faster (docs/cpu_kernels.md, "A few rows", has the measurements): an element product
// that writes the long side (the forward of a tall W, dx of a wide one) to 16 rows, the others
// (and dvalues) to 8.
constexpr int64_t kFewRowsElement = 8;
constexpr int64_t kFewRowsElementLong = 16;
constexpr int64_t kFewRowsBlock = 16;

bool FewRows(int64_t rows, const DiagMatrix& w, bool writes_long_side = false) {
  if (w.block > 1) return rows <= kFewRowsBlock;
  return rows <= (writes_long_side ? kFewRowsElementLong : kFewRowsElement);
}

// Multiply-adds per task below which a few-row job runs in one task, inline: handing a task to
// another thread costs about as much as this many FMAs of the one-row loops.
constexpr int64_t kFewMacsPerTask = int64_t{1} << 18;

// A row stride of at least `width` floats, a multiple of 16, and not a multiple of 256 (1 KiB):
// rows a multiple of 4 KiB apart fall in one L1 set, and a store to one row delays loads from the
// same offset of the next.
int64_t PaddedStride(int64_t width) {
  const int64_t stride = (width + 15) / 16 * 16;
  return stride % 256 == 0 ? stride + 16 : stride;
}

// What a FewRowsJob computes: the product `out = in (x) W` (forward: in = x, W as is; dx: in =
// dy, W transposed), dvalues from dy and x, or both (the backward: in = dy).
struct FewRowsWork {
  bool product = false;
  bool forward = false;
  const void* in = nullptr;
  void* out = nullptr;
  bool dvalues = false;
  const void* dy = nullptr;
  const void* x = nullptr;
  void* dvalues_out = nullptr;

  static FewRowsWork Product(bool forward, const void* in, void* out) {
    FewRowsWork work;
    work.product = true;
    work.forward = forward;
    work.in = in;
    work.out = out;
    return work;
  }

  FewRowsWork WithDvalues(const void* dy_rows, const void* x_rows, void* result) const {
    FewRowsWork work = *this;
    work.dvalues = true;
    work.dy = dy_rows;
    work.x = x_rows;
    work.dvalues_out = result;
    return work;
  }
};

// The products of a few rows (FewRows), element or block diagonals, from `values` in place.
// bfloat16 rows are widened once into float32 copies; sums run in float32, into the output itself
// for float32 and into a float32 copy for bfloat16 (rounded once at the end). Tasks split the
// product by output columns (blocks) and dvalues by diagonals (blocks): every output element is
// summed by one task, over the diagonals in order, so the result does not depend on the split.
// An input permutation is applied in the copies: x's through it, dx's write-back scattered.
template <typename T>
class FewRowsJob : public Job {
 public:
  FewRowsJob(int64_t rows, const DiagMatrix& w, const FewRowsWork& work, int64_t workers,
             const Kernels& kernels)
      : rows_(rows), w_(w), work_(work), f32_(kernels.f32_few), table_(FewTableFor<T>(kernels)),
        blocks_(FewBlocksFor<T>(kernels)), block_sddmm_(kernels.blocks.sddmm) {
    tall_ = w.out >= w.in;
    if (w.block > 1) {
      len_ = std::max(w.in, w.out) / w.block;
      units_ = w.k * len_;
    } else {
      len_ = std::min(w.in, w.out);
      units_ = w.k;
    }
    const int64_t macs_per_row = w.k * len_ * (w.block > 1 ? w.block * w.block : 1);
    if (work.product) {
      src_width_ = work.forward ? w.in : w.out;
      dst_width_ = work.forward ? w.out : w.in;
      src_ = Widened(work.in, src_width_, src_copy_, work.forward ? w.perm : nullptr);
      scatter_ = work.forward ? nullptr : w.perm;
      // Sums go straight to a float32 output row; several rows (or a permuted dx) to a copy
      // (PaddedStride).
      if (std::is_same_v<T, float> && rows <= 1 && scatter_ == nullptr) {
        dst_ = static_cast<float*>(work.out);
        dst_stride_ = dst_width_;
      } else {
        dst_stride_ = PaddedStride(dst_width_);
        dst_copy_ = Scratch<float>(std::max<int64_t>(rows * dst_stride_, 1));
        dst_ = dst_copy_.get();
      }
    }
    if (work.dvalues) {
      dy_ = work.product && !work.forward ? src_ : Widened(work.dy, w.out, dy_copy_, nullptr);
      x_ = Widened(work.x, w.in, x_copy_, w.perm);
    }
    const int64_t macs = rows * macs_per_row * (int64_t{work.product} + int64_t{work.dvalues});
    tasks_ = std::clamp<int64_t>(macs / kFewMacsPerTask, 1, std::max<int64_t>(workers, 1));
    // Product columns are split in steps of 16 (element) or whole blocks; dvalues by units.
    if (work.product) {
      const int64_t step = w.block > 1 ? w.block : kLanes;
      tasks_ = std::min(tasks_, (dst_width_ + step - 1) / step);
    }
    if (!std::is_same_v<T, float> && work.dvalues) {
      sums_ = Scratch<float>(tasks_ * (w.block > 1 ? w.block * w.block : len_));
    }
  }

  int64_t num_tasks() const override { return tasks_; }

  void RunTask(int64_t task) override {
    if (work_.product) {
      const int64_t step = w_.block > 1 ? w_.block : kLanes;
      const int64_t steps = (dst_width_ + step - 1) / step;
      const int64_t lo = std::min(dst_width_, steps * task / tasks_ * step);
      const int64_t hi = std::min(dst_width_, steps * (task + 1) / tasks_ * step);
      for (int64_t r = 0; r < rows_; ++r) {
        std::memset(dst_ + r * dst_stride_ + lo, 0, sizeof(float) * (hi - lo));
      }
      if (w_.block > 1) {
        BlockProduct(lo / w_.block, hi / w_.block);
      } else {
        ElementProduct(lo, hi);
      }
      if (dst_ != work_.out) {
        T* out = static_cast<T*>(work_.out);
        for (int64_t r = 0; r < rows_; ++r) {
          const float* sums = dst_ + r * dst_stride_;
          T* row = out + r * dst_width_;
          if (scatter_ != nullptr) {
            for (int64_t c = lo; c < hi; ++c) FromFloat(sums[c], row + scatter_[c]);
          } else {
            for (int64_t c = lo; c < hi; ++c) FromFloat(sums[c], row + c);
          }
        }
      }
    }
    if (work_.dvalues) {
      const int64_t lo = units_ * task / tasks_, hi = units_ * (task + 1) / tasks_;
      if (w_.block > 1) {
        BlockDvalues(lo, hi, task);
      } else {
        ElementDvalues(lo, hi, task);
      }
    }
  }

 private:
  struct Rows {
    const float* data = nullptr;
    int64_t stride = 0;
  };

  // rows x width of p as float32 rows (read through `perm` if given): p itself for one float32
  // row in order, else a copy (bfloat16 widened) with rows PaddedStride apart.
  Rows Widened(const void* p, int64_t width, Scratch<float>& copy, const int32_t* perm) {
    if (std::is_same_v<T, float> && rows_ <= 1 && perm == nullptr) {
      return {static_cast<const float*>(p), width};
    }
    const int64_t stride = PaddedStride(width);
    copy = Scratch<float>(std::max<int64_t>(rows_ * stride, 1));
    CopyRows(static_cast<const T*>(p), width, rows_, width, copy.get(), stride, perm);
    return {copy.get(), stride};
  }

  // Diagonal k pairs short-side index j in [0, len) with long-side index j + d for j < P - d and
  // j + d - P after: calls run(j0, j1, shift) for the two straight pieces.
  template <typename Run>
  void Pieces(int64_t k, Run&& run) const {
    const int64_t p = std::max(w_.in, w_.out), d = w_.offsets[k];
    const int64_t split = std::min(len_, p - d);
    run(int64_t{0}, split, d);
    run(split, len_, d - p);
  }

  // dst columns [lo, hi) of the element-diagonal product: one row a diagonal at a time (each
  // adds one or two runs), several output-stationary (FewRowTable::product).
  void ElementProduct(int64_t lo, int64_t hi) {
    // The forward of a tall W and dx of a wide one write the long side.
    const bool long_dst = work_.forward == tall_;
    const T* values = static_cast<const T*>(w_.values);
    if (rows_ != 1) {
      const FewElements<T> e{values, w_.offsets, w_.k, len_, std::max(w_.in, w_.out), long_dst};
      table_.product(e, src_.data, src_.stride, dst_, dst_stride_, rows_, lo, hi);
      return;
    }
    for (int64_t k = 0; k < w_.k; ++k) {
      Pieces(k, [&](int64_t j0, int64_t j1, int64_t shift) {
        const int64_t dst_shift = long_dst ? shift : 0, src_shift = long_dst ? 0 : shift;
        const int64_t a = std::max(j0, lo - dst_shift), e = std::min(j1, hi - dst_shift);
        if (a < e) {
          table_.triad(values + k * len_ + a, src_.data + a + src_shift, dst_ + a + dst_shift,
                       e - a);
        }
      });
    }
  }

  // Block row and block column of block t of diagonal k.
  std::pair<int64_t, int64_t> BlockAt(int64_t k, int64_t t) const {
    const int64_t d = w_.offsets[k];
    if (tall_) return {t, (t + d) % (w_.in / w_.block)};
    return {(t + d) % (w_.out / w_.block), t};
  }

  // dst blocks [lo, hi) of the block-diagonal product.
  void BlockProduct(int64_t lo, int64_t hi) {
    const int64_t b = w_.block, bb = b * b;
    const T* values = static_cast<const T*>(w_.values);
    for (int64_t k = 0; k < w_.k; ++k) {
      for (int64_t t = 0; t < len_; ++t) {
        const auto [row, col] = BlockAt(k, t);
        const int64_t dst = work_.forward ? row : col, src = work_.forward ? col : row;
        if (dst < lo || dst >= hi) continue;
        const T* v = values + (k * len_ + t) * bb;
        const float* in = src_.data + src * b;
        float* out = dst_ + dst * b;
        if (work_.forward) {
          blocks_.fwd(v, b, in, src_.stride, out, dst_stride_, rows_);
        } else {
          blocks_.dx(v, b, in, src_.stride, out, dst_stride_, rows_);
        }
      }
    }
  }

  // dvalues[k, j] = sum_r short[r, j] * long[r, j + shift] for diagonals [k0, k1).
  void ElementDvalues(int64_t k0, int64_t k1, int64_t task) {
    const Rows shorts = tall_ ? x_ : dy_, longs = tall_ ? dy_ : x_;
    for (int64_t k = k0; k < k1; ++k) {
      float* acc = Sums(task, k * len_, len_);
      std::memset(acc, 0, sizeof(float) * len_);
      Pieces(k, [&](int64_t j0, int64_t j1, int64_t shift) {
        f32_.dot(shorts.data + j0, shorts.stride, longs.data + j0 + shift, longs.stride, acc + j0,
                 rows_, j1 - j0);
      });
      Store(acc, k * len_, len_);
    }
  }

  // dvalues of blocks [e0, e1) in [K, L_b] order.
  void BlockDvalues(int64_t e0, int64_t e1, int64_t task) {
    const int64_t b = w_.block, bb = b * b;
    for (int64_t e = e0; e < e1; ++e) {
      const auto [row, col] = BlockAt(e / len_, e % len_);
      float* acc = Sums(task, e * bb, bb);
      block_sddmm_(b, dy_.data + row * b, dy_.stride, x_.data + col * b, x_.stride, rows_, acc,
                   false);
      Store(acc, e * bb, bb);
    }
  }

  // Where dvalues[first, first + n) are summed: in place for float32, else the task's sums.
  float* Sums(int64_t task, int64_t first, int64_t n) {
    if constexpr (std::is_same_v<T, float>) {
      return static_cast<float*>(work_.dvalues_out) + first;
    } else {
      return sums_.get() + task * n;
    }
  }

  void Store(const float* acc, int64_t first, int64_t n) {
    if constexpr (!std::is_same_v<T, float>) {
      T* out = static_cast<T*>(work_.dvalues_out) + first;
      for (int64_t i = 0; i < n; ++i) FromFloat(acc[i], out + i);
    }
  }

  template <typename U>
  static const FewRowTable<U>& FewTableFor(const Kernels& kernels) {
    if constexpr (std::is_same_v<U, float>) {
      return kernels.f32_few;
    } else {
      return kernels.bf16_few;
    }
  }

  template <typename U>
  static const FewBlockTable<U>& FewBlocksFor(const Kernels& kernels) {
    if constexpr (std::is_same_v<U, float>) {
      return kernels.blocks.few_f32;
    } else {
      return kernels.blocks.few_bf16;
    }
  }

  int64_t rows_;
  DiagMatrix w_;
  FewRowsWork work_;
  const FewRowTable<float>& f32_;
  const FewRowTable<T>& table_;
  const FewBlockTable<T>& blocks_;
  decltype(BlockKernels::sddmm) block_sddmm_;
  bool tall_ = true;
  int64_t len_ = 0, units_ = 0, tasks_ = 1, src_width_ = 0, dst_width_ = 0, dst_stride_ = 0;
  Rows src_, dy_, x_;
  float* dst_ = nullptr;
  const int32_t* scatter_ = nullptr;  // dx's input permutation, or null
  Scratch<float> src_copy_, dy_copy_, x_copy_, dst_copy_, sums_;
};

template <template <typename> class J, typename... Args>
std::unique_ptr<Job> MakeTyped(ElemType type, Args&&... args) {
  if (type == ElemType::kF32) return std::make_unique<J<float>>(std::forward<Args>(args)...);
  return std::make_unique<J<Bf16>>(std::forward<Args>(args)...);
}

}  // namespace

Isa BestIsa() {
  static const Isa best = [] {
#if !DYNADIAG_X86
    return Isa::kPortable;
#else
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl")) {
      return Isa::kAvx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
    return Isa::kPortable;
#endif
  }();
  return best;
}

const char* IsaName(Isa isa) { return KernelsFor(isa).name; }

std::unique_ptr<Job> MakeFwdJob(const FwdArgs& a, int64_t workers, Isa isa) {
  if (FewRows(a.rows, a.w, /*writes_long_side=*/a.w.out >= a.w.in)) {
    return MakeTyped<FewRowsJob>(a.type, a.rows, a.w, FewRowsWork::Product(true, a.x, a.y),
                                 workers, KernelsFor(isa));
  }
  if (a.w.block > 1) {
    return MakeTyped<BlockProductJob>(a.type, a.rows, a.w, /*forward=*/true, a.x, a.y, workers,
                                      KernelsFor(isa));
  }
  // Tall W moves along the output rows; wide W along the input columns.
  return MakeTyped<ProductJob>(a.type, a.rows, a.w, a.w.out >= a.w.in, /*forward=*/true, a.x,
                               a.y, workers, KernelsFor(isa));
}

std::unique_ptr<Job> MakeDxJob(const DxArgs& a, int64_t workers, Isa isa) {
  if (FewRows(a.rows, a.w, /*writes_long_side=*/a.w.out < a.w.in)) {
    return MakeTyped<FewRowsJob>(a.type, a.rows, a.w, FewRowsWork::Product(false, a.dy, a.dx),
                                 workers, KernelsFor(isa));
  }
  if (a.w.block > 1) {
    return MakeTyped<BlockProductJob>(a.type, a.rows, a.w, /*forward=*/false, a.dy, a.dx, workers,
                                      KernelsFor(isa));
  }
  // dx = dy @ W: in and out swap roles, so the moving side swaps (the transpose closure).
  return MakeTyped<ProductJob>(a.type, a.rows, a.w, a.w.out < a.w.in, /*forward=*/false, a.dy,
                               a.dx, workers, KernelsFor(isa));
}

std::unique_ptr<Job> MakeDvaluesJob(const DvaluesArgs& a, int64_t workers, Isa isa) {
  if (FewRows(a.rows, a.w)) {
    return MakeTyped<FewRowsJob>(a.type, a.rows, a.w,
                                 FewRowsWork().WithDvalues(a.dy, a.x, a.dvalues), workers,
                                 KernelsFor(isa));
  }
  if (a.w.block > 1) return MakeTyped<BlockDvaluesJob>(a.type, a, workers, KernelsFor(isa));
  return MakeTyped<DvaluesJob>(a.type, a, workers, KernelsFor(isa));
}

std::unique_ptr<Job> MakeBwdJob(const BwdArgs& a, int64_t workers, Isa isa) {
  if (FewRows(a.rows, a.w)) {
    const FewRowsWork work =
        FewRowsWork::Product(false, a.dy, a.dx).WithDvalues(a.dy, a.x, a.dvalues);
    return MakeTyped<FewRowsJob>(a.type, a.rows, a.w, work, workers, KernelsFor(isa));
  }
  const Kernels& kernels = KernelsFor(isa);
  const bool fused = a.type == ElemType::kF32 ? kernels.f32.backward != nullptr
                                              : kernels.bf16.backward != nullptr;
  if (a.w.block == 1 && fused) return MakeTyped<BackwardJob>(a.type, a, workers, kernels);
  // Block diagonals: the products do only useful FMAs and are bound by them, not by loads, so
  // sharing the reads of dy would save little; dx and dvalues run as their own jobs.
  return std::make_unique<PairJob>(
      MakeDxJob(DxArgs{a.type, a.rows, a.w, a.dy, a.dx}, workers, isa),
      MakeDvaluesJob(DvaluesArgs{a.type, a.rows, a.w, a.dy, a.x, a.dvalues}, workers, isa));
}

}  // namespace dynadiag
