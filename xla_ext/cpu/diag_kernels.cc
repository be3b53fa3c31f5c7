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

// How many tasks share `rows` rows claimed `chunk` at a time, for a plan of `segs` segments.
int64_t TaskCount(int64_t rows, int64_t chunk, int64_t segs, int64_t workers) {
  const int64_t chunks = (rows + chunk - 1) / chunk;
  const int64_t by_work = rows * segs * kLanes / kMinMacsPerTask;
  return std::clamp<int64_t>(std::min(chunks, by_work), 1, std::max<int64_t>(workers, 1));
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
  switch (isa) {
    case Isa::kAvx512:
      return Avx512Kernels();
    case Isa::kAvx2:
      return Avx2Kernels();
    case Isa::kPortable:
      break;
  }
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

// dvalues from `workers` packed partial sums [workers][num_segs][16] (summed into the first):
// every entry of dvalues is lane l of exactly one segment, at index vbase + l.
template <typename T>
void WriteDvalues(const PlanView& plan, float* partials, int64_t workers, T* dvalues) {
  const int64_t n = plan.num_segs * kLanes;
  for (int64_t w = 1; w < workers; ++w) {
    const float* part = partials + w * n;
    for (int64_t i = 0; i < n; ++i) partials[i] += part[i];
  }
  for (int64_t s = 0; s < plan.num_segs; ++s) {
    const uint32_t mask = plan.segs[s].mask;
    T* dst = dvalues + plan.segs[s].vbase;
    for (int l = 0; l < kLanes; ++l) {
      if ((mask >> l) & 1u) FromFloat(partials[s * kLanes + l], dst + l);
    }
  }
}

// The packed partial sums of dvalues, one block per task, for the jobs that sum over rows. Task
// t takes row chunks t, t + tasks, ... (dealt out statically, not claimed: every call then sums
// the same rows in the same order, so gradients repeat bit for bit whichever thread runs first);
// the last task to finish adds the blocks up in task order and writes dvalues.
class PartialSums {
 public:
  void Init(int64_t tasks, int64_t num_segs) {
    tasks_ = tasks;
    size_ = num_segs * kLanes;
    partial_ = Scratch<float>(tasks * size_);
    pending_.store(tasks);
  }

  int64_t tasks() const { return tasks_; }

  // Task `task`'s block, zeroed.
  float* Begin(int64_t task) {
    float* acc = partial_.get() + task * size_;
    std::memset(acc, 0, sizeof(float) * size_);
    return acc;
  }

  template <typename T>
  void Finish(const PlanView& plan, T* dvalues) {
    // acq_rel: the last task sees every other task's partial sums.
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      WriteDvalues(plan, partial_.get(), tasks_, dvalues);
    }
  }

 private:
  int64_t tasks_ = 1, size_ = 0;
  Scratch<float> partial_;
  std::atomic<int64_t> pending_{0};
};

// out[rows, out_width] = in[rows, in_width] (x) diagonals: the forward and dx. Workers claim
// chunks of rows; the plan and the packed values are shared read-only.
template <typename T>
class ProductJob : public Job {
 public:
  ProductJob(int64_t rows, const DiagMatrix& w, bool moving_on_output, const void* in, void* out,
             int64_t workers, const Kernels& kernels)
      : rows_(rows),
        in_(static_cast<const T*>(in)),
        out_(static_cast<T*>(out)),
        table_(TableFor<T>(kernels)) {
    const int64_t p = std::max(w.in, w.out), len = std::min(w.in, w.out);
    in_width_ = moving_on_output ? len : p;
    out_width_ = moving_on_output ? p : len;
    plan_ = BuildPlan(w, moving_on_output);
    vp_ = Scratch<float>(plan_.num_segs * kLanes);
    table_.pack(plan_.view(), static_cast<const T*>(w.values), vp_.get());
    workers_ = TaskCount(rows_, kProductRowChunk, plan_.num_segs, workers);
  }

  int64_t num_tasks() const override { return workers_; }

  void RunTask(int64_t) override {
    const PlanView plan = plan_.view();
    for (;;) {
      const int64_t r0 = next_row_.fetch_add(kProductRowChunk, std::memory_order_relaxed);
      if (r0 >= rows_) return;
      table_.product(plan, vp_.get(), in_ + r0 * in_width_, in_width_, out_ + r0 * out_width_,
                     out_width_, std::min(kProductRowChunk, rows_ - r0));
    }
  }

 private:
  int64_t rows_, workers_ = 1, in_width_ = 0, out_width_ = 0;
  const T* in_;
  T* out_;
  const KernelTable<T>& table_;
  Plan plan_;
  Scratch<float> vp_;
  std::atomic<int64_t> next_row_{0};
};

// dvalues[k, t] = sum_r fixed[r, t] * moving[r, (t + d) % P], the diagonal SDDMM. Tiles run
// along the moving side (width P) and segments gather from the fixed side (width D = the
// narrower operand, which stays in cache); lane l of segment s is entry vbase_s + l of dvalues.
// Tasks accumulate row chunks into their own PartialSums block.
template <typename T>
class DvaluesJob : public Job {
 public:
  DvaluesJob(const DvaluesArgs& a, int64_t workers, const Kernels& kernels)
      : rows_(a.rows), out_(static_cast<T*>(a.dvalues)), table_(TableFor<T>(kernels)) {
    const bool tall = a.w.out >= a.w.in;
    tiled_ = static_cast<const T*>(tall ? a.dy : a.x);     // the moving side
    gathered_ = static_cast<const T*>(tall ? a.x : a.dy);  // the fixed side
    gathered_width_ = std::min(a.w.in, a.w.out);
    tiled_width_ = std::max(a.w.in, a.w.out);
    plan_ = BuildPlan(a.w, /*moving_on_output=*/true);
    sums_.Init(TaskCount(rows_, kSddmmRowChunk, plan_.num_segs, workers), plan_.num_segs);
  }

