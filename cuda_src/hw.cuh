// hw.cuh - the hardware primitives: everything hardware-specific in one place.
//
// Kernels in cuda_src/ use only what this header provides for thread identity beyond
// threadIdx/blockIdx/blockDim/gridDim, block synchronisation, shared memory, warp exchange,
// memory ordering, timers, special-function arithmetic, 16-bit conversions, thread-block clusters
// and asynchronous copies. Compiled with NVRTC the functions below map onto PTX; compiled for the
// host with PRNN_EMULATION defined, emulation.h supplies the same primitives for CPU threads, so
// the kernels themselves carry no #ifdef of their own. The protocol the CTAs of a launch follow
// on these primitives (control words, grid barrier, tagged exchange) is exchange.cuh's.
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
// System scope: words the host reads while the device runs (page-locked host memory mapped into
// the device's address space). A strong store the host sees whole (single-copy atomic), and a
// fence that orders this thread's earlier writes before its later ones for every observer, the
// host's threads included (__threadfence_system).
PRNN_DEVICE void prnn_store_system(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
PRNN_DEVICE void prnn_fence_system() { __threadfence_system(); }
// Stores v at p if p holds 0 (compare-and-swap, relaxed); returns what p held before.
PRNN_DEVICE unsigned prnn_atomic_set_if_zero(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.relaxed.gpu.global.cas.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(p), "r"(0u), "r"(v) : "memory");
  return old;
}
// Stores v at p if p holds `expected` (compare-and-swap, acquire and release: the winner sees
// what was released before the word took `expected`); returns what p held before.
PRNN_DEVICE unsigned prnn_atomic_cas_acq_rel(unsigned* p, unsigned expected, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.cas.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(p), "r"(expected), "r"(v) : "memory");
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
// The same with acquire semantics (bench/barrier_latency.py --anatomy: what the relaxed
// protocol saves), and a quad stored as one 16-byte access, relaxed or release (four single-copy
// atomic 4-byte stores; p 16-byte aligned).
PRNN_DEVICE void prnn_load_acquire_u32x4(const unsigned* p, unsigned (&w)[4]) {
  asm volatile("ld.acquire.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p) : "memory");
}
PRNN_DEVICE void prnn_store_relaxed_u32x4(unsigned* p, const unsigned (&w)[4]) {
  asm volatile("st.relaxed.gpu.global.v4.u32 [%0], {%1, %2, %3, %4};"
               ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
}
PRNN_DEVICE void prnn_store_release_u32x4(unsigned* p, const unsigned (&w)[4]) {
  asm volatile("st.release.gpu.global.v4.u32 [%0], {%1, %2, %3, %4};"
               ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
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
// A word of two 16-bit values (lo in the low half), each rounded to nearest even: the B operand
// of an mma from fp32 values (cvt.rn.{f16,bf16}x2.f32: F2FP; exact for values already 16-bit).
PRNN_DEVICE unsigned prnn_pack_f16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
PRNN_DEVICE unsigned prnn_pack_bf16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
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
// v rounded to TF32 (10-bit mantissa, fp32's exponent) to nearest, ties away from zero, as the
// bits of an fp32 value whose low 13 bits are zero: cvt.rna.tf32.f32, the conversion the PTX ISA
// gives for an mma's .tf32 operands (what the tensor cores do with an operand's unrounded low
// bits is not documented; the CUDA Programming Guide asks for converted inputs).
PRNN_DEVICE unsigned prnn_tf32_bits(float v) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return r;
}
// d = A B + c, A 16 x 8 and B 8 x 8 in TF32 (one value per word, prnn_tf32_bits), c and d 16 x 8
// in fp32: one mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 (HMMA.1688.F32.TF32). A warp
// collective, the PTX ISA's layout ("Matrix Fragments for mma.m16n8k8", .tf32; emulation.h spells
// it out): `a` 4 elements of A, `b` 2 of B, `c` and `d` 4 of C and D as for m16n8k16.
PRNN_DEVICE void prnn_mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                               const float (&c)[4]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
                 "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
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
// The same barrier with a relaxed arrival: it orders no earlier access (the release's arrival is
// a GPU-scope fence and the barrier instruction, this one the instruction alone).
PRNN_DEVICE void prnn_cluster_sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
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

// Element (row, col) of a matrix of `cols` columns held as 32-bit words of two 16-bit values of
// type kDtype (1 fp16, 2 bf16; rows padded to an even length), as fp32 (exact).
template <int kDtype>
PRNN_DEVICE float prnn_pair_element(const unsigned* m, size_t row, int col, int cols) {
  static_assert(kDtype == 1 || kDtype == 2, "16-bit pairs: 1 fp16, 2 bf16");
  const unsigned w = m[row * ((cols + 1) / 2) + col / 2];
  float lo, hi;
  if (kDtype == 1) {
    prnn_f16x2_to_float(w, lo, hi);
  } else {
    prnn_bf16x2_to_float(w, lo, hi);
  }
  return (col & 1) ? hi : lo;
}

#ifndef PRNN_CLUSTER_DIMS
#define PRNN_CLUSTER_DIMS
#endif

// ---- global -> shared copies that use no registers (sm_80+ cp.async) ----------------------------
// prnn_copy16_to_shared copies 16 bytes through L2 only, like ld.cg (both addresses 16-byte
// aligned); prnn_copy4_to_shared copies 4 bytes and may use L1, so only for data no CTA writes
// during the launch. The copies a thread issued are complete after prnn_copy_wait (visible to the
// block after a block sync). prnn_copy_commit closes the group of the copies issued since the
// last one; prnn_copy_wait_prior completes every committed group but the newest (a prefetch two
// steps ahead waits for the older step's while the newer stays in flight).
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
PRNN_DEVICE void prnn_copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
PRNN_DEVICE void prnn_copy_wait_prior() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
#endif
