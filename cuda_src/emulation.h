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
// arrived, as on sm_70+), warp shuffles, acquire/release atomics across CTAs, the global timer
// (steady clock, in ns) and CTAs that are not co-resident. What is not: the GPU's weaker memory
// model (L1 incoherence, unordered plain stores), warp-synchronous execution and divergence,
// timing, and performance.
#pragma once
#include <math.h>
#include <time.h>
#include <ucontext.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

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

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

// A barrier among the live threads of a block or a warp: the last arrival bumps `gen`, which
// releases the fibers waiting on it.
struct Gate {
  unsigned gen = 0;
  int arrived = 0;
  int live = 0;
};

struct Fiber {
  ucontext_t context;
  const unsigned* wait_gen = nullptr;  // blocked while *wait_gen == wait_val
  unsigned wait_val = 0;
  int shuffles = 0;  // parity selects the shuffle slot buffer
  bool done = false;
};

// One CTA: its fibers, barriers, shuffle slots and shared memory.
struct Block {
  ucontext_t scheduler;
  Fiber* fibers = nullptr;
  int current = 0;
  Gate block_gate;
  Gate* warp_gates = nullptr;
  int or_pending = 0, or_result = 0;  // prnn_sync_block_or
  float* shuffle_slots = nullptr;     // [2][blockDim.x]
  unsigned char* shared = nullptr;
  unsigned shared_bytes = 0;
};

inline thread_local Dim3 thread_idx, block_idx, block_dim, grid_dim;
inline thread_local Block* block = nullptr;

// Set by the launcher once a launch has run past its watchdog: the timer then jumps far ahead, so
// every deadline passes and every polling loop ends.
inline unsigned long long watchdog_ns = ~0ull;
inline bool watchdog_fired = false;

inline unsigned long long steady_ns() {
  using namespace std::chrono;
  return (unsigned long long)duration_cast<nanoseconds>(steady_clock::now().time_since_epoch())
      .count();
}

// Gives the CTA's OS thread to the next runnable fiber; returns when this fiber runs again.
inline void switch_out() {
  Block* b = block;
  swapcontext(&b->fibers[b->current].context, &b->scheduler);
}

inline void release(Gate& g) {
  g.arrived = 0;
  ++g.gen;
}

inline void wait_at(Gate& g) {
  if (++g.arrived >= g.live) {  // the last arrival releases the others and runs on
    if (&g == &block->block_gate) {
      block->or_result = block->or_pending;
      block->or_pending = 0;
    }
    release(g);
    return;
  }
  Fiber& f = block->fibers[block->current];
  f.wait_gen = &g.gen;
  f.wait_val = g.gen;
  switch_out();
}

// Clusters: each block's shared memory by block index (set by the launcher before the blocks
// run), and one arrival counter per cluster for the cluster barrier (one launch at a time).
inline unsigned char** cluster_shared = nullptr;
inline unsigned* cluster_counters = nullptr;  // [clusters]: arrivals, monotonically increasing
inline int cluster_size = 1;

// The cluster-wide part of prnn_cluster_sync, for the block's thread 0: arrive, then wait (with
// back-off, so that the CTA's OS thread stays responsive) until every CTA of the cluster has
// arrived as often. Clusters run whole, so this cannot wait for a CTA that never runs.
inline void cluster_barrier() {
  unsigned* counter = &cluster_counters[block_idx.x / cluster_size];
  const unsigned target = (__atomic_add_fetch(counter, 1u, __ATOMIC_ACQ_REL) + cluster_size - 1) /
                          cluster_size * cluster_size;
  while (__atomic_load_n(counter, __ATOMIC_ACQUIRE) < target) {
    switch_out();
    const timespec pause{0, 20000};
    nanosleep(&pause, nullptr);
  }
}

}  // namespace prnn_emu

#define threadIdx (prnn_emu::thread_idx)
#define blockIdx (prnn_emu::block_idx)
#define blockDim (prnn_emu::block_dim)
#define gridDim (prnn_emu::grid_dim)

inline void prnn_sync_block() { prnn_emu::wait_at(prnn_emu::block->block_gate); }

