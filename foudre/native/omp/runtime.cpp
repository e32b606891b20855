// A thread pool behind the OpenMP runtime calls that clang emits for the kernels' pragmas, for
// compilers that ship no OpenMP runtime (Apple's clang; clang without libomp). With it the
// kernels keep their OpenMP code as it is: build.py compiles them with `-Xclang -fopenmp` (code
// generation only: the driver links no runtime) and this file into the same library, whose
// runtime symbols stay hidden (they bind to these definitions, not to another runtime the
// process may have loaded).
//
// What it serves: `parallel` regions (__kmpc_fork_call; nested ones run on the calling thread
// alone), `if (...)` regions that run serially (__kmpc_serialized_parallel), static loops
// (__kmpc_for_static_init_*: the iterations in one contiguous share per thread, or chunks dealt
// round-robin), dynamic and guided loops (__kmpc_dispatch_*: chunks taken from a shared
// counter), barriers, and the omp_get_* queries. The threads: OMP_NUM_THREADS, else the
// hardware's, else as foudre_omp_set_num_threads sets (the Python side passes torch's).
// A loop's iterations are the same whichever thread runs them, and the kernels' results do
// not depend on which thread computes a row, so the results equal an OpenMP build's.

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#define FOUDRE_OMP extern "C" __attribute__((visibility("hidden")))

namespace {

using Microtask = void (*)(int32_t*, int32_t*, ...);
constexpr int kMaxArgs = 64;  // a region's shared variables (more: the call aborts)
constexpr int kLoopSlots = 8;  // dispatch loops in flight at once (each ends at a barrier)

// One dynamic or guided loop of a team: the next iteration not yet handed out.
struct Loop {
  std::atomic<int64_t> seq{-1};  // which of the team's loops this slot holds
  std::mutex init;
  std::atomic<int64_t> next{0};
  int64_t upper = 0, step = 1, chunk = 1;
  bool guided = false;
};

struct Team {
  int threads = 1;
  std::atomic<int> arrived{0};
  std::atomic<int> generation{0};
  Loop loops[kLoopSlots];
  void barrier() {
    if (threads == 1) return;
    const int gen = generation.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == threads) {
      arrived.store(0, std::memory_order_relaxed);
      generation.fetch_add(1, std::memory_order_acq_rel);
      return;
    }
    for (int spins = 0; generation.load(std::memory_order_acquire) == gen; ++spins)
      if (spins > 1000) std::this_thread::yield();
  }
};

// What a thread knows of the region it runs in.
struct ThreadState {
  Team* team = nullptr;  // null: outside any region (a team of one)
  int num = 0;           // its number in the team
  int depth = 0;         // regions entered (nested ones run serially)
  int64_t loops = 0;     // dispatch loops it has started in this region
  int32_t gtid = 0;      // its global id (0: the first thread to ask)
};
thread_local ThreadState t_state;
std::atomic<int32_t> g_next_gtid{0};

int32_t global_id() {
  static thread_local bool assigned = false;
  if (!assigned) {
    t_state.gtid = g_next_gtid.fetch_add(1);
    assigned = true;
  }
  return t_state.gtid;
}

