// emulation_launch.h - runs one emulated kernel launch on host threads (see emulation.h).
//
// emulate.py compiles a kernel source followed by this header and one generated line per kernel,
//   PRNN_EMU_ENTRY(name)
// which defines extern "C" functions
//   int prnn_emu_launch_<name>(grid, block, shared_bytes, max_resident, args): runs the launch;
//       `args` holds one pointer per kernel parameter (as cuLaunchKernel's kernelParams), unpacked
//       by a template that deduces the parameter types from the kernel's own signature. Returns 0,
//       or an error code whose text prnn_emu_error() gives.
//   const char* prnn_emu_signature_<name>(): one letter per parameter ('p' pointer, 'i' int32,
//       'I' uint32, 'q' int64, 'Q' uint64, 'f' float, 'd' double), for the launcher's checks.
#pragma once
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// Seconds after which a launch's timer jumps ahead so that every barrier wait ends (a launch can
// never hang on a barrier; the runtime's barrier timeouts are far shorter).
#ifndef PRNN_EMU_WATCHDOG_S
#define PRNN_EMU_WATCHDOG_S 120
#endif

// Tests: the last warp of every block runs only every PRNN_EMU_LAGGING_WARP-th round of the
// scheduler, so the other warps get that far ahead of it between two barriers (a GPU's warps
// drift apart; here they otherwise move in step): shared memory a warp reads while another may
// already overwrite it shows in the results. 0: every warp every round.
#ifndef PRNN_EMU_LAGGING_WARP
#define PRNN_EMU_LAGGING_WARP 0
#endif

