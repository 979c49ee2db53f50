// emulation.h - host versions of the hw.cuh primitives, so that the cuda_src kernels compile with
// g++ and run on CPU threads (one std::thread per CUDA thread). Included by hw.cuh when
// PRNN_EMULATION is defined; the launch side (threads, blocks, shared memory) is emulation_launch.h.
//
// What is modelled: thread and block identity, per-block dynamic shared memory, block barriers
// (also with an OR-reduction), warp shuffles, acquire/release atomics, the global timer (steady
// clock) and CTAs that are not co-resident. What is not: the GPU's weak memory model beyond C++'s,
// warp-synchronous timing, and performance.
#pragma once
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <math.h>
#include <thread>

#define PRNN_HD inline
#define PRNN_DEVICE inline
#define PRNN_KERNEL extern "C"
#define __launch_bounds__(...)
#define __forceinline__ inline
#define __host__
#define __device__
#define __global__

// CUDA's math overloads (tanh(double), tanhf, expf, fmaxf, ...) come from <cmath>/<math.h>.
using std::exp;
using std::fmax;
using std::fmin;
using std::tanh;

namespace prnn_emu {

constexpr int kWarp = 32;

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

// Everything one emulated CTA shares among its threads.
struct Block {
  std::barrier<>* sync;          // __syncthreads
  std::barrier<>** warp_sync;    // one per warp, for shuffles
  float* shuffle_slots;          // [blockDim.x]
  std::atomic<int> or_flags[3];  // rotating flags for prnn_sync_block_or
  unsigned char* shared;         // dynamic shared memory
};

inline thread_local Dim3 thread_idx, block_idx;
inline Dim3 block_dim, grid_dim;  // one launch at a time per process (emulate.py holds a lock)
inline thread_local Block* block;
inline thread_local int or_phase;

}  // namespace prnn_emu

#define threadIdx (prnn_emu::thread_idx)
#define blockIdx (prnn_emu::block_idx)
#define blockDim (prnn_emu::block_dim)
#define gridDim (prnn_emu::grid_dim)

inline void prnn_sync_block() { prnn_emu::block->sync->arrive_and_wait(); }

// Three flags rotate so that the flag being read is never the one being cleared or set by a thread
// that has already moved on to the next call.
inline int prnn_sync_block_or(int pred) {
  prnn_emu::Block* b = prnn_emu::block;
  const int phase = prnn_emu::or_phase++ % 3;
  if (pred) b->or_flags[phase].store(1);
  b->sync->arrive_and_wait();
  const int any = b->or_flags[phase].load();
  b->or_flags[(phase + 2) % 3].store(0);
  return any;
}

template <class T>
inline T* prnn_shared_memory() {
  return reinterpret_cast<T*>(prnn_emu::block->shared);
}

inline float prnn_shfl_xor(float v, int lane_mask) {
  prnn_emu::Block* b = prnn_emu::block;
  const unsigned t = threadIdx.x;
  std::barrier<>* warp = b->warp_sync[t / prnn_emu::kWarp];
  b->shuffle_slots[t] = v;
  warp->arrive_and_wait();
  const float other = b->shuffle_slots[(t & ~31u) | ((t & 31u) ^ (unsigned)lane_mask)];
  warp->arrive_and_wait();
  return other;
}

inline unsigned prnn_load_acquire(const unsigned* p) {
  return std::atomic_ref<unsigned>(*const_cast<unsigned*>(p)).load(std::memory_order_acquire);
}
inline void prnn_store_release(unsigned* p, unsigned v) {
  std::atomic_ref<unsigned>(*p).store(v, std::memory_order_release);
}
inline unsigned prnn_atomic_add_release(unsigned* p, unsigned v) {
  return std::atomic_ref<unsigned>(*p).fetch_add(v, std::memory_order_acq_rel);
}
inline void prnn_fence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline float prnn_load_cg(const float* p) {
  return std::atomic_ref<float>(*const_cast<float*>(p)).load(std::memory_order_relaxed);
}
inline void prnn_store_cg(float* p, float v) {
  std::atomic_ref<float>(*p).store(v, std::memory_order_relaxed);
}

inline unsigned long long prnn_globaltimer_ns() {
  using namespace std::chrono;
  return duration_cast<nanoseconds>(steady_clock::now().time_since_epoch()).count();
}
// Two cores run hundreds of emulated threads: a spinning thread must give its core away.
inline void prnn_backoff() { std::this_thread::yield(); }
