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

// Bytes of dynamic shared memory this launch gave the block.
PRNN_DEVICE unsigned prnn_shared_bytes() {
  unsigned n;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}

// ---- warp-level -----------------------------------------------------------------------------
PRNN_DEVICE float prnn_shfl_xor(float v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
// Warp barrier (orders the warp's shared-memory accesses) that also returns whether `pred` was
// non-zero in any lane: what a block barrier is to a CTA, for a warp that works alone.
PRNN_DEVICE int prnn_sync_warp_or(int pred) {
  __syncwarp();
  return __any_sync(0xffffffffu, pred);
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
// Stores v at p if p holds 0 (compare-and-swap, relaxed); returns what p held before.
PRNN_DEVICE unsigned prnn_atomic_set_if_zero(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.relaxed.gpu.global.cas.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(p), "r"(0u), "r"(v) : "memory");
  return old;
}
// Relaxed (strong, GPU scope) accesses: they bypass the incoherent L1 and are single-copy atomic,
// but order nothing else, so they emit neither a fence (MEMBAR) nor an L1 invalidate (CCTL).
PRNN_DEVICE unsigned prnn_load_relaxed(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
PRNN_DEVICE void prnn_store_relaxed(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Four 4-byte words in one 16-byte load (p 16-byte aligned); each word is read atomically (PTX
// models a vector access as one access per element).
PRNN_DEVICE void prnn_load_relaxed_u32x4(const unsigned* p, unsigned (&w)[4]) {
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
}
PRNN_DEVICE unsigned prnn_float_bits(float v) { return __float_as_uint(v); }
PRNN_DEVICE float prnn_bits_float(unsigned v) { return __uint_as_float(v); }
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
// Sleeps about `ns` (the hardware takes it as a hint: 0..2*ns), without occupying an issue slot.
PRNN_DEVICE void prnn_sleep_ns(unsigned ns) { __nanosleep(ns); }

// ---- arithmetic ---------------------------------------------------------------------------
// 1/y within 1 ulp (rcp.approx: the CUDA C++ Programming Guide gives 1 ulp over the full range
// for 1/x built with -prec-div=false): one MUFU.RCP, where 1.0f / y (correctly rounded) adds a
// Newton step and a branch to a slow path for subnormals and infinities. A subnormal y or 1/y
// flushes to zero: for callers whose y is at least 1 (the sigmoid of cells.cuh).
PRNN_HD float prnn_reciprocal(float y) {
#ifdef __CUDA_ARCH__
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
  return r;
#else
  return 1.0f / y;
#endif
}

// e^x on the special-function unit as 2^(x log2 e): one FMUL and one MUFU.EX2, where expf adds
// an exact range reduction of five dependent instructions. What __expf computes (within
// 2 + floor(|1.173 x|) ulp, the CUDA C++ Programming Guide), with subnormal inputs and results
// flushed to zero (ex2.approx.ftz: __expf without -ftz adds the subnormal scaling).
PRNN_HD float prnn_exp_approx(float x) {
#ifdef __CUDA_ARCH__
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * 1.4426950408889634f));
  return r;
#else
  return expf(x);
#endif
}

// ---- 16-bit storage (fp16, bf16): packed pairs, fp32 arithmetic ------------------------------
// A 32-bit word holds two 16-bit values, element 0 in the low half. The unpacking is volatile so
// that it stays beside its FMA: ptxas would otherwise hoist the conversions of the register-
// resident weights out of the batch loop and spill the doubled registers. Rounding is to nearest,
// ties to even (as ml_dtypes), NaN stays NaN.
PRNN_DEVICE void prnn_f16x2_to_float(unsigned w, float& lo, float& hi) {
  asm volatile("{.reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h;}"
               : "=f"(lo), "=f"(hi) : "r"(w));
}
PRNN_DEVICE void prnn_bf16x2_to_float(unsigned w, float& lo, float& hi) {
  unsigned l, h;
  asm volatile("{prmt.b32 %0, %2, 0, 0x1044; and.b32 %1, %2, 0xffff0000;}" : "=r"(l), "=r"(h) : "r"(w));
  lo = __uint_as_float(l);
  hi = __uint_as_float(h);
}
PRNN_DEVICE float prnn_round_f16(float v) {
  float r;
  asm("{.reg .b16 h; cvt.rn.f16.f32 h, %1; cvt.f32.f16 %0, h;}" : "=f"(r) : "f"(v));
  return r;
}
PRNN_DEVICE float prnn_round_bf16(float v) {
  unsigned r;
  asm("{.reg .b16 h, z; mov.b16 z, 0; cvt.rn.bf16.f32 h, %1; mov.b32 %0, {z, h};}" : "=r"(r) : "f"(v));
  return __uint_as_float(r);
}
// ---- tensor cores (sm_80+): a warp's 16x8x16 matrix multiply-accumulate ----------------------
// d = A B + c, A 16 x 16 and B 16 x 8 in fp16 (prnn_mma_f16) or bf16 (prnn_mma_bf16), c and d
// 16 x 8 in fp32: one mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 (HMMA). A
// warp collective: every lane of the warp calls it together, passing its fragments in the PTX
// ISA's layout ("Matrix Fragments for mma.m16n8k16 with floating point type"; emulation.h spells
// it out): `a` 8 elements of A and `b` 4 of B, two per word (element 2j in the low half), `c` and
// `d` 4 elements of C and D. d may be c. Volatile: a collective stays where every lane reaches it.
#define PRNN_MMA_M16N8K16(type)                                                                   \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." type "." type ".f32 "                     \
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"             \
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                   \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),     \
                 "f"(c[1]), "f"(c[2]), "f"(c[3]))
PRNN_DEVICE void prnn_mma_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                              const float (&c)[4]) {
  PRNN_MMA_M16N8K16("f16");
}
PRNN_DEVICE void prnn_mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                               const float (&c)[4]) {
  PRNN_MMA_M16N8K16("bf16");
}
#undef PRNN_MMA_M16N8K16
// Four 8 x 8 matrices of 16-bit values from shared memory, a fragment of each per lane:
// ldmatrix.sync.aligned.m8n8.x4.shared.b16, a warp collective. Lane l passes the start of row
// l % 8 of matrix l / 8 (8 values, 16 bytes, 16-byte aligned) and gets in r[j] the word of
// columns 2(l % 4), 2(l % 4) + 1 of row l / 4 of matrix j (the PTX ISA, "Warp-level matrix load
// instruction: ldmatrix"): with rows 0-7 / 8-15 and columns 0-7 / 8-15 of a 16 x 16 A as the four
// matrices, r is A's mma fragment.
PRNN_DEVICE void prnn_ldmatrix_x4(unsigned (&r)[4], const unsigned* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"((unsigned)__cvta_generic_to_shared(row)) : "memory");
}
// Two consecutive floats of shared memory (p 8-byte aligned) in one load.
PRNN_DEVICE void prnn_load_shared_pair(const float* p, float& a, float& b) {
  const float2 v = *reinterpret_cast<const float2*>(p);
  a = v.x;
  b = v.y;
}
// Four consecutive floats of shared memory (p 16-byte aligned) in one load.
PRNN_DEVICE void prnn_load_shared_quad(const float* p, float (&v)[4]) {
  const float4 q = *reinterpret_cast<const float4*>(p);
  v[0] = q.x;
  v[1] = q.y;
  v[2] = q.z;
  v[3] = q.w;
}
// Four consecutive floats of shared memory (p 16-byte aligned) in one store.
PRNN_DEVICE void prnn_store_shared_quad(float* p, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}