namespace prnn_emu {

constexpr std::size_t kStackBytes = 128 * 1024;  // per CUDA thread; kernels keep small frames
#ifdef PRNN_EMU_THREAD_LIMIT
constexpr int kThreadRetries = 3;
#else
constexpr int kThreadRetries = 200;                // 10 ms apart: about 2 s of EAGAIN
#endif
constexpr std::size_t kGuardBytes = 4096;        // an overflow faults instead of corrupting
// Each guard page splits the stacks' mapping in two: guards for at most this many fibers at a
// time (in use or pooled), far below vm.max_map_count (65530 mappings, past which mprotect fails;
// a 132-CTA grid of 256 threads alone would need 67716). Stacks beyond it have the canary alone.
#ifndef PRNN_EMU_GUARDED_FIBERS  // tests: 0 leaves every stack to its canary
#define PRNN_EMU_GUARDED_FIBERS 12288
#endif
constexpr int kGuardedFibers = PRNN_EMU_GUARDED_FIBERS;
constexpr std::size_t kStackCanaryBytes = 256;   // at each stack's far end, checked after the block
constexpr std::size_t kCanaryBytes = 64;         // after shared memory, checked after the block
constexpr unsigned char kCanary = 0xA5;

enum Error { kOk = 0, kDeadlock = 1, kSharedOverrun = 2, kWatchdog = 3, kNoMemory = 4, kBadCluster = 5,
             kNoThreads = 6, kLateClusterStore = 7, kStackOverflow = 8, kPartialWarp = 9 };

// The text of the last launch this thread ran (prnn_emu_error).
inline thread_local char last_error[512] = "";

// Records the launch's first error (launch_state: the launch of the calling thread).
inline void fail(int code, const char* fmt, int a, int b) {
  LaunchState* state = launch_state;
  if (state == nullptr) return;
  const Hold hold(state->error_lock);
  if (state->error_code != kOk) return;  // keep the first error
  state->error_code = code;
  std::snprintf(state->error_text, sizeof state->error_text, fmt, a, b);
}

inline void report_late_store(int from, int to) {
  fail(kLateClusterStore, "block %d stored into the shared memory of block %d of its cluster after "
       "that block exited (a CTA must not exit while the cluster can still store into it)", from, to);
}

inline void report_partial_warp(int b, int warp) {
  fail(kPartialWarp, "block %d: warp %d ran an .aligned warp collective (mma, ldmatrix) without "
       "all 32 of its lanes (every lane must take part)", b, warp);
}

// emulation.h's hooks into the launcher's error reports, installed by the first launch only
// (launches that run at once would race on them).
inline std::once_flag hooks_installed;
inline void install_hooks() {
  std::call_once(hooks_installed, [] {
    late_store = report_late_store;
    partial_warp = report_partial_warp;
  });
}

template <class T>
constexpr char type_code() {
  if constexpr (std::is_pointer_v<T>) return 'p';
  else if constexpr (std::is_same_v<T, float>) return 'f';
  else if constexpr (std::is_same_v<T, double>) return 'd';
  else if constexpr (std::is_integral_v<T> && sizeof(T) == 4) return std::is_signed_v<T> ? 'i' : 'I';
  else if constexpr (std::is_integral_v<T> && sizeof(T) == 8) return std::is_signed_v<T> ? 'q' : 'Q';
  else return '?';
}

template <class... A>
const char* signature(void (*)(A...)) {
  static const char codes[] = {type_code<std::remove_cv_t<std::remove_reference_t<A>>>()..., '\0'};
  return codes;
}

template <class... A, std::size_t... I>
void call_kernel(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

// What a fiber runs: the kernel, then it leaves every barrier it belonged to (exited threads
// count as arrived) and returns to the scheduler for good.
struct Entry {
  void (*run)(void* kernel, void** args);
  void* kernel;
  void** args;
};
inline thread_local Entry entry;

inline void fiber_main() {
  entry.run(entry.kernel, entry.args);
  Block* b = block;
  {
    const Quiet quiet;  // (ended before the last switch: a fiber must not end Quiet)
    Fiber& f = b->fibers[b->current];
    f.done = true;
    f.copies.clear();  // issued and never waited for: nobody may read them
    for (Gate* g : {&b->block_gate, &b->warp_gates[b->current / kWarp]}) {
      happens_before(&g->sync[g->gen & 1u]);  // counts as arrived: its accesses come before
      if (--g->live <= g->arrived && g->arrived > 0) release(*g);
    }
  }
  race_fiber_switch(b->race_scheduler, true);  // the scheduler joins it
  setcontext(&b->scheduler);
}

// The order the scheduler visits a block's fibers in this round: 0, 1, ... or (kSchedule) a
// random permutation.
inline void visiting_order(std::vector<int>& order) {
  std::iota(order.begin(), order.end(), 0);
  if (!on(kSchedule)) return;
  for (int i = (int)order.size() - 1; i > 0; --i) std::swap(order[i], order[random_below(i + 1)]);
}

// A CTA's fiber stacks: one mapping of `threads` stacks, each above a gap of kGuardBytes that is
// a guard page (PROT_NONE) where the budget allows, and each with a canary at its far end.
struct StackSet {
  unsigned char* base = nullptr;
  int threads = 0;
  bool guarded = false;

  unsigned char* stack(int t) const { return base + t * (kGuardBytes + kStackBytes) + kGuardBytes; }
  std::size_t bytes() const { return threads * (kGuardBytes + kStackBytes); }
};

// Runs block `b` of the launch as `threads` fibers on the calling OS thread, in `shared` (the
// launcher's, for a cluster) or its own shared memory.
inline void run_block(int b, int threads, int shared_bytes, const StackSet& stacks,
                      std::vector<unsigned char>* cluster_buffer) {
  const Quiet quiet;  // the scheduler's state is shared with the fibers (a fiber is not Quiet)
  random_state = mix(mode_seed ^ mix((unsigned long long)b));
  const int warps = (threads + kWarp - 1) / kWarp;
  std::vector<Fiber> fibers(threads);
  std::vector<Gate> warp_gates(warps);
  for (int w = 0; w < warps; ++w) warp_gates[w].live = w + 1 < warps ? kWarp : threads - w * kWarp;
  std::vector<unsigned> slots(2 * threads * kSlotWords);
  // NaN-filled, so that reading shared memory nobody wrote shows in the results.
  std::vector<unsigned char> own;
  std::vector<unsigned char>& shared = cluster_buffer != nullptr ? *cluster_buffer : own;
  shared.assign(shared_bytes + kCanaryBytes, 0xFF);
  std::memset(shared.data() + shared_bytes, kCanary, kCanaryBytes);
  if (cluster_shared != nullptr) __atomic_store_n(&cluster_shared[b], shared.data(), __ATOMIC_RELEASE);
  // The warp held back (PRNN_EMU_LAGGING_WARP: the last, every n-th round; kSchedule: a random
  // one, every 2nd to 8th round).
  int lagging_warp = warps - 1, lag = PRNN_EMU_LAGGING_WARP;
  if (on(kSchedule)) {
    lagging_warp = (int)random_below(warps);
    lag = 2 + (int)random_below(7);
  }
  std::vector<int> order(threads);
  Block state;
  state.fibers = fibers.data();
  state.block_gate.live = threads;
  state.warp_gates = warp_gates.data();
  state.warp_slots = slots.data();
  state.shared = shared.data();
  state.shared_bytes = (unsigned)shared_bytes;
  state.race_scheduler = race_fiber_current();
  block = &state;
  block_idx.x = b;
  for (int t = 0; t < threads; ++t) {
    ucontext_t& c = fibers[t].context;
    getcontext(&c);
    c.uc_stack.ss_sp = stacks.stack(t);
    c.uc_stack.ss_size = kStackBytes;
    c.uc_link = nullptr;
    makecontext(&c, fiber_main, 0);
    fibers[t].race_fiber = race_fiber_create();  // after the block's set-up: ordered after it
  }
  // Round robin over the runnable fibers until all have exited.
  for (int alive = threads, round = 0; alive > 0; ++round) {
    bool ran = false, held = false;
    alive = 0;
    state.polled = state.worked = false;
    const unsigned long long began = progress.load(std::memory_order_acquire);
    visiting_order(order);
    for (int t : order) {
      Fiber& f = fibers[t];
      if (f.done) continue;
      ++alive;
      if (f.wait_gen != nullptr && *f.wait_gen == f.wait_val) continue;
      const bool lagging = lag > 0 && t / kWarp == lagging_warp;
      if (lagging && round % lag != 0) {
        ran = true;  // runnable, held back this round: not a deadlock
        held |= !f.polling;  // nor a round of polls only, if it has work
        continue;
      }
      f.wait_gen = nullptr;
      state.current = t;
      thread_idx.x = t;
      race_fiber_switch(f.race_fiber);
      swapcontext(&state.scheduler, &f.context);
      ran = true;
    }
    end_round(state.worked, state.polled && !held, began);
    if (state.polled && !state.worked) sleep_after_polls();
    if (alive > 0 && !ran) {  // every live thread waits on a barrier nobody else can reach
      fail(kDeadlock, "block %d: %d threads wait at a barrier that can never complete", b, alive);
      break;
    }
  }
  for (Fiber& f : fibers) race_fiber_destroy(f.race_fiber);
  drain(true);  // a kernel's stores are visible once it has exited
  progress.fetch_add(1, std::memory_order_acq_rel);
  if (cluster_exited != nullptr) cluster_exited[b].store(true, std::memory_order_release);
  for (int i = 0; i < (int)kCanaryBytes; ++i) {
    if (shared[shared_bytes + i] != kCanary) {
      fail(kSharedOverrun, "block %d wrote past its %d bytes of dynamic shared memory", b,
           shared_bytes);
      break;
    }
  }
  block = nullptr;
}

// Sets are kept between launches: mapping, guarding and faulting in a CTA's stacks anew cost
// more than a launch whose CTAs exit at once (a resume launch after a finished pass).
constexpr std::size_t kPooledStackSets = 160;  // a whole H100 grid (132 CTAs) and more
inline std::mutex stack_pool_lock;
inline std::vector<StackSet> stack_pool;
inline int guarded_fibers = 0;  // fibers of the sets with guard pages (stack_pool_lock)

inline StackSet take_stacks(int threads) {
  StackSet set;
  set.threads = threads;
  {
    std::lock_guard<std::mutex> hold(stack_pool_lock);
    // (The pool is one for the process: g++ makes inline variables unique across the emulated
    // libraries loaded. A library built without guards takes no guarded set.)
    for (std::size_t i = 0; i < stack_pool.size(); ++i) {
      if (stack_pool[i].threads == threads && (kGuardedFibers > 0 || !stack_pool[i].guarded)) {
        set = stack_pool[i];
        stack_pool[i] = stack_pool.back();
        stack_pool.pop_back();
        return set;
      }
    }
    set.guarded = guarded_fibers + threads <= kGuardedFibers;
    if (set.guarded) guarded_fibers += threads;
  }
  void* mem = mmap(nullptr, set.bytes(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    std::lock_guard<std::mutex> hold(stack_pool_lock);
    if (set.guarded) guarded_fibers -= threads;
    return StackSet{};
  }
  set.base = static_cast<unsigned char*>(mem);
  for (int t = 0; t < threads; ++t) {
    if (set.guarded) mprotect(set.stack(t) - kGuardBytes, kGuardBytes, PROT_NONE);
    std::memset(set.stack(t), kCanary, kStackCanaryBytes);
  }
  return set;
}

// `intact`: no stack overflowed (a set with a broken canary is never used again).
inline void give_back_stacks(const StackSet& set, bool intact) {
  std::lock_guard<std::mutex> hold(stack_pool_lock);
  if (intact && stack_pool.size() < kPooledStackSets) {
    stack_pool.push_back(set);
    return;
  }
  munmap(set.base, set.bytes());
  if (set.guarded) guarded_fibers -= set.threads;
}

// After a block: a fiber whose frames reached its stack's canary overflowed (where no guard
// page stopped it, it may have written into the gap below).
inline bool check_stacks(const StackSet& set, int b) {
  for (int t = 0; t < set.threads; ++t) {
    const unsigned char* canary = set.stack(t);
    for (std::size_t i = 0; i < kStackCanaryBytes; ++i) {
      if (canary[i] != kCanary) {
        fail(kStackOverflow, "block %d: thread %d overflowed its fiber stack (128 KiB)", b, t);
        return false;
      }
    }
  }
  return true;
}

// The whole grid: `resident` OS threads take blocks in index order (kShuffle: a random order),
// each starting its next block only when the previous one exited, as on a GPU too busy to hold
// the whole grid.
inline int launch_grid(void (*run)(void*, void**), void* kernel, int grid, int threads,
                       int shared_bytes, int max_resident, void** args, double watchdog_s) {
  LaunchState& state = *launch_state;
  install_hooks();
  const unsigned launch_modes = modes;
  const unsigned long long launch_seed = mode_seed;
  std::vector<int> order(grid);
  std::iota(order.begin(), order.end(), 0);
  if (on(kShuffle)) {
    random_state = mix(mode_seed);
    for (int i = grid - 1; i > 0; --i) std::swap(order[i], order[random_below(i + 1)]);
  }
  state.watchdog_ns = steady_ns() + (unsigned long long)(watchdog_s * 1e9);
  int resident = max_resident > 0 && max_resident < grid ? max_resident : grid;
#ifdef PRNN_CLUSTER
  // A cluster's CTAs are resident together (the GPU schedules a cluster whole): whole clusters
  // only, each block's shared memory published to the others.
  if (grid % PRNN_CLUSTER != 0) {
    fail(kBadCluster, "grid %d is not a multiple of the cluster size %d", grid, PRNN_CLUSTER);
    return state.error_code;
  }
  resident = (resident + PRNN_CLUSTER - 1) / PRNN_CLUSTER * PRNN_CLUSTER;
  if (resident != grid) {  // workers would start a cluster's blocks at different times
    fail(kBadCluster, "clusters run only with the whole grid resident (grid %d, resident %d)", grid, resident);
    return state.error_code;
  }
  // Every block's shared memory lives until the launch ends, so that a store into a block that
  // has exited is found (cluster_exited) instead of corrupting the heap.
  std::vector<unsigned char*> shared_of(grid, nullptr);
  std::vector<std::vector<unsigned char>> buffers(grid);
  std::unique_ptr<std::atomic<bool>[]> exited(new std::atomic<bool>[grid]);
  for (int i = 0; i < grid; ++i) exited[i].store(false);
  std::vector<unsigned> counters(grid / PRNN_CLUSTER, 0u);
  unsigned char** const launch_shared = shared_of.data();
  std::atomic<bool>* const launch_exited = exited.get();
  unsigned* const launch_counters = counters.data();
  std::vector<std::vector<unsigned char>>* cluster_buffers = &buffers;
#else
  unsigned char** const launch_shared = nullptr;
  std::atomic<bool>* const launch_exited = nullptr;
  unsigned* const launch_counters = nullptr;
  std::vector<std::vector<unsigned char>>* cluster_buffers = nullptr;
#endif
  std::atomic<int> next{0};
  // The workers sleep until all exist (spinning would take the cores from the thread creating
  // them: dozens of CTAs on a 2-core machine).
  std::mutex start_lock;
  std::condition_variable started;
  bool go = false;
  std::vector<std::thread> workers;
  auto worker = [&] {
    {
      std::unique_lock<std::mutex> wait(start_lock);
      started.wait(wait, [&] { return go; });
    }
    launch_state = &state;  // this launch's, in the CTA's thread
    modes = launch_modes;
    mode_seed = launch_seed;
#ifdef PRNN_CLUSTER
    cluster_size = PRNN_CLUSTER;
#endif
    cluster_shared = launch_shared;
    cluster_exited = launch_exited;
    cluster_counters = launch_counters;
    const StackSet stacks = take_stacks(threads);
    if (stacks.base == nullptr) {
      fail(kNoMemory, "cannot map stacks for %d threads (%d KiB each)", threads,
           (int)(kStackBytes / 1024));
      live_ctas.fetch_sub(1);
      return;
    }
    block_dim.x = threads;
    grid_dim.x = grid;
    entry = Entry{run, kernel, args};
    bool intact = true;
    for (int i; (i = next.fetch_add(1)) < grid;) {
      const int b = order[i];
      run_block(b, threads, shared_bytes, stacks, cluster_buffers ? &(*cluster_buffers)[b] : nullptr);
      intact = intact && check_stacks(stacks, b);
    }
    live_ctas.fetch_sub(1);  // no block left for this worker
    give_back_stacks(stacks, intact);
  };
  // Every worker exists before any block runs: a grid that could start only in part would leave
  // its started CTAs waiting on the others. Thread creation can fail for a moment on a loaded
  // machine (EAGAIN): retry for a while, then run no block and report it, never terminate.
  for (int w = 0; w < resident; ++w) {
    for (int attempt = 0;; ++attempt) {
      try {
#ifdef PRNN_EMU_THREAD_LIMIT  // tests: thread creation fails past this many workers
        if (w >= PRNN_EMU_THREAD_LIMIT)
          throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
#endif
        workers.emplace_back(worker);
        break;
      } catch (const std::system_error&) {
        if (attempt < kThreadRetries) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
          continue;
        }
        fail(kNoThreads, "cannot start thread %d of %d for the grid's CTAs (the system refused a new thread)", w + 1, resident);
        next.store(grid);  // the workers already started take no block
        break;
      }
    }
    if (state.error_code == kNoThreads) break;
  }
  {
    const Hold hold(clock_lock);
    live_ctas.fetch_add((int)workers.size());
    missed = 0;  // the workers are new threads: none has missed yet
    miss_progress = ~0ull;
    last_round_ns = steady_ns();
  }
  jumps_left.store(kJumpsPerLaunch);
  {
    std::lock_guard<std::mutex> hold(start_lock);
    go = true;
  }
  started.notify_all();
  for (auto& w : workers) w.join();
  if (state.watchdog_fired) fail(kWatchdog, "the launch ran past its %d s watchdog (grid %d); its barrier waits were ended", (int)watchdog_s, grid);
  return state.error_code;
}

// Launches may run at once (emulate.py's launch_async beside synchronous launches): what one
// launch owns lives in its LaunchState and in its CTAs' thread-locals; the virtual clock and its
// count of live CTAs are the machine's.
inline int launch(void (*run)(void*, void**), void* kernel, int grid, int threads,
                  int shared_bytes, int max_resident, void** args, double watchdog_s) {
  LaunchState state;
  launch_state = &state;
  const int code = launch_grid(run, kernel, grid, threads, shared_bytes, max_resident, args, watchdog_s);
  std::snprintf(last_error, sizeof last_error, "%s", state.error_text);
  launch_state = nullptr;
  return code;
}

template <class... A>
void run_kernel(void* kernel, void** args) {
  auto* k = reinterpret_cast<void (*)(A...)>(kernel);
  call_kernel(k, args, std::index_sequence_for<A...>{});
}

template <class... A>
int launch_kernel(void (*kernel)(A...), int grid, int threads, int shared_bytes,
                  int max_resident, void** args, double watchdog_s) {
  return launch(&run_kernel<A...>, reinterpret_cast<void*>(kernel), grid, threads, shared_bytes,
                max_resident, args, watchdog_s);
}

}  // namespace prnn_emu

// The error of the last launch the calling thread ran.
extern "C" const char* prnn_emu_error() { return prnn_emu::last_error; }

// The modes of the launches the calling thread runs next (emulation.h's Mode bits; emulate.py's
// MODES) and the seed of their random choices (emulate.py sets both before every launch, in the
// thread that launches: a seed per launch).
extern "C" void prnn_emu_set_modes(unsigned modes, unsigned long long seed) {
  prnn_emu::modes = modes;
  prnn_emu::mode_seed = seed;
}

#define PRNN_EMU_ENTRY(name)                                                                      \
  extern "C" int prnn_emu_launch_##name(int grid, int block, int shared_bytes, int max_resident, \
                                         void** args) {                                          \
    return prnn_emu::launch_kernel(&name, grid, block, shared_bytes, max_resident, args,           \
                                   PRNN_EMU_WATCHDOG_S);                                         \
  }                                                                                              \
  extern "C" const char* prnn_emu_signature_##name() { return prnn_emu::signature(&name); }