  int64_t num_tasks() const override { return sums_.tasks(); }

  void RunTask(int64_t task) override {
    const PlanView plan = plan_.view();
    float* acc = sums_.Begin(task);
    const int64_t stride = sums_.tasks() * kSddmmRowChunk;
    for (int64_t r0 = task * kSddmmRowChunk; r0 < rows_; r0 += stride) {
      table_.sddmm(plan, tiled_ + r0 * tiled_width_, tiled_width_,
                   gathered_ + r0 * gathered_width_, gathered_width_,
                   std::min(kSddmmRowChunk, rows_ - r0), acc);
    }
    sums_.Finish(plan, out_);
  }

 private:
  int64_t rows_, tiled_width_ = 0, gathered_width_ = 0;
  const T* tiled_ = nullptr;
  const T* gathered_ = nullptr;
  T* out_;
  const KernelTable<T>& table_;
  Plan plan_;
  PartialSums sums_;
};


// dx = dy @ W and dvalues (the SDDMM) in one sweep over dy, on the plan of dx: lane l of segment
// s pairs dx (and x) column 16 j + l with dy column c0 + l and with entry vbase + l of both values
// and dvalues, so every dy window feeds both products. Tasks accumulate row chunks into their
// PartialSums blocks, walking the tiles in groups whose packed values and partial sums stay in L2.
// Families without a fused kernel run the two separate jobs instead.
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
    if (table_.backward == nullptr) {
      dx_job_ = std::make_unique<ProductJob<T>>(a.rows, a.w, a.w.out < a.w.in, a.dy, a.dx, workers,
                                                kernels);
      dvalues_job_ = std::make_unique<DvaluesJob<T>>(
          DvaluesArgs{a.type, a.rows, a.w, a.dy, a.x, a.dvalues}, workers, kernels);
      return;
    }
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
    sums_.Init(TaskCount(rows_, kBackwardRowChunk, plan.num_segs, workers), plan.num_segs);
  }

  int64_t num_tasks() const override {
    if (dx_job_) return std::max(dx_job_->num_tasks(), dvalues_job_->num_tasks());
    return sums_.tasks();
  }

  void RunTask(int64_t task) override {
    if (dx_job_) {
      if (task < dx_job_->num_tasks()) dx_job_->RunTask(task);
      if (task < dvalues_job_->num_tasks()) dvalues_job_->RunTask(task);
      return;
    }
    const PlanView plan = plan_.view();
    float* acc = sums_.Begin(task);
    const int64_t stride = sums_.tasks() * kBackwardRowChunk;
    for (int64_t r0 = task * kBackwardRowChunk; r0 < rows_; r0 += stride) {
      const int64_t n = std::min(kBackwardRowChunk, rows_ - r0);
      for (size_t g = 0; g + 1 < group_begin_.size(); ++g) {
        table_.backward(plan, group_begin_[g], group_begin_[g + 1], vp_.get(),
                        dy_ + r0 * dy_width_, dy_width_, x_ + r0 * width_, dx_ + r0 * width_,
                        width_, n, acc);
      }
    }
    sums_.Finish(plan, dvalues_);
  }

 private:
  int64_t rows_, dy_width_ = 0, width_ = 0;
  const T* dy_;
  const T* x_;
  T* dx_;
  T* dvalues_;
  const KernelTable<T>& table_;
  Plan plan_;
  Scratch<float> vp_;
  PartialSums sums_;
  std::vector<int64_t> group_begin_;  // tile groups: [group_begin_[g], group_begin_[g + 1])
  std::unique_ptr<Job> dx_job_, dvalues_job_;
};

template <template <typename> class J, typename... Args>
std::unique_ptr<Job> MakeTyped(ElemType type, Args&&... args) {
  if (type == ElemType::kF32) return std::make_unique<J<float>>(std::forward<Args>(args)...);
  return std::make_unique<J<Bf16>>(std::forward<Args>(args)...);
}

}  // namespace

Isa BestIsa() {
  static const Isa best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl")) {
      return Isa::kAvx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
    return Isa::kPortable;
  }();
  return best;
}

const char* IsaName(Isa isa) { return KernelsFor(isa).name; }

std::unique_ptr<Job> MakeFwdJob(const FwdArgs& a, int64_t workers, Isa isa) {
  // Tall W moves along the output rows; wide W along the input columns.
  return MakeTyped<ProductJob>(a.type, a.rows, a.w, a.w.out >= a.w.in, a.x, a.y, workers,
                               KernelsFor(isa));
}

std::unique_ptr<Job> MakeDxJob(const DxArgs& a, int64_t workers, Isa isa) {
  // dx = dy @ W: in and out swap roles, so the moving side swaps (the transpose closure).
  return MakeTyped<ProductJob>(a.type, a.rows, a.w, a.w.out < a.w.in, a.dy, a.dx, workers,
                               KernelsFor(isa));
}

std::unique_ptr<Job> MakeDvaluesJob(const DvaluesArgs& a, int64_t workers, Isa isa) {
  return MakeTyped<DvaluesJob>(a.type, a, workers, KernelsFor(isa));
}

std::unique_ptr<Job> MakeBwdJob(const BwdArgs& a, int64_t workers, Isa isa) {
  return MakeTyped<BackwardJob>(a.type, a, workers, KernelsFor(isa));
}

}  // namespace dynadiag