// ---- thread-block cluster (sm_90; only in kernels built with -DPRNN_CLUSTER=n) ------------------
// The kernel is compiled with its cluster shape, so an ordinary launch of a grid of n CTAs runs
// as one cluster: all n CTAs resident together, each one's shared memory addressable by the others.
#ifdef PRNN_CLUSTER
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "PRNN_CLUSTER needs sm_90 or newer (thread-block clusters)"
#endif
#define PRNN_CLUSTER_DIMS __cluster_dims__(PRNN_CLUSTER, 1, 1)
// Every thread of every CTA of the cluster arrives, then waits for all: release/acquire at
// cluster scope. Untimed, so only where every CTA is sure to arrive (launch start and end).
PRNN_DEVICE void prnn_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Stores v at the address of `local` (in this CTA's shared memory) in CTA `cta` of the cluster.
PRNN_DEVICE void prnn_store_cluster_u32(unsigned* local, int cta, unsigned v) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote) : "r"((unsigned)__cvta_generic_to_shared(local)), "r"(cta));
  asm volatile("st.relaxed.cluster.shared::cluster.u32 [%0], %1;" ::"r"(remote), "r"(v) : "memory");
}
// A 4-byte word of this CTA's shared memory that other CTAs of the cluster store into (relaxed,
// cluster scope: every access to such a word is single-copy atomic, so that no formal argument
// needs the plain store's physical behaviour).
PRNN_DEVICE void prnn_store_shared_relaxed_u32(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.cluster.shared::cta.u32 [%0], %1;"
               ::"r"((unsigned)__cvta_generic_to_shared(p)), "r"(v) : "memory");
}
// Four 4-byte words of this CTA's shared memory that other CTAs of the cluster store into.
PRNN_DEVICE void prnn_load_shared_relaxed_u32x4(const unsigned* p, unsigned (&w)[4]) {
  asm volatile("ld.relaxed.cluster.shared::cta.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "r"((unsigned)__cvta_generic_to_shared(p)));
}
// The address of a word of this CTA's shared memory as the loads below take it: a 32-bit
// shared-window address, so that a constant offset from one base (prnn_shared_at) folds into the
// load instruction instead of an address computed per word.
using PrnnSharedWord = unsigned;
PRNN_DEVICE PrnnSharedWord prnn_shared_word(const unsigned* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
PRNN_DEVICE PrnnSharedWord prnn_shared_at(PrnnSharedWord base, int words) { return base + 4u * words; }
// One 4-byte word of this CTA's shared memory that other CTAs of the cluster store into.
PRNN_DEVICE unsigned prnn_load_shared_relaxed_u32(PrnnSharedWord p) {
  unsigned v;
  asm volatile("ld.relaxed.cluster.shared::cta.u32 %0, [%1];" : "=r"(v) : "r"(p));
  return v;
}
// Two adjacent 4-byte words (8-byte aligned) of this CTA's shared memory, as above: a vector
// access is one single-copy-atomic access per element, like the 4-byte stores it races.
PRNN_DEVICE void prnn_load_shared_relaxed_u32x2(PrnnSharedWord p, unsigned& a, unsigned& b) {
  asm volatile("ld.relaxed.cluster.shared::cta.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "r"(p));
}
#endif

#endif  // PRNN_EMULATION

#ifndef PRNN_CLUSTER_DIMS
#define PRNN_CLUSTER_DIMS
#endif

// ---- global -> shared copies that use no registers (sm_80+ cp.async) ----------------------------
// prnn_copy16_to_shared copies 16 bytes through L2 only, like ld.cg (both addresses 16-byte
// aligned); prnn_copy4_to_shared copies 4 bytes and may use L1, so only for data no CTA writes
// during the launch. The copies a thread issued are complete after prnn_copy_wait (visible to the
// block after a block sync).
#ifndef PRNN_EMULATION  // emulation.h has its own (at once, or at the wait: late copies)
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

// Shared by all CTAs of one launch; the host zeroes it (and sets progress[] to "the step before
// the resume step" in the run's direction) before every launch.
struct PrnnControl {
  unsigned arrivals;  // prnn_grid_barrier: arrivals in this launch (epoch = round); the tagged
                      // exchange: CTAs that have started (prnn_note_started)
  unsigned abort;     // set by the first CTA whose wait passes its deadline (a PrnnAbort); all
                      // CTAs then exit
  int progress[1];    // [gridDim.x]: last step whose results this CTA has written
};

// Why a launch was aborted (the abort word; the host reads it, runtime._Control).
enum PrnnAbort : unsigned {
  kPrnnTimedOut = 1u,     // a wait passed its deadline with every CTA of the grid started
  kPrnnNotResident = 2u,  // ... while some CTA had not started: the grid is not co-resident
};

// Records why the launch is aborted: the first reason stays (a compare-and-swap from 0). A later
// writer must not overwrite it: a CTA that found the grid not co-resident exits, a waiting CTA
// starts on its SM, and a wait that passes its deadline after that sees every CTA started - its
// "timed out" would hide the residency problem and no cooldown would start (issue 27).
PRNN_DEVICE void prnn_abort(PrnnControl* ctl, PrnnAbort why) { prnn_atomic_set_if_zero(&ctl->abort, why); }

// Counts this CTA as started (thread 0; once, at launch start), so that a wait that times out can
// tell a grid that is not co-resident from a CTA that stalled.
PRNN_DEVICE void prnn_note_started(PrnnControl* ctl) {
  if (threadIdx.x == 0) prnn_atomic_add_release(&ctl->arrivals, 1u);
}

// Counts this CTA as started (as prnn_note_started) and returns how many CTAs started before it:
// its place in the order the GPU started the grid's CTAs, which CUDA does not promise to be
// blockIdx.x's. A kernel whose CTAs wait only for CTAs that started before them (the stack's
// layers: stack_common.cuh) uses it as its CTA index, so that where the grid is not co-resident no
// CTA holds an SM while waiting for one that cannot start. Every thread calls it; `scratch` is a
// word of shared memory no thread uses until the caller's next block barrier.
PRNN_DEVICE int prnn_start_order(PrnnControl* ctl, unsigned* scratch) {
  if (threadIdx.x == 0) *scratch = prnn_atomic_add_release(&ctl->arrivals, 1u);
  prnn_sync_block();
  const int order = (int)*scratch;
  prnn_sync_block();  // every thread has read it before the caller reuses the word
  return order;
}

// A stall injected by prnn.inject_stall: CTA `block` waits `ns` before publishing step `step`.
struct PrnnStall {
  int block;
  int step;
  unsigned long long ns;
};

// Every thread of the stalled CTA waits (no block barrier needed to hold back its publishing).
// `block`: the CTA's index as the host numbers it (blockIdx.x, or a stack's layout index).
PRNN_DEVICE void prnn_maybe_stall(const PrnnStall& stall, int step, int block = blockIdx.x) {
  if (stall.ns != 0ull && block == stall.block && step == stall.step) {
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
        prnn_abort(ctl, kPrnnTimedOut);  // no-op where another CTA aborted first
        failed = 1;
        break;
      }
      prnn_backoff();
    }
  }
  return !prnn_sync_block_or(failed);
}

// ---- the tagged exchange: publishing a value is the barrier ---------------------------------------
//
// A word is 4 bytes: an fp32 value whose two lowest mantissa bits carry the step's tag, written
// with one 4-byte store (single-copy atomic): a reader that sees the tag it expects has that
// store's value as well, so there is no fence, no arrival counter and no second L2 round trip -
// the load of the data is the wait (the idea of NCCL's LL protocol). Readers load four words at
// once (a 16-byte vector load, which PTX's memory model treats as four 4-byte accesses: every
// access is the size of the stores it races with). Buffers are [2][...] by step parity: a CTA
// publishes step t only after it has read all of step t-1, so no CTA overwrites the slot of step
// t-2 while another still reads it; a reader of step t finds in its slot step t-2's word or step
// t's (it read t-2's word itself two steps ago, and a later load of the same location never sees
// an older store), or zero after the host zeroed the buffer (before a run and every restart).
// So tags need only differ between steps t-2 and t and from zero: 1, 2, 3, 1, ... (prnn_step_tag).
//
// The exchanged value is rounded (prnn_exchange_value): the two tag bits are cleared (truncation
// toward zero: relative error below 2^-21, no finite value becomes Inf, zero and the sign stay,
// Inf stays Inf) and a NaN becomes the canonical quiet NaN (a NaN whose payload sits in the tag
// bits would otherwise read back as Inf). Every CTA, the owner included, multiplies by the value
// as exchanged, and a launch's first step stages its vector through the same rounding, so results
// are deterministic and restarts bitwise identical. 16-bit states (fp16, bf16 held as fp32) have
// their low 13 bits zero: lossless.
constexpr unsigned kPrnnTagBits = 3u;

// The tag of step t's words: never 0 (a zeroed word), and different for t and t-2.
PRNN_DEVICE unsigned prnn_step_tag(int t) { return 1u + ((unsigned)t >> 1) % 3u; }
// v as the exchange delivers it (see above).
PRNN_DEVICE float prnn_exchange_value(float v) {
  const unsigned bits = prnn_float_bits(v);
  return prnn_bits_float((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : bits & ~kPrnnTagBits);
}
PRNN_DEVICE unsigned prnn_tagged(float v, unsigned tag) {
  return prnn_float_bits(prnn_exchange_value(v)) | tag;
}
PRNN_DEVICE unsigned prnn_tag_of(unsigned w) { return w & kPrnnTagBits; }
PRNN_DEVICE float prnn_value_of(unsigned w) { return prnn_bits_float(w & ~kPrnnTagBits); }

// Words per row of a tagged vector of k_len values: whole quads, so that a reader loads 16 bytes.
PRNN_HD int exchange_row_words(int k_len) { return (k_len + 3) & ~3; }

// Publishes value k of a row of k_len values at `word` with store(word, tagged word) and, after
// the row's last value, zeros up to the end of its quad (value 0 with the tag), so that readers
// poll whole quads.
template <class Store>
PRNN_DEVICE void prnn_publish(unsigned* word, int k, int k_len, float v, unsigned tag, Store store) {
  store(word, prnn_tagged(v, tag));
  if (k + 1 == k_len) {
    // A loop, not unrolled: in a cluster each store is one per CTA, and the branch is rarely taken.
#pragma unroll 1
    for (int i = 1; i <= (-k_len & 3); ++i) store(word + i, tag);
  }
}

// How a thread waits for tagged words (prnn_gather_tagged): the first kFreePolls polls that find
// words missing poll again at once - no timer, no abort word, no sleep: the words of a CTA that
// is on time arrive within a poll or two. After that the deadline starts (`timeout_ns` ahead);
// every later poll reads the timer (not memory) and sleeps briefly, and every kAbortEvery-th also
// reads the abort word, so the threads that wait do not queue at its L2 slice on every retry.
template <int kFreePolls, int kAbortEvery>
struct PrnnWaitPolicy {
  static_assert(kFreePolls >= 0 && kAbortEvery >= 1, "bad polling policy");
  static constexpr int free_polls = kFreePolls;
  static constexpr int abort_every = kAbortEvery;
};
// Words in L2: a poll is a round trip (~0.5 us), so two free polls cover about the first
// microsecond. Words in this CTA's shared memory (a cluster): a poll is ~30 cycles.
using PrnnGridWait = PrnnWaitPolicy<2, 8>;
using PrnnClusterWait = PrnnWaitPolicy<64, 64>;

// One thread's progress through a wait: polls that found words missing, and the deadline (0: not
// started). A fresh one per wait.
struct PrnnWait {
  unsigned polls;
  unsigned long long deadline;
};

// Called after a poll that found words missing: true to poll again, false once another CTA
// aborted or the deadline has passed (then the abort word is set: kPrnnNotResident if some CTA of
// the grid has not started yet - the CTAs waited for cannot run until these exit - else
// kPrnnTimedOut; the first reason recorded stays, prnn_abort). Kernels that use it call
// prnn_note_started first.
template <class Policy>
PRNN_DEVICE bool prnn_keep_polling(PrnnControl* ctl, PrnnWait& wait, unsigned long long timeout_ns) {
  if (++wait.polls <= (unsigned)Policy::free_polls) return true;
  const unsigned long long now = prnn_globaltimer_ns();
  if (wait.deadline == 0ull) wait.deadline = now + timeout_ns;
  if (wait.polls % (unsigned)Policy::abort_every == 0u && prnn_load_relaxed(&ctl->abort) != 0u) {
    return false;
  }
  if (now > wait.deadline) {
    const bool all_started = prnn_load_relaxed(&ctl->arrivals) >= gridDim.x;
    prnn_abort(ctl, all_started ? kPrnnTimedOut : kPrnnNotResident);
    return false;
  }
  prnn_backoff();
  return true;
}

// The words of a tagged vector: rows of kRowWords words (a multiple of 4; a compile-time constant,
// so that the column of a word costs no division), of which the first `row_len` (a multiple of 4)
// of each row are published every step; the rest of a row is never written nor read.
template <int kRowWords>
struct PrnnTaggedRows {
  static_assert(kRowWords % 4 == 0, "rows of whole quads");
  int quads;    // rows * kRowWords / 4
  int row_len;  // published words per row (a multiple of 4)
  PRNN_DEVICE bool wanted(int word) const { return word % kRowWords < row_len; }
};

// Loaders of prnn_gather_tagged: the quad at p as four single-copy atomic 4-byte words.
struct PrnnGlobalQuads {  // words in global memory (the grid's exchange), through L2
  using Wait = PrnnGridWait;
  PRNN_DEVICE void operator()(const unsigned* p, unsigned (&w)[4]) const { prnn_load_relaxed_u32x4(p, w); }
};
#ifdef PRNN_CLUSTER
struct PrnnClusterQuads {  // this CTA's own shared memory, which the cluster's CTAs store into
  using Wait = PrnnClusterWait;
  PRNN_DEVICE void operator()(const unsigned* p, unsigned (&w)[4]) const {
    prnn_load_shared_relaxed_u32x4(p, w);
  }
};
#endif

// Waits for the wanted words of src (`rows`: a PrnnTaggedRows) to carry `tag` and hands each
// quad to sink(word index, values[4]). `threads` is blockDim.x, passed as a compile-time constant
// where the kernel has one, so that the addresses of a thread's N quads are one register plus
// immediate offsets. Thread x gathers quads x, x + threads, ...: it loads N
// of them at once into registers (strong loads, all in flight together), polls again only the
// quads whose tags were not all there yet, under the policy of Load::Wait, then moves on to its
// next N. Returns false on timeout or abort. No block barrier: the caller's next one publishes
// the sink's writes.
template <int N, class Rows, class Load, class Sink>
PRNN_DEVICE bool prnn_gather_tagged(const unsigned* src, const Rows& rows, unsigned tag, int threads,
                                    PrnnControl* ctl, unsigned long long timeout_ns, Load load,
                                    Sink sink) {
  static_assert(N >= 1 && N <= 32, "1..32 quads in flight");
  const int stride = threads;
  PrnnWait wait{0u, 0ull};
  for (int base = threadIdx.x; base < rows.quads; base += N * stride) {
    unsigned w[N][4];
    unsigned todo = 0u;  // bit i: quad base + i*stride is still to be (re)loaded
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int m = base + i * stride;
      if (m < rows.quads && rows.wanted(4 * m)) todo |= 1u << i;
    }
    const unsigned mine = todo;
    for (;;) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        if (todo & 1u << i) load(src + 4 * (base + i * stride), w[i]);
      }
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const bool ready =
            prnn_tag_of((w[i][0] ^ tag) | (w[i][1] ^ tag) | (w[i][2] ^ tag) | (w[i][3] ^ tag)) == 0u;
        if ((todo & 1u << i) && ready) todo &= ~(1u << i);
      }
      if (todo == 0u) break;
      if (!prnn_keep_polling<typename Load::Wait>(ctl, wait, timeout_ns)) return false;
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (mine & 1u << i) {
        const float v[4] = {prnn_value_of(w[i][0]), prnn_value_of(w[i][1]), prnn_value_of(w[i][2]),
                            prnn_value_of(w[i][3])};
        sink(4 * (base + i * stride), v);
      }
    }
  }
  return true;
}
