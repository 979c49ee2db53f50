// exchange.cuh - the protocol between the CTAs of a persistent launch and with the host's restart,
// written once on hw.cuh's primitives (so that the emulation runs it unchanged; nothing here is
// hardware-specific):
// * the control words a launch shares with the host (PrnnControl: arrivals, the abort reason,
//   each CTA's progress, from which the restart resumes), the CTAs' start order;
// * injected stalls (prnn.inject_stall);
// * the counter grid barrier with timeout (a fence, an arrival atomic and polls per step: the
//   baseline bench/barrier_latency.py measures the tagged exchange against);
// * the tagged exchange: step tags, publishing, bounded waits and the gather of tagged words.
#pragma once

#include "hw.cuh"

// ---- control words, start order, stalls, the counter grid barrier ------------------------------

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
// PRNN_GRID_FREE_POLLS overrides the grid's free polls for an experiment (bench/barrier_latency.py
// --free-polls measures the exchange round with each): the measured round is most of a grid step
// (docs/design.md, "Latency model"), and whether the timer reads and sleeps after two polls lengthen
// it is for a GPU to say.
#ifndef PRNN_GRID_FREE_POLLS
#define PRNN_GRID_FREE_POLLS 2
#endif
using PrnnGridWait = PrnnWaitPolicy<PRNN_GRID_FREE_POLLS, 8>;
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
