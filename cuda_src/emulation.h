// emulation.h - host versions of the hw.cuh primitives, so that the cuda_src kernels compile with
// g++ (-std=c++17 -DPRNN_EMULATION) and run on the CPU. Included by hw.cuh when PRNN_EMULATION is
// defined; emulation_launch.h runs a launch.
//
// Execution model: every CTA is one OS thread; its CUDA threads are fibers (ucontext) that the
// CTA's thread switches between only where CUDA threads wait for each other (block barriers, warp
// shuffles, back-off in polling loops). So a block barrier costs one context switch per thread,
// not an OS wake-up, and a 2-core machine runs grids of hundreds of threads. Fibers never move
// between OS threads, so thread_local state below is per CTA.
//
// What is modelled: thread and block identity, per-block dynamic shared memory (filled with NaN,
// with an overrun check), block barriers (also with an OR-reduction; exited threads count as
// arrived, as on sm_70+), warp collectives (shuffles, tensor-core mma, ldmatrix), acquire/release
// atomics across CTAs, the global timer (a virtual clock that runs only while every resident CTA
// waits, or the steady clock) and CTAs that are not co-resident. Seeded modes (Mode) make the
// machine weaker than the GPU in one respect each: CTA start order, schedules, cp.async
// completion, store visibility, the timer's grain. What is not modelled: L1 incoherence and
// unordered plain stores, warp-synchronous execution and divergence, timing, and performance.
#pragma once
#include <math.h>
#include <sched.h>
#include <time.h>
#include <ucontext.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifdef PRNN_EMU_TSAN
#include <sanitizer/tsan_interface.h>
#endif

#define PRNN_HD inline
#define PRNN_DEVICE inline
#define PRNN_KERNEL extern "C"
#define __launch_bounds__(...)
#define __forceinline__ inline
#define __host__
#define __device__
#define __global__

// CUDA's overloads of the math functions for float (exp(float), tanh(float), fmax, ...).
using std::exp;
using std::fmax;
using std::fmin;
using std::tanh;