int default_threads() {
  if (const char* env = std::getenv("OMP_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? static_cast<int>(hw) : 1;
}
std::atomic<int> g_threads{0};  // 0: not set yet

int max_threads() {
  int n = g_threads.load(std::memory_order_relaxed);
  if (n == 0) {
    n = default_threads();
    g_threads.store(n, std::memory_order_relaxed);
  }
  return n;
}

// the region's body called with its argc shared variables' addresses (or values), for each
// argc a function of its own (a C variadic call's arguments are fixed where it is compiled)
template <size_t... I>
void call_with(Microtask f, int32_t* gtid, int32_t* btid, void** a, std::index_sequence<I...>) {
  f(gtid, btid, a[I]...);
}
using Invoker = void (*)(Microtask, int32_t*, int32_t*, void**);
template <size_t... N>
constexpr std::array<Invoker, sizeof...(N)> invokers(std::index_sequence<N...>) {
  return {{[](Microtask f, int32_t* g, int32_t* b, void** a) {
    call_with(f, g, b, a, std::make_index_sequence<N>());
  }...}};
}
constexpr auto kInvokers = invokers(std::make_index_sequence<kMaxArgs + 1>());

void invoke(Microtask f, int32_t* gtid, int32_t* btid, int argc, void** a) {
  kInvokers[argc](f, gtid, btid, a);
}

// The workers: each waits for a region, runs its share, and says it is done.
class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      ++generation_;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  // job(num) on threads 0 .. n - 1 of a team, the caller being number 0
  void run(int n, const std::function<void(int)>& job) {
    std::lock_guard<std::mutex> one_region(region_);  // one region at a time from the top
    grow(n - 1);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      team_size_ = n;
      pending_.store(n - 1, std::memory_order_release);
      ++generation_;
    }
    wake_.notify_all();
    job(0);
    for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins)
      if (spins > 1000) std::this_thread::yield();
  }

 private:
  void grow(int n) {
    while (static_cast<int>(workers_.size()) < n) {
      const int num = static_cast<int>(workers_.size()) + 1;
      int64_t now;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        now = generation_;  // (a new worker waits for the next region, not a past one)
      }
      workers_.emplace_back([this, num, now] { work(num, now); });
    }
  }

  void work(int num, int64_t seen) {
    for (;;) {
      const std::function<void(int)>* job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (stop_) return;
        if (num >= team_size_) continue;
        job = job_;
      }
      (*job)(num);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::mutex region_, mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* job_ = nullptr;
  int team_size_ = 0;
  int64_t generation_ = 0;
  bool stop_ = false;
  std::atomic<int> pending_{0};
};

Pool& pool() {
  static Pool p;
  return p;
}

int team_threads() { return t_state.team ? t_state.team->threads : 1; }

// The share of a static loop's trip count that thread `num` of `threads` runs.
void static_share(int64_t trip, int num, int threads, int64_t* first, int64_t* count) {
  const int64_t small = trip / threads, extra = trip % threads;
  *first = num * small + (num < extra ? num : extra);
  *count = small + (num < extra ? 1 : 0);
}

template <typename I>
void static_init(int32_t schedule, int32_t* last, I* lower, I* upper, I* stride, I incr,
                 I chunk) {
  const int threads = team_threads(), num = t_state.team ? t_state.num : 0;
  const int64_t lo = static_cast<int64_t>(*lower), hi = static_cast<int64_t>(*upper);
  const int64_t inc = static_cast<int64_t>(incr);
  const int64_t trip = inc > 0 ? (hi >= lo ? (hi - lo) / inc + 1 : 0)
                               : (lo >= hi ? (lo - hi) / -inc + 1 : 0);
  if (schedule == 33 && chunk > 0) {  // chunks dealt round-robin
    const int64_t c = static_cast<int64_t>(chunk);
    *lower = static_cast<I>(lo + num * c * inc);
    *upper = static_cast<I>(lo + (num * c + c - 1) * inc);
    *stride = static_cast<I>(c * threads * inc);
    if (last) *last = trip > 0 && ((trip - 1) / c) % threads == num;
    return;
  }
  int64_t first, count;
  static_share(trip, num, threads, &first, &count);
  *lower = static_cast<I>(lo + first * inc);
  *upper = static_cast<I>(lo + (first + count - 1) * inc);  // below lower: nothing to run
  *stride = static_cast<I>(trip * inc);
  if (last) *last = count > 0 && first + count == trip;
}

template <typename I>
void dispatch_init(int32_t schedule, I lb, I ub, I st, I chunk) {
  Team* team = t_state.team;
  if (team == nullptr) {  // a loop outside any region: a team of one, its own slot
    static thread_local Team alone;
    team = &alone;
    t_state.team = team;
    t_state.num = 0;
    t_state.loops = 0;
  }
  const int64_t seq = t_state.loops++;
  Loop& loop = team->loops[seq % kLoopSlots];
  if (loop.seq.load(std::memory_order_acquire) != seq) {
    std::lock_guard<std::mutex> lock(loop.init);
    if (loop.seq.load(std::memory_order_relaxed) != seq) {
      loop.next.store(static_cast<int64_t>(lb), std::memory_order_relaxed);
      loop.upper = static_cast<int64_t>(ub);
      loop.step = static_cast<int64_t>(st);
      loop.chunk = chunk > 0 ? static_cast<int64_t>(chunk) : 1;
      // guided: 36 (kmp_sch_guided_chunked), 42, 43 and their nonmonotonic forms
      const int32_t kind = schedule & ~(1 << 30) & ~(1 << 29);
      loop.guided = kind == 36 || kind == 42 || kind == 43;
      loop.seq.store(seq, std::memory_order_release);
    }
  }
}

