// hw.cuh - everything hardware-specific in one place.
//
// Kernels in cuda_src/ use only what this header provides for thread identity beyond
// threadIdx/blockIdx/blockDim/gridDim, block synchronisation, shared memory, warp exchange,
// memory ordering, timers and the grid barrier. Compiled with NVRTC the functions below map
// onto PTX; compiled for the host with PRNN_EMULATION defined, emulation.h supplies the same
// primitives for CPU threads, so the kernels themselves carry no #ifdef of their own.
#pragma once

#ifdef PRNN_EMULATION
#include "emulation.h"
#else

#define PRNN_HD __host__ __device__ __forceinline__
#define PRNN_DEVICE __device__ __forceinline__
#define PRNN_KERNEL extern "C" __global__

// ---- block-level ----------------------------------------------------------------------------
PRNN_DEVICE void prnn_sync_block() { __syncthreads(); }
// Block barrier that also returns whether `pred` was non-zero in any thread of the block.
PRNN_DEVICE int prnn_sync_block_or(int pred) { return __syncthreads_or(pred); }

// Base of the block's dynamic shared memory (the only shared memory kernels use, so that the
// emulation can give each block its own).
template <class T>
PRNN_DEVICE T* prnn_shared_memory() {
  extern __shared__ __align__(16) unsigned char prnn_smem_bytes[];
  return reinterpret_cast<T*>(prnn_smem_bytes);
}

// ---- warp-level -----------------------------------------------------------------------------
PRNN_DEVICE float prnn_shfl_xor(float v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}

// ---- memory ordering (GPU scope) ---------------------------------------------------------------
PRNN_DEVICE unsigned prnn_load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
PRNN_DEVICE void prnn_store_release(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
PRNN_DEVICE unsigned prnn_atomic_add_release(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.add.release.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
PRNN_DEVICE void prnn_fence() { __threadfence(); }
// Load that bypasses L1, for data other CTAs wrote during this launch.
PRNN_DEVICE float prnn_load_cg(const float* p) { return __ldcg(p); }

// ---- time -----------------------------------------------------------------------------------
PRNN_DEVICE unsigned long long prnn_globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Polling back-off: short enough not to add visible latency to a barrier.
PRNN_DEVICE void prnn_backoff() { __nanosleep(20); }

#endif  // PRNN_EMULATION

// ---- global -> shared copies that use no registers (sm_80+ cp.async) ----------------------------
// prnn_copy16_to_shared copies 16 bytes through L2 only, like ld.cg (both addresses 16-byte
// aligned); prnn_copy4_to_shared copies 4 bytes and may use L1, so only for data no CTA writes
// during the launch. The copies a thread issued are complete after prnn_copy_wait (visible to the
// block after a block sync). The host versions are plain copies through prnn_load_cg, so
// emulation.h need not provide them.
#ifdef PRNN_EMULATION
PRNN_DEVICE void prnn_copy16_to_shared(float* dst, const float* src) {
  for (int i = 0; i < 4; ++i) dst[i] = prnn_load_cg(src + i);
}
PRNN_DEVICE void prnn_copy4_to_shared(float* dst, const float* src) { *dst = prnn_load_cg(src); }
PRNN_DEVICE void prnn_copy_wait() {}
#else
PRNN_DEVICE void prnn_copy16_to_shared(float* dst, const float* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(dst)),
               "l"(__cvta_generic_to_global(src)) : "memory");
}
PRNN_DEVICE void prnn_copy4_to_shared(float* dst, const float* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((unsigned)__cvta_generic_to_shared(dst)),
               "l"(__cvta_generic_to_global(src)) : "memory");
}
PRNN_DEVICE void prnn_copy_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }
#endif

// ---- grid barrier with timeout (written once, on the primitives above) ------------------------

// Shared by all CTAs of one launch; the host zeroes it (and sets progress[] to the resume step
// minus one) before every launch.
struct PrnnControl {
  unsigned arrivals;  // barrier arrivals in this launch, monotonically increasing (epoch = round)
  unsigned abort;     // set by the first CTA whose wait passes its deadline; all CTAs then exit
  int progress[1];    // [gridDim.x]: last step whose results this CTA has written
};

// A stall injected by prnn.inject_stall: CTA `block` waits `ns` before arriving at step `step`.
struct PrnnStall {
  int block;
  int step;
  unsigned long long ns;
};

PRNN_DEVICE void prnn_maybe_stall(const PrnnStall& stall, int step) {
  if (stall.ns != 0ull && (int)blockIdx.x == stall.block && step == stall.step && threadIdx.x == 0) {
    const unsigned long long until = prnn_globaltimer_ns() + stall.ns;
    while (prnn_globaltimer_ns() < until) prnn_backoff();
  }
}

// Records that this CTA wrote its results for `step`, then waits until all gridDim.x CTAs
// have arrived `round` times in this launch (round counts from 1). Returns false when the wait
// passed `timeout_ns` or another CTA aborted: the caller must then return from the kernel.
// Every thread of the block must call it.
PRNN_DEVICE bool prnn_grid_barrier(PrnnControl* ctl, int step, unsigned round,
                                   unsigned long long timeout_ns) {
  int failed = 0;
  prnn_sync_block();  // all of this block's writes for `step` are issued
  if (threadIdx.x == 0) {
    prnn_fence();
    ctl->progress[blockIdx.x] = step;
    prnn_atomic_add_release(&ctl->arrivals, 1u);
    const unsigned target = round * gridDim.x;
    const unsigned long long deadline = prnn_globaltimer_ns() + timeout_ns;
    while (prnn_load_acquire(&ctl->arrivals) < target) {
      if (prnn_load_acquire(&ctl->abort) != 0u || prnn_globaltimer_ns() > deadline) {
        prnn_store_release(&ctl->abort, 1u);
        failed = 1;
        break;
      }
      prnn_backoff();
    }
  }
  return !prnn_sync_block_or(failed);
}