namespace prnn_emu {

constexpr int kWarp = 32;
constexpr int kSlotWords = 6;  // the most words a lane gives a warp collective (mma: A and B)

// ---- the race detector (PRNN_EMU_TSAN: emulate.py's race-detector builds, -fsanitize=thread) ----
// Every CUDA thread is a ThreadSanitizer fiber, and switching between fibers is no happens-before
// edge: a CTA's threads are ordered only by what orders them on the GPU - the block and warp
// barriers (an arrival releases, leaving acquires: wait_at), the cluster barrier and the acquire /
// release atomics (instrumented by the compiler) - so a pair of shared-memory accesses that no
// barrier orders is a reported race whatever the schedule. The emulator's own bookkeeping, which a
// CTA's fibers and its scheduler share without such edges (gates, queues, the scheduler's state,
// random numbers), runs unobserved inside a Quiet scope; the kernels' accesses never do (but for
// the stores kDelayed lands from its queue).
#ifdef PRNN_EMU_TSAN
extern "C" {
void __tsan_ignore_thread_begin(void);
void __tsan_ignore_thread_end(void);
}
struct Quiet {
  Quiet() { __tsan_ignore_thread_begin(); }
  ~Quiet() { __tsan_ignore_thread_end(); }
  Quiet(const Quiet&) = delete;
  Quiet& operator=(const Quiet&) = delete;
};
inline void happens_before(const void* sync) { __tsan_release(const_cast<void*>(sync)); }
inline void happens_after(const void* sync) { __tsan_acquire(const_cast<void*>(sync)); }
inline void* race_fiber_create() { return __tsan_create_fiber(0); }
inline void race_fiber_destroy(void* fiber) { __tsan_destroy_fiber(fiber); }
inline void* race_fiber_current() { return __tsan_get_current_fiber(); }
// Called right before the context switch to `fiber`; `joined`: the switch is a happens-before
// edge (a fiber's exit, which its scheduler joins).
inline void race_fiber_switch(void* fiber, bool joined = false) {
  __tsan_switch_to_fiber(fiber, joined ? 0u : __tsan_switch_to_fiber_no_sync);
}
#else
struct Quiet {};
inline void happens_before(const void*) {}
inline void happens_after(const void*) {}
inline void* race_fiber_create() { return nullptr; }
inline void race_fiber_destroy(void*) {}
inline void* race_fiber_current() { return nullptr; }
inline void race_fiber_switch(void*, bool = false) {}
#endif

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

// A barrier among the live threads of a block or a warp: the last arrival bumps `gen`, which
// releases the fibers waiting on it.
struct Gate {
  unsigned gen = 0;
  int arrived = 0;
  int live = 0;
  // The race detector's sync objects, by generation parity: a thread arriving at the next
  // generation must not release into the one its slower partners have yet to acquire.
  char sync[2] = {};
};

// A cp.async issued and not yet waited for (kLateCopies), with the commit group it joins (the
// fiber's commits before it: prnn_copy_commit).
struct Copy {
  float* dst;
  const float* src;
  int n;
  unsigned group;
};

struct Fiber {
  ucontext_t context;
  std::vector<Copy> copies;  // kLateCopies: issued, completed at this fiber's prnn_copy_wait
  unsigned commits = 0;      // prnn_copy_commit calls so far (the group a new copy joins)
  const unsigned* wait_gen = nullptr;  // blocked while *wait_gen == wait_val
  unsigned wait_val = 0;
  int shuffles = 0;  // warp collectives so far: the parity selects the slot buffer
  bool done = false;
  bool polling = false;  // switched out in a poll's pause (holding it back holds back no work)
  void* race_fiber = nullptr;  // its ThreadSanitizer fiber (PRNN_EMU_TSAN)
};

// One CTA: its fibers, barriers, shuffle slots and shared memory.
struct Block {
  ucontext_t scheduler;
  Fiber* fibers = nullptr;
  int current = 0;
  Gate block_gate;
  Gate* warp_gates = nullptr;
  int or_pending = 0, or_result = 0;  // prnn_sync_block_or
  bool polled = false, worked = false;  // in this scheduler round: a fiber paused polling / did
                                        // something else (the virtual clock's miss, below)
  unsigned* warp_slots = nullptr;     // [2][blockDim.x][kSlotWords] (warp_collective)
  unsigned char* shared = nullptr;
  unsigned shared_bytes = 0;
  void* race_scheduler = nullptr;  // the OS thread's ThreadSanitizer fiber (PRNN_EMU_TSAN)
};

inline thread_local Dim3 thread_idx, block_idx, block_dim, grid_dim;
inline thread_local Block* block = nullptr;

// ---- seeded modes: a machine weaker than the GPU, one respect at a time --------------------------
// emulate.py's MODES names these bits in this order; prnn_emu_set_modes sets them per launch.
enum Mode : unsigned {
  kShuffle = 1u << 0,      // CTAs start in a random order (CUDA promises none)
  kRealTime = 1u << 1,     // the timer is host wall time instead of the virtual clock
  kJumpyTimer = 1u << 2,   // the timer in 1 us steps with random forward jumps (preemption)
  kSchedule = 1u << 3,     // random fiber order, a random lagging warp, switches at shared-memory
                           // accesses, random mid-step CTA stalls
  kLateCopies = 1u << 4,   // cp.async completes only at its wait; its destination reads NaN before
  kDelayed = 1u << 5,      // relaxed and cluster stores become visible after a random delay; a
                           // reader yields between the words of a quad
};
// Per launch (thread-local: prnn_emu_set_modes sets the launching thread's, the launcher copies
// them into its CTAs' threads), so that launches running at once keep their own.
inline thread_local unsigned modes = 0u;
inline thread_local unsigned long long mode_seed = 0ull;  // this launch's (emulate.py draws one per launch)
inline bool on(unsigned m) { return (modes & m) != 0u; }

// The CTA's random numbers (splitmix64), seeded from the launch's seed and the block.
inline thread_local unsigned long long random_state = 0ull;
inline unsigned long long mix(unsigned long long x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
inline unsigned random_below(unsigned n) {
  const Quiet quiet;  // one state for the CTA's fibers
  random_state = mix(random_state);
  return (unsigned)(random_state % n);
}
// A lock held for a few instructions that yields the core while it waits: with far more CTA
// threads than cores a holder is often descheduled, and spinning would burn whole time slices.
// (Not std::mutex: <mutex> declares an extern "C" function, which emulate.py would take for a
// kernel.)
struct SpinLock {
  std::atomic_flag flag = ATOMIC_FLAG_INIT;
  void lock() {
    while (flag.test_and_set(std::memory_order_acquire)) sched_yield();
  }
  void unlock() { flag.clear(std::memory_order_release); }
};
struct Hold {
  SpinLock& lock;
  explicit Hold(SpinLock& l) : lock(l) { lock.lock(); }
  ~Hold() { lock.unlock(); }
};
// One launch's own state, shared by its launching thread and its CTAs' threads (each holds a
// pointer, `launch_state`): launches that run at once (an asynchronous launch beside synchronous
// ones, emulate.py's launch_async) keep apart their watchdog and their first error.
// watchdog_ns: once a launch has run past it, the timer jumps far ahead, so every deadline passes
// and every polling loop ends.
struct LaunchState {
  unsigned long long watchdog_ns = ~0ull;
  bool watchdog_fired = false;
  SpinLock error_lock;
  int error_code = 0;  // emulation_launch.h's Error
  char error_text[512] = "";
};
inline thread_local LaunchState* launch_state = nullptr;

inline unsigned long long steady_ns() {
  using namespace std::chrono;
  return (unsigned long long)duration_cast<nanoseconds>(steady_clock::now().time_since_epoch())
      .count();
}

// Whether the launch has run past its watchdog (host wall time, whatever the timer's mode).
inline bool past_watchdog() {
  LaunchState* state = launch_state;
  if (state == nullptr || steady_ns() <= state->watchdog_ns) return false;
  __atomic_store_n(&state->watchdog_fired, true, __ATOMIC_RELAXED);
  return true;
}

// ---- the virtual clock -----------------------------------------------------------------------
// Deadlines must not depend on the host's load: a CTA descheduled by a busy machine is slow, not
// stuck. So the timer stands still (but for 1 ns per read, so that it never stays) while CTAs
// make progress, and advances 1-10 kIdleQuantumNs (the host time since the last advance,
// bounded) each time every resident CTA has missed: that is, only while no CTA can make progress
// without time passing - a CTA that will never come, or a stall. A CTA misses when a round of its
// scheduler ran fibers that only polled in vain (the others blocked at barriers, none held back:
// a lagging warp still has work). Progress anywhere voids the misses counted so far: a CTA whose
// round did anything else (a store, a barrier, a copy) moves `progress` on at the round's end,
// and a miss counts only if `progress` is where it was when the missing round began - a poll that
// failed before another CTA published is no evidence that the wait needs time.
constexpr unsigned long long kIdleQuantumNs = 1000000;
constexpr unsigned long long kNoMiss = ~0ull;
inline std::atomic<unsigned long long> virtual_ns{1};
inline std::atomic<int> live_ctas{0};  // resident workers of every launch running (launchers add theirs)
inline std::atomic<unsigned long long> progress{0ull};  // rounds, over all CTAs, that did work
inline SpinLock clock_lock;
// Under clock_lock: the progress value the current count of misses belongs to, the count, and a
// number for each count (a CTA counts once per count: `counted_in`).
inline unsigned long long miss_progress = ~0ull;
inline int missed = 0;
inline unsigned long long count_no = 0ull;
inline unsigned long long last_round_ns = 0ull;  // host time the clock last moved
inline thread_local unsigned long long counted_in = kNoMiss;

// Called by every primitive that is not part of a poll: the CTA's round makes progress.
inline void working() {
  const Quiet quiet;
  if (block != nullptr) block->worked = true;
}

// Called at the end of each scheduler round of a CTA; `began` is `progress` when it began.
inline void end_round(bool worked, bool missed_round, unsigned long long began) {
  if (worked) {
    progress.fetch_add(1, std::memory_order_acq_rel);
    return;
  }
  if (!missed_round) return;
  const Hold hold(clock_lock);
  if (progress.load(std::memory_order_acquire) != began) return;  // someone moved on meanwhile
  if (miss_progress != began) {  // the first miss since the last progress: a new count
    miss_progress = began;
    missed = 0;
    ++count_no;
  }
  if (counted_in != count_no) {
    counted_in = count_no;
    ++missed;
  }
  // (checked on every miss: the count also completes when CTAs that had not missed exit)
  if (missed < live_ctas.load(std::memory_order_relaxed)) return;
  // At least a quantum, at most ten: about wall-time speed while everything waits, never much
  // from a CTA's slow work before its miss.
  const unsigned long long now = steady_ns(), idle = now - last_round_ns;
  last_round_ns = now;
  virtual_ns.fetch_add(idle < kIdleQuantumNs ? kIdleQuantumNs : idle > 10 * kIdleQuantumNs ? 10 * kIdleQuantumNs : idle,
                       std::memory_order_relaxed);
  missed = 0;  // every CTA misses again before the next move
  ++count_no;
}

// kJumpyTimer: forward jumps of up to kMaxJumpNs, at most kJumpsPerLaunch per launch (the
// clock is global: unbounded jumps would add up to any timeout in a long launch, where a GPU's
// preemptions are rare).
constexpr unsigned kMaxJumpNs = 5000000;
constexpr int kJumpsPerLaunch = 16;
inline std::atomic<int> jumps_left{0};

inline unsigned long long timer_ns() {
  if (past_watchdog()) return steady_ns() + (1ull << 62);
  if (on(kRealTime)) return steady_ns();
  unsigned long long t = virtual_ns.fetch_add(1, std::memory_order_relaxed);
  if (on(kJumpyTimer)) {  // a jump, while the launch has some left, at 1 read in 64
    if (random_below(64) == 0 && jumps_left.fetch_sub(1, std::memory_order_relaxed) > 0) {
      t = virtual_ns.fetch_add(random_below(kMaxJumpNs), std::memory_order_relaxed);
    }
    t -= t % 1000;
  }
  return t;
}

// Gives the CTA's OS thread to the next runnable fiber; returns when this fiber runs again.
inline void switch_out() {
  Block* b = block;
  race_fiber_switch(b->race_scheduler);
  swapcontext(&b->fibers[b->current].context, &b->scheduler);
}

// ---- delayed visibility (kDelayed) ------------------------------------------------------------
// A CTA's relaxed and cluster stores wait in its queue and land after a random number of the CTA's
// ticks (its polls, pauses and barriers), a later store to the same address never before an
// earlier one; release operations, fences, the cluster barrier and the CTA's exit drain it first.
struct Pending {
  unsigned* addr;
  unsigned value;
  unsigned due;
  int cta;  // the cluster CTA whose shared memory holds addr; -1: global memory
};
inline thread_local std::vector<Pending> pending;
inline thread_local unsigned tick = 0u;

// Clusters: each block's shared memory by block index (set by the launcher before the blocks
// run; kept until the launch ends), which blocks have exited, and one arrival counter per cluster
// for the cluster barrier (one launch at a time).
// (Thread-local: the launcher sets them in each of its CTAs' threads, so a launch without
// clusters running at the same time sees none.)
inline thread_local unsigned char** cluster_shared = nullptr;
inline thread_local std::atomic<bool>* cluster_exited = nullptr;
inline thread_local unsigned* cluster_counters = nullptr;  // [clusters]: arrivals, monotonically increasing
inline thread_local int cluster_size = 1;
// Set to the launcher's error reporters: a store into the shared memory of a CTA that exited; a
// whole-warp collective (mma, ldmatrix) with fewer than 32 live lanes.
inline void (*late_store)(int from, int to) = nullptr;
inline void (*partial_warp)(int block, int warp) = nullptr;

inline void land(const Pending& s) {
  working();  // a store becoming visible is progress (kDelayed lands them during polls too)
  if (s.cta >= 0 && cluster_exited[s.cta].load(std::memory_order_acquire)) {
    late_store((int)block_idx.x, s.cta);
    return;
  }
  __atomic_store_n(s.addr, s.value, __ATOMIC_RELAXED);
}

// A relaxed store at once, or into the queue (kDelayed).
inline void store_relaxed(unsigned* p, unsigned v, int cta = -1) {
  working();
  const Pending s{p, v, 0u, cta};
  if (!on(kDelayed)) return land(s);
  const Quiet quiet;  // (the race detector does not see stores landed from the queue)
  unsigned due = tick + 1u + random_below(64);
  for (const Pending& q : pending) {
    if (q.addr == p && q.due > due) due = q.due;  // per-address order
  }
  pending.push_back({p, v, due, cta});
}

// Lands the stores that are due (all: every one), in the order they were made.
inline void drain(bool all = false) {
  const Quiet quiet;
  ++tick;
  if (pending.empty()) return;
  std::size_t kept = 0;
  for (const Pending& s : pending) {
    if (all || s.due <= tick) land(s);
    else pending[kept++] = s;
  }
  pending.resize(kept);
}

// ---- random schedules (kSchedule) -------------------------------------------------------------
// Sometimes gives the OS thread to another fiber at a shared-memory access.
inline void maybe_switch() {
  if (on(kSchedule) && random_below(16) == 0) switch_out();
}
// Sometimes holds the whole CTA for up to 2 ms (an SM busy with another kernel's warps): the CTA
// is working, so under the virtual clock its partners wait without timing out.
inline void maybe_stall_cta() {
  if (!on(kSchedule) || random_below(4096) != 0) return;
  const timespec pause{0, (long)random_below(2000000)};
  nanosleep(&pause, nullptr);
}

// A polling thread's pause: marks the scheduler round as polled (the virtual clock), lands due
// stores and lets the block's other fibers run. A round in which the CTA only polled ends with a
// short sleep (run_block), once for the CTA rather than once per polling fiber, so that spinning
// CTAs neither burn the few cores of a CI machine nor make a stalled CTA's rounds slow.
inline void pause_polling() {
  const Quiet quiet;
  block->polled = true;
  drain();
  maybe_stall_cta();
  Fiber& f = block->fibers[block->current];
  f.polling = true;
  switch_out();
  f.polling = false;
}

inline void sleep_after_polls() {
  const timespec pause{0, 20000};
  nanosleep(&pause, nullptr);
}

inline void release(Gate& g) {
  g.arrived = 0;
  ++g.gen;
}

inline void wait_at(Gate& g) {
  const Quiet quiet;
  working();
  drain();
  maybe_stall_cta();
  const char* sync = &g.sync[g.gen & 1u];
  happens_before(sync);
  if (++g.arrived >= g.live) {  // the last arrival releases the others and runs on
    if (&g == &block->block_gate) {
      block->or_result = block->or_pending;
      block->or_pending = 0;
    }
    release(g);
  } else {
    Fiber& f = block->fibers[block->current];
    f.wait_gen = &g.gen;
    f.wait_val = g.gen;
    switch_out();
  }
  happens_after(sync);
}

// The cluster-wide part of prnn_cluster_sync, for the block's thread 0: arrive (`release`: the
// CTA's queued stores land first), then wait (pausing as a poll does) until every CTA of the
// cluster has arrived as often. Clusters run whole, but a CTA may exit without arriving: the wait
// ends at the watchdog, which the launcher reports. The counter is relaxed between a release and
// an acquire fence, so that the race detector (which does not model fences) takes its edges
// from the barrier's generation alone, not from a partner's later arrivals on the same counter:
// the counter's two bytes stand for the sync objects of even and odd generations.
inline void cluster_barrier(bool release = true) {
  working();
  unsigned* counter = &cluster_counters[block_idx.x / cluster_size];
  const unsigned generation = __atomic_load_n(counter, __ATOMIC_RELAXED) / cluster_size;
  const char* sync = reinterpret_cast<const char*>(counter) + (generation & 1u);
  if (release) {
    drain(true);
    happens_before(sync);
    __atomic_thread_fence(__ATOMIC_RELEASE);
  }
  __atomic_fetch_add(counter, 1u, __ATOMIC_RELAXED);
  const unsigned target = (generation + 1u) * cluster_size;
  while (__atomic_load_n(counter, __ATOMIC_RELAXED) < target && !past_watchdog()) pause_polling();
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  happens_after(sync);
  working();
}

}  // namespace prnn_emu

#define threadIdx (prnn_emu::thread_idx)
#define blockIdx (prnn_emu::block_idx)
#define blockDim (prnn_emu::block_dim)
#define gridDim (prnn_emu::grid_dim)

inline void prnn_sync_block() { prnn_emu::wait_at(prnn_emu::block->block_gate); }

inline int prnn_sync_block_or(int pred) {
  const prnn_emu::Quiet quiet;
  prnn_emu::Block* b = prnn_emu::block;
  b->or_pending |= pred != 0;
  prnn_emu::wait_at(b->block_gate);
  // Safe to read after waking: the next block barrier cannot complete without this thread.
  return b->or_result;
}

template <class T>
inline T* prnn_shared_memory() {
  return reinterpret_cast<T*>(prnn_emu::block->shared);
}
inline unsigned prnn_shared_bytes() { return prnn_emu::block->shared_bytes; }

inline unsigned prnn_float_bits(float v) {
  unsigned u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}
inline float prnn_bits_float(unsigned u) {
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

namespace prnn_emu {
// A warp collective (shuffles, mma, ldmatrix): each lane publishes its `n` words (at most
// kSlotWords), waits until every lane of its warp has, and gets the warp's slots back: lane l's
// words at [l * kSlotWords]. Two slot buffers alternate, so one warp barrier per collective
// suffices: a lane can reuse a buffer only after the next collective's barrier, which every lane
// reaches after reading this one. Lanes that exited count as arrived: their slots hold what they
// last published.
inline const unsigned* warp_collective(const unsigned* words, int n) {
  Block* b = block;
  const unsigned t = threadIdx.x;
  Fiber& f = b->fibers[b->current];
  unsigned* slots = b->warp_slots + (f.shuffles++ & 1) * blockDim.x * kSlotWords;
  std::memcpy(slots + t * kSlotWords, words, n * sizeof(unsigned));
  wait_at(b->warp_gates[t / kWarp]);
  return slots + (t & ~31u) * kSlotWords;
}
}  // namespace prnn_emu

inline float prnn_shfl_xor(float v, int lane_mask) {
  const unsigned bits = prnn_float_bits(v);
  const unsigned* warp = prnn_emu::warp_collective(&bits, 1);
  return prnn_bits_float(warp[((threadIdx.x & 31u) ^ (unsigned)lane_mask) * prnn_emu::kSlotWords]);
}

// The warp's OR as a butterfly of shuffles (each one a warp barrier).
inline int prnn_sync_warp_or(int pred) {
  float any = pred != 0 ? 1.0f : 0.0f;
  for (int mask = 1; mask < prnn_emu::kWarp; mask <<= 1) any = fmax(any, prnn_shfl_xor(any, mask));
  return any != 0.0f;
}

// CTAs are OS threads: memory shared between CTAs goes through __atomic builtins. A release (and
// a fence) lands the CTA's queued stores first (kDelayed).
inline unsigned prnn_load_acquire(const unsigned* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void prnn_store_release(unsigned* p, unsigned v) {
  prnn_emu::working();
  prnn_emu::drain(true);
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
inline unsigned prnn_atomic_add_release(unsigned* p, unsigned v) {
  prnn_emu::working();
  prnn_emu::drain(true);
  return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
}
inline void prnn_fence() {
  prnn_emu::drain(true);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
// Host memory is the emulated device's own: a system-scope store is an atomic store that lands
// at once, the system fence a full fence (after landing the CTA's queued stores).
inline void prnn_store_system(unsigned* p, unsigned v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
inline void prnn_fence_system() { prnn_fence(); }
inline unsigned prnn_atomic_set_if_zero(unsigned* p, unsigned v) {
  prnn_emu::working();
  unsigned expected = 0u;
  __atomic_compare_exchange_n(p, &expected, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return expected;
}
inline unsigned prnn_atomic_cas_acq_rel(unsigned* p, unsigned expected, unsigned v) {
  prnn_emu::working();
  prnn_emu::drain(true);
  __atomic_compare_exchange_n(p, &expected, v, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  return expected;
}
inline float prnn_load_cg(const float* p) {
  float v;
  __atomic_load(p, &v, __ATOMIC_RELAXED);
  return v;
}
// The tagged exchange's words: relaxed 4-byte atomics, single-copy atomic like the GPU's
// ld/st.relaxed.gpu (the 16-byte load is four such loads, as PTX defines a vector access).
inline unsigned prnn_load_relaxed(const unsigned* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline void prnn_store_relaxed(unsigned* p, unsigned v) { prnn_emu::store_relaxed(p, v); }
namespace prnn_emu {
// n relaxed (or acquire: `order`) words, as PTX defines a vector access: one access per element,
// which kDelayed separates by a fiber switch (the other fibers' stores may land in between).
inline void load_words(const unsigned* p, unsigned* w, int n, int order = __ATOMIC_RELAXED) {
  drain();
  for (int i = 0; i < n; ++i) {
    if (i > 0 && on(kDelayed)) switch_out();
    w[i] = __atomic_load_n(p + i, order);
  }
}
}  // namespace prnn_emu
inline void prnn_load_relaxed_u32x4(const unsigned* p, unsigned (&w)[4]) { prnn_emu::load_words(p, w, 4); }
inline void prnn_load_acquire_u32x4(const unsigned* p, unsigned (&w)[4]) {
  prnn_emu::load_words(p, w, 4, __ATOMIC_ACQUIRE);
}
// A 16-byte store: four relaxed words (each may land late and apart, kDelayed), or four release
// stores after the CTA's queued ones.
inline void prnn_store_relaxed_u32x4(unsigned* p, const unsigned (&w)[4]) {
  for (int i = 0; i < 4; ++i) prnn_emu::store_relaxed(p + i, w[i]);
}
inline void prnn_store_release_u32x4(unsigned* p, const unsigned (&w)[4]) {
  for (int i = 0; i < 4; ++i) prnn_store_release(p + i, w[i]);
}
// Thread-block clusters (kernels built with -DPRNN_CLUSTER=n): the launcher runs a cluster's
// CTAs at once and publishes each one's shared memory in cluster_shared[] before any fiber runs.
#ifdef PRNN_CLUSTER
#define PRNN_CLUSTER_DIMS
inline void prnn_cluster_sync() {
  prnn_sync_block();
  if (threadIdx.x == 0) prnn_emu::cluster_barrier();
  prnn_sync_block();
}
// A relaxed arrival: the CTA's queued stores stay queued (kDelayed).
inline void prnn_cluster_sync_relaxed() {
  prnn_sync_block();
  if (threadIdx.x == 0) prnn_emu::cluster_barrier(false);
  prnn_sync_block();
}
// A store into a CTA that has exited is an error (its shared memory may already be another CTA's).
inline void prnn_store_cluster_u32(unsigned* local, int cta, unsigned v) {
  const std::ptrdiff_t offset = reinterpret_cast<unsigned char*>(local) - prnn_emu::block->shared;
  const int target = blockIdx.x / PRNN_CLUSTER * PRNN_CLUSTER + cta;
  unsigned char* base = prnn_emu::cluster_shared[target];
  prnn_emu::store_relaxed(reinterpret_cast<unsigned*>(base + offset), v, target);
}
inline void prnn_store_shared_relaxed_u32(unsigned* p, unsigned v) {
  prnn_emu::working();
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
}
inline void prnn_load_shared_relaxed_u32x4(const unsigned* p, unsigned (&w)[4]) {
  prnn_emu::load_words(p, w, 4);
}
using PrnnSharedWord = const unsigned*;
inline PrnnSharedWord prnn_shared_word(const unsigned* p) { return p; }
inline PrnnSharedWord prnn_shared_at(PrnnSharedWord base, int words) { return base + words; }
inline unsigned prnn_load_shared_relaxed_u32(PrnnSharedWord p) {
  prnn_emu::drain();
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
inline void prnn_load_shared_relaxed_u32x2(PrnnSharedWord p, unsigned& a, unsigned& b) {
  unsigned w[2];
  prnn_emu::load_words(p, w, 2);
  a = w[0];
  b = w[1];
}
#endif

inline unsigned long long prnn_globaltimer_ns() { return prnn_emu::timer_ns(); }

inline void prnn_backoff() { prnn_emu::pause_polling(); }

// A sleep before polling: lets the block's other fibers run (their work is what the GPU's sleep
// waits out), without the OS-level pause of prnn_backoff.
inline void prnn_sleep_ns(unsigned) { prnn_emu::switch_out(); }

// 16-bit storage (hw.cuh): the conversions in software, bit for bit those of the GPU's cvt (round
// to nearest, ties to even; overflow to infinity; subnormals kept) and of ml_dtypes.
inline float prnn_f16_to_float(unsigned h) {
  const unsigned sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in fp32
    const float v = (float)mant * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  const unsigned bits = exp == 0x1fu ? sign | 0x7f800000u | (mant << 13)  // inf, NaN
                                     : sign | ((exp + 112u) << 23) | (mant << 13);
  return prnn_bits_float(bits);
}
inline void prnn_f16x2_to_float(unsigned w, float& lo, float& hi) {
  lo = prnn_f16_to_float(w & 0xffffu);
  hi = prnn_f16_to_float(w >> 16);
}
inline void prnn_bf16x2_to_float(unsigned w, float& lo, float& hi) {
  lo = prnn_bits_float(w << 16);
  hi = prnn_bits_float(w & 0xffff0000u);
}
// fp16 bits of v rounded to nearest even (the GPU's cvt.rn.f16.f32).
inline unsigned prnn_f16_bits(float v) {
  const unsigned x = prnn_float_bits(v), sign = x & 0x80000000u, mag = x & 0x7fffffffu;
  unsigned h;
  if (mag > 0x7f800000u) {
    h = 0x7fffu;  // NaN (the GPU's canonical one)
  } else if (mag >= 0x477ff000u) {
    h = 0x7c00u;  // rounds to infinity: 65520 and above
  } else if (mag >= 0x38800000u) {  // normal: 2^-14 and above
    h = (mag - 0x38000000u + 0xfffu + ((mag >> 13) & 1u)) >> 13;
  } else {  // subnormal or zero: an integer number of 2^-24, rounded to even by nearbyint
    h = (unsigned)std::nearbyint(std::fabs(v) * 16777216.0f);
  }
  return h | (sign >> 16);
}
inline float prnn_round_f16(float v) { return prnn_f16_to_float(prnn_f16_bits(v)); }
inline float prnn_round_bf16(float v) {
  const unsigned x = prnn_float_bits(v);
  if ((x & 0x7fffffffu) > 0x7f800000u) return v;  // NaN stays NaN
  return prnn_bits_float((x + 0x7fffu + ((x >> 16) & 1u)) & 0xffff0000u);
}
// hw.cuh's cvt.rn.{f16,bf16}x2.f32: two values rounded to 16 bits in one word, lo in the low half.
inline unsigned prnn_pack_f16x2(float lo, float hi) {
  return prnn_f16_bits(lo) | prnn_f16_bits(hi) << 16;
}
inline unsigned prnn_bf16_bits(float v) {  // a NaN becomes the GPU's canonical one
  return v != v ? 0x7fffu : prnn_float_bits(prnn_round_bf16(v)) >> 16;
}
inline unsigned prnn_pack_bf16x2(float lo, float hi) {
  return prnn_bf16_bits(lo) | prnn_bf16_bits(hi) << 16;
}

// hw.cuh's cvt.rna.tf32.f32: to nearest, ties away from zero (add half of the 13 dropped bits'
// unit to the magnitude, carry into the exponent: the largest values round to infinity); a NaN
// becomes the canonical one.
inline unsigned prnn_tf32_bits(float v) {
  const unsigned x = prnn_float_bits(v);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffffffu;
  return (x + 0x1000u) & 0xffffe000u;
}

// ---- tensor-core mma (hw.cuh's prnn_mma_f16, prnn_mma_bf16, prnn_mma_tf32) ----------------------------------
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 as a warp collective, with the
// fragment layouts of the PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"
// (docs.nvidia.com/cuda/parallel-thread-execution/#warp-level-matrix-fragment-mma-16816-float).
// With g = lane / 4 (groupID) and t = lane % 4 (threadID_in_group), element i of a fragment is
// half i % 2 (the low half first) of register i / 2, and lies at
//   A (16 x 16, .row), a0..a7: row g + 8 * (i / 2 % 2), column 2t + i % 2 + 8 * (i / 4)
//   B (16 x 8, .col),  b0..b3: row 2t + i % 2 + 8 * (i / 2), column g
//   C, D (16 x 8),     c0..c3: row g + 8 * (i / 2),      column 2t + i % 2
// Each lane rebuilds the whole of A and B from the warp's registers (the layout written here
// apart from any kernel's loads: a loader that has it wrong fails against a plain product) and sums
// its four elements of D in fp32 in this order: d = c + a[r][0] b[0][n] + ... + a[r][15] b[15][n],
// each product exact in fp32 (significands of 11 or 8 bits), each addition rounded to nearest
// even. The tensor cores order and round the k-sum their own way: compare with a tolerance.
namespace prnn_emu {
constexpr int kMmaM = 16, kMmaN = 8, kMmaK = 16;

// The GPU's .aligned collectives (mma, ldmatrix) need every lane of the warp: a lane that exited,
// or a warp of fewer than 32 threads, is reported (the launch fails).
inline void require_whole_warp() {
  const Quiet quiet;  // (the gates are the emulator's)
  const int w = (int)(threadIdx.x / kWarp);
  if (block->warp_gates[w].live != kWarp) partial_warp((int)block_idx.x, w);
}

template <void (*Unpack)(unsigned, float&, float&)>
inline float fragment_half(unsigned word, int half) {
  float lo, hi;
  Unpack(word, lo, hi);
  return half == 0 ? lo : hi;
}

// This lane's four elements of D = A B + C (K columns of A), summed in the order above.
template <int kK>
inline void mma_sum(float (&d)[4], const float (&ma)[kMmaM][kK], const float (&mb)[kK][kMmaN],
                    const float (&c)[4]) {
  const int lane = (int)(threadIdx.x % kWarp), g = lane / 4, t = lane % 4;
  float sum[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    sum[i] = c[i];
    for (int k = 0; k < kK; ++k) {
      const float product = ma[row][k] * mb[k][col];
      sum[i] += product;
    }
  }
  for (int i = 0; i < 4; ++i) d[i] = sum[i];  // (d may be c)
}

template <void (*Unpack)(unsigned, float&, float&)>
inline void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                         const float (&c)[4]) {
  require_whole_warp();
  const unsigned mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  const unsigned* warp = warp_collective(mine, 6);
  float ma[kMmaM][kMmaK], mb[kMmaK][kMmaN];
  for (int lane = 0; lane < kWarp; ++lane) {
    const unsigned* regs = warp + lane * kSlotWords;
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 8; ++i) {
      const float v = fragment_half<Unpack>(regs[i / 2], i % 2);
      ma[g + 8 * (i / 2 % 2)][2 * t + i % 2 + 8 * (i / 4)] = v;
    }
    for (int i = 0; i < 4; ++i) {
      const float v = fragment_half<Unpack>(regs[4 + i / 2], i % 2);
      mb[2 * t + i % 2 + 8 * (i / 2)][g] = v;
    }
  }
  mma_sum(d, ma, mb, c);
}

// v's TF32 value as an mma operand: its low 13 bits dropped (the kernels pass prnn_tf32_bits'
// values, whose low bits are zero; the hardware's use of other bits is not documented).
inline float tf32_operand(unsigned word) { return prnn_bits_float(word & 0xffffe000u); }

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 with the PTX ISA's layout, "Matrix Fragments
// for mma.m16n8k8" (.tf32; docs.nvidia.com/cuda/parallel-thread-execution/
// #warp-level-matrix-fragment-mma-1688): one element per register,
//   A (16 x 8, .row), a0..a3: row g + 8 * (i % 2), column t + 4 * (i / 2)
//   B (8 x 8, .col),  b0, b1: row t + 4 * i,       column g
//   C, D: as m16n8k16's. Products of two 11-bit significands are exact in fp32; the same k-sum.
inline void mma_m16n8k8_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                             const float (&c)[4]) {
  require_whole_warp();
  const unsigned mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  const unsigned* warp = warp_collective(mine, 6);
  float ma[kMmaM][kMmaK / 2], mb[kMmaK / 2][kMmaN];
  for (int lane = 0; lane < kWarp; ++lane) {
    const unsigned* regs = warp + lane * kSlotWords;
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) ma[g + 8 * (i % 2)][t + 4 * (i / 2)] = tf32_operand(regs[i]);
    for (int i = 0; i < 2; ++i) mb[t + 4 * i][g] = tf32_operand(regs[4 + i]);
  }
  mma_sum(d, ma, mb, c);
}
}  // namespace prnn_emu

inline void prnn_mma_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                         const float (&c)[4]) {
  prnn_emu::mma_m16n8k16<prnn_f16x2_to_float>(d, a, b, c);
}
inline void prnn_mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                          const float (&c)[4]) {
  prnn_emu::mma_m16n8k16<prnn_bf16x2_to_float>(d, a, b, c);
}
inline void prnn_mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                          const float (&c)[4]) {
  prnn_emu::mma_m16n8k8_tf32(d, a, b, c);
}

// The GPU's rcp.approx and ex2.approx (hw.cuh) are within 1 and 2 + 1.173|x| ulp of these.
inline float prnn_reciprocal(float y) { return 1.0f / y; }
inline float prnn_exp_approx(float x) { return expf(x); }
inline void prnn_load_shared_pair(const float* p, float& a, float& b) {
  prnn_emu::maybe_switch();
  a = p[0];
  b = p[1];
}
// A 16-byte shared access the GPU would fault on (misaligned address) ends the process here too.
inline void prnn_emu_check_quad(const float* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) std::abort();
}
inline void prnn_load_shared_quad(const float* p, float (&v)[4]) {
  prnn_emu_check_quad(p);
  prnn_emu::maybe_switch();
  for (int i = 0; i < 4; ++i) v[i] = p[i];
}
inline void prnn_store_shared_quad(float* p, const float (&v)[4]) {
  prnn_emu_check_quad(p);
  prnn_emu::working();
  prnn_emu::maybe_switch();
  for (int i = 0; i < 4; ++i) p[i] = v[i];
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16 (hw.cuh's prnn_ldmatrix_x4) as a warp collective, with
// the layout of the PTX ISA, "Warp-level matrix load instruction: ldmatrix"
// (docs.nvidia.com/cuda/parallel-thread-execution/#warp-level-matrix-instructions-ldmatrix):
// lanes 8j..8j+7 give the rows of matrix j, and lane l receives in r[j] the word of columns
// 2(l % 4), 2(l % 4) + 1 of row l / 4 of matrix j. Each lane reads its row when it arrives, before
// the others do: a row written by another lane of the warp without a barrier in between may be
// missed, as the GPU (a weak load) does not promise it either. A row outside the block's shared
// memory or not 16-byte aligned ends the process, as a misaligned quad does.
inline void prnn_ldmatrix_x4(unsigned (&r)[4], const unsigned* row) {
  prnn_emu::require_whole_warp();
  const unsigned char* at = reinterpret_cast<const unsigned char*>(row);
  const prnn_emu::Block* b = prnn_emu::block;
  if (at < b->shared || at + 16 > b->shared + b->shared_bytes) std::abort();
  prnn_emu_check_quad(reinterpret_cast<const float*>(row));
  const unsigned mine[4] = {row[0], row[1], row[2], row[3]};
  const unsigned* warp = prnn_emu::warp_collective(mine, 4);
  const unsigned lane = threadIdx.x % prnn_emu::kWarp;
  for (int j = 0; j < 4; ++j) r[j] = warp[(8 * j + lane / 4) * prnn_emu::kSlotWords + lane % 4];
}

// cp.async (hw.cuh): the copies land at once, or (kLateCopies) only at the issuing thread's
// prnn_copy_wait, their destination NaN until then, so that a read before wait-plus-barrier shows.
namespace prnn_emu {
inline void copy_async(float* dst, const float* src, int n) {
  working();
  if (!on(kLateCopies)) {
    for (int i = 0; i < n; ++i) dst[i] = prnn_load_cg(src + i);
    return;
  }
  for (int i = 0; i < n; ++i) dst[i] = NAN;
  Fiber& fiber = block->fibers[block->current];
  fiber.copies.push_back({dst, src, n, fiber.commits});
}

// Completes this fiber's copies of the groups before `group` (all: ~0u), in issue order.
inline void complete_copies(unsigned group) {
  std::vector<Copy>& copies = block->fibers[block->current].copies;
  std::vector<Copy> pending;
  for (const Copy& c : copies) {
    if (c.group < group) {
      for (int i = 0; i < c.n; ++i) c.dst[i] = prnn_load_cg(c.src + i);
    } else {
      pending.push_back(c);
    }
  }
  copies.swap(pending);
}
}  // namespace prnn_emu
inline void prnn_copy16_to_shared(float* dst, const float* src) { prnn_emu::copy_async(dst, src, 4); }
inline void prnn_copy4_to_shared(float* dst, const float* src) { prnn_emu::copy_async(dst, src, 1); }
inline void prnn_copy_wait() { prnn_emu::complete_copies(~0u); }
inline void prnn_copy_commit() { ++prnn_emu::block->fibers[prnn_emu::block->current].commits; }
inline void prnn_copy_wait_prior() {
  const unsigned commits = prnn_emu::block->fibers[prnn_emu::block->current].commits;
  prnn_emu::complete_copies(commits == 0u ? 0u : commits - 1u);
}