template <typename I>
int dispatch_next(int32_t* last, I* lb, I* ub, I* st) {
  Team* team = t_state.team;
  const int64_t seq = t_state.loops - 1;
  Loop& loop = team->loops[seq % kLoopSlots];
  const int64_t step = loop.step, upper = loop.upper;
  int64_t start = loop.next.load(std::memory_order_relaxed), size;
  for (;;) {
    const int64_t left = step > 0 ? (upper - start) / step + 1 : (start - upper) / -step + 1;
    if ((step > 0 && start > upper) || (step < 0 && start < upper) || left <= 0) {
      if (team == t_state.team && team->threads == 1 && t_state.depth == 0) t_state.team = nullptr;
      return 0;
    }
    size = loop.chunk;
    if (loop.guided) {
      const int64_t share = left / (2 * team->threads);
      if (share > size) size = share;
    }
    if (size > left) size = left;
    if (loop.next.compare_exchange_weak(start, start + size * step, std::memory_order_acq_rel))
      break;
  }
  *lb = static_cast<I>(start);
  *ub = static_cast<I>(start + (size - 1) * step);
  *st = static_cast<I>(step);
  if (last) {
    const int64_t end = start + size * step;
    *last = step > 0 ? end > upper : end < upper;
  }
  return 1;
}

}  // namespace