inline int prnn_sync_block_or(int pred) {
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

// Two slot buffers alternate, so one warp barrier per shuffle suffices: a lane can reuse a buffer
// only after the next shuffle's barrier, which every lane reaches after reading this one.
inline float prnn_shfl_xor(float v, int lane_mask) {
  prnn_emu::Block* b = prnn_emu::block;
  const unsigned t = threadIdx.x;
  prnn_emu::Fiber& f = b->fibers[b->current];
  float* slots = b->shuffle_slots + (f.shuffles++ & 1) * blockDim.x;
  slots[t] = v;
  prnn_emu::wait_at(b->warp_gates[t / prnn_emu::kWarp]);
  return slots[(t & ~31u) | ((t & 31u) ^ (unsigned)lane_mask)];
}

// The warp's OR as a butterfly of shuffles (each one a warp barrier).
inline int prnn_sync_warp_or(int pred) {
  float any = pred != 0 ? 1.0f : 0.0f;
  for (int mask = 1; mask < prnn_emu::kWarp; mask <<= 1) any = fmax(any, prnn_shfl_xor(any, mask));
  return any != 0.0f;
}

// CTAs are OS threads: memory shared between CTAs goes through __atomic builtins.
inline unsigned prnn_load_acquire(const unsigned* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void prnn_store_release(unsigned* p, unsigned v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline unsigned prnn_atomic_add_release(unsigned* p, unsigned v) {
  return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
}
inline void prnn_fence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline unsigned prnn_atomic_set_if_zero(unsigned* p, unsigned v) {
  unsigned expected = 0u;
  __atomic_compare_exchange_n(p, &expected, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
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
inline void prnn_store_relaxed(unsigned* p, unsigned v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
inline void prnn_load_relaxed_u32x4(const unsigned* p, unsigned (&w)[4]) {
  for (int i = 0; i < 4; ++i) w[i] = __atomic_load_n(p + i, __ATOMIC_RELAXED);
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
inline void prnn_store_cluster_u32(unsigned* local, int cta, unsigned v) {
  const std::ptrdiff_t offset = reinterpret_cast<unsigned char*>(local) - prnn_emu::block->shared;
  unsigned char* base = prnn_emu::cluster_shared[blockIdx.x / PRNN_CLUSTER * PRNN_CLUSTER + cta];
  __atomic_store_n(reinterpret_cast<unsigned*>(base + offset), v, __ATOMIC_RELAXED);
}
inline void prnn_load_shared_relaxed_u32x4(const unsigned* p, unsigned (&w)[4]) {
  for (int i = 0; i < 4; ++i) w[i] = __atomic_load_n(p + i, __ATOMIC_RELAXED);
}
using PrnnSharedWord = const unsigned*;
inline PrnnSharedWord prnn_shared_word(const unsigned* p) { return p; }
inline PrnnSharedWord prnn_shared_at(PrnnSharedWord base, int words) { return base + words; }
inline unsigned prnn_load_shared_relaxed_u32(PrnnSharedWord p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline void prnn_load_shared_relaxed_u32x2(PrnnSharedWord p, unsigned& a, unsigned& b) {
  a = __atomic_load_n(p, __ATOMIC_RELAXED);
  b = __atomic_load_n(p + 1, __ATOMIC_RELAXED);
}
#endif

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

inline unsigned long long prnn_globaltimer_ns() {
  const unsigned long long now = prnn_emu::steady_ns();
  if (now > __atomic_load_n(&prnn_emu::watchdog_ns, __ATOMIC_RELAXED)) {
    __atomic_store_n(&prnn_emu::watchdog_fired, true, __ATOMIC_RELAXED);
    return now + (1ull << 62);
  }
  return now;
}

// Polling back-off: lets the block's other fibers run, then sleeps briefly so that spinning CTAs
// do not burn the few cores of a CI machine.
inline void prnn_backoff() {
  prnn_emu::switch_out();
  const timespec pause{0, 20000};
  nanosleep(&pause, nullptr);
}

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
inline float prnn_round_f16(float v) {
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
  return prnn_f16_to_float(h | (sign >> 16));
}
inline float prnn_round_bf16(float v) {
  const unsigned x = prnn_float_bits(v);
  if ((x & 0x7fffffffu) > 0x7f800000u) return v;  // NaN stays NaN
  return prnn_bits_float((x + 0x7fffu + ((x >> 16) & 1u)) & 0xffff0000u);
}
// The GPU's rcp.approx and ex2.approx (hw.cuh) are within 1 and 2 + 1.173|x| ulp of these.
inline float prnn_reciprocal(float y) { return 1.0f / y; }
inline float prnn_exp_approx(float x) { return expf(x); }
inline void prnn_load_shared_pair(const float* p, float& a, float& b) {
  a = p[0];
  b = p[1];
}
// A 16-byte shared access the GPU would fault on (misaligned address) ends the process here too.
inline void prnn_emu_check_quad(const float* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) std::abort();
}
inline void prnn_load_shared_quad(const float* p, float (&v)[4]) {
  prnn_emu_check_quad(p);
  for (int i = 0; i < 4; ++i) v[i] = p[i];
}
inline void prnn_store_shared_quad(float* p, const float (&v)[4]) {
  prnn_emu_check_quad(p);
  for (int i = 0; i < 4; ++i) p[i] = v[i];
}