extern "C" {

// the threads a region runs on from now on (n >= 1)
__attribute__((visibility("default"))) void foudre_omp_set_num_threads(int n) {
  if (n > 0) g_threads.store(n, std::memory_order_relaxed);
}

FOUDRE_OMP int omp_get_max_threads(void) { return max_threads(); }
FOUDRE_OMP int omp_get_num_threads(void) { return team_threads(); }
FOUDRE_OMP int omp_get_thread_num(void) { return t_state.team ? t_state.num : 0; }

FOUDRE_OMP int32_t __kmpc_global_thread_num(void*) { return global_id(); }

FOUDRE_OMP void __kmpc_fork_call(void*, int32_t argc, Microtask task, ...) {
  if (argc > kMaxArgs) {
    std::fprintf(stderr, "foudre's OpenMP runtime: a region of %d variables (at most %d)\n", argc,
                 kMaxArgs);
    std::abort();
  }
  void* args[kMaxArgs];
  va_list ap;
  va_start(ap, task);
  for (int i = 0; i < argc; ++i) args[i] = va_arg(ap, void*);
  va_end(ap);
  const int threads = t_state.depth > 0 ? 1 : max_threads();
  const auto body = [&](Team* team, int num) {
    const ThreadState saved = t_state;
    global_id();
    t_state.team = team;
    t_state.num = num;
    t_state.depth = saved.depth + 1;
    t_state.loops = 0;
    int32_t gtid = t_state.gtid, btid = num;
    invoke(task, &gtid, &btid, argc, args);
    t_state = saved;
  };
  Team team;
  team.threads = threads;
  if (threads == 1) {
    body(&team, 0);
    return;
  }
  pool().run(threads, [&](int num) { body(&team, num); });
}

thread_local std::vector<ThreadState> t_serialized;

FOUDRE_OMP void __kmpc_serialized_parallel(void*, int32_t) {
  static thread_local Team alone;  // (a team of one: its barriers return at once)
  t_serialized.push_back(t_state);
  t_state.team = &alone;
  t_state.num = 0;
  t_state.depth += 1;
  t_state.loops = 0;
}

FOUDRE_OMP void __kmpc_end_serialized_parallel(void*, int32_t) {
  t_state = t_serialized.back();
  t_serialized.pop_back();
}

FOUDRE_OMP void __kmpc_barrier(void*, int32_t) {
  if (t_state.team) t_state.team->barrier();
}

FOUDRE_OMP void __kmpc_for_static_init_4(void*, int32_t, int32_t schedule, int32_t* last,
                                         int32_t* lower, int32_t* upper, int32_t* stride,
                                         int32_t incr, int32_t chunk) {
  static_init<int32_t>(schedule, last, lower, upper, stride, incr, chunk);
}
FOUDRE_OMP void __kmpc_for_static_init_4u(void*, int32_t, int32_t schedule, int32_t* last,
                                          uint32_t* lower, uint32_t* upper, int32_t* stride,
                                          int32_t incr, int32_t chunk) {
  static_init<int32_t>(schedule, last, reinterpret_cast<int32_t*>(lower),
                       reinterpret_cast<int32_t*>(upper), stride, incr, chunk);
}
FOUDRE_OMP void __kmpc_for_static_init_8(void*, int32_t, int32_t schedule, int32_t* last,
                                         int64_t* lower, int64_t* upper, int64_t* stride,
                                         int64_t incr, int64_t chunk) {
  static_init<int64_t>(schedule, last, lower, upper, stride, incr, chunk);
}
FOUDRE_OMP void __kmpc_for_static_init_8u(void*, int32_t, int32_t schedule, int32_t* last,
                                          uint64_t* lower, uint64_t* upper, int64_t* stride,
                                          int64_t incr, int64_t chunk) {
  static_init<int64_t>(schedule, last, reinterpret_cast<int64_t*>(lower),
                       reinterpret_cast<int64_t*>(upper), stride, incr, chunk);
}
FOUDRE_OMP void __kmpc_for_static_fini(void*, int32_t) {}

FOUDRE_OMP void __kmpc_dispatch_init_4(void*, int32_t, int32_t schedule, int32_t lb, int32_t ub,
                                       int32_t st, int32_t chunk) {
  dispatch_init<int32_t>(schedule, lb, ub, st, chunk);
}
FOUDRE_OMP void __kmpc_dispatch_init_4u(void*, int32_t, int32_t schedule, uint32_t lb,
                                        uint32_t ub, int32_t st, int32_t chunk) {
  dispatch_init<int64_t>(schedule, lb, ub, st, chunk);
}
FOUDRE_OMP void __kmpc_dispatch_init_8(void*, int32_t, int32_t schedule, int64_t lb, int64_t ub,
                                       int64_t st, int64_t chunk) {
  dispatch_init<int64_t>(schedule, lb, ub, st, chunk);
}
FOUDRE_OMP void __kmpc_dispatch_init_8u(void*, int32_t, int32_t schedule, uint64_t lb,
                                        uint64_t ub, int64_t st, int64_t chunk) {
  dispatch_init<int64_t>(schedule, static_cast<int64_t>(lb), static_cast<int64_t>(ub), st,
                         chunk);
}
FOUDRE_OMP int __kmpc_dispatch_next_4(void*, int32_t, int32_t* last, int32_t* lb, int32_t* ub,
                                      int32_t* st) {
  return dispatch_next<int32_t>(last, lb, ub, st);
}
FOUDRE_OMP int __kmpc_dispatch_next_4u(void*, int32_t, int32_t* last, uint32_t* lb,
                                       uint32_t* ub, int32_t* st) {
  int64_t l, u, s;
  const int got = dispatch_next<int64_t>(last, &l, &u, &s);
  *lb = static_cast<uint32_t>(l), *ub = static_cast<uint32_t>(u), *st = static_cast<int32_t>(s);
  return got;
}
FOUDRE_OMP int __kmpc_dispatch_next_8(void*, int32_t, int32_t* last, int64_t* lb, int64_t* ub,
                                      int64_t* st) {
  return dispatch_next<int64_t>(last, lb, ub, st);
}
FOUDRE_OMP int __kmpc_dispatch_next_8u(void*, int32_t, int32_t* last, uint64_t* lb,
                                       uint64_t* ub, int64_t* st) {
  return dispatch_next<int64_t>(last, reinterpret_cast<int64_t*>(lb),
                                reinterpret_cast<int64_t*>(ub), st);
}
FOUDRE_OMP void __kmpc_dispatch_fini_4(void*, int32_t) {}
FOUDRE_OMP void __kmpc_dispatch_fini_8(void*, int32_t) {}

}  // extern "C"
