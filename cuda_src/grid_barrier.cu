// grid_barrier.cu - the inter-CTA synchronisation of the persistent kernels alone, `rounds` times
// back to back: the emulation's own tests of the protocols, and the latency microbenchmark (the
// floor per step). Each CTA records the time its loop took in elapsed_ns[blockIdx.x].
//   grid_barrier_rounds  the counter barrier (prnn_grid_barrier: fence, arrival atomic, acquire poll)
//   exchange_rounds      the tagged exchange the persistent kernels use (prnn_gather_tagged)
//   cluster_exchange_rounds  the same within one thread-block cluster (-DPRNN_CLUSTER, sm_90)
//   exchange_word_round_trip  the tagged word format alone (a value in, the value read back out)
//   abort_reasons        every CTA times out in turn: the abort word keeps the first reason
#include "exchange.cuh"

PRNN_KERNEL void grid_barrier_rounds(PrnnControl* ctl, int rounds, unsigned long long timeout_ns,
                                     int stall_block, int stall_step, unsigned long long stall_ns,
                                     unsigned long long* elapsed_ns) {
  const PrnnStall stall{stall_block, stall_step, stall_ns};
  const unsigned long long start = prnn_globaltimer_ns();
  for (int step = 0; step < rounds; ++step) {
    prnn_maybe_stall(stall, step);
    if (!prnn_grid_barrier(ctl, step, (unsigned)(step + 1), timeout_ns)) break;
  }
  if (threadIdx.x == 0) elapsed_ns[blockIdx.x] = prnn_globaltimer_ns() - start;
}

// The value word k of the vector carries in round r: every word differs between rounds (small
// integers, exact in the exchange's rounded fp32).
PRNN_DEVICE float exchange_value(int k, int r) { return (float)(k * 8 + (r & 7)); }

// The vector of the exchange kernels: one row, every word below the row's length wanted.
using ExchangeRow = PrnnTaggedRows<(1 << 30)>;

// The rounds of both exchange kernels. In round r every CTA publishes its `width` words of a
// vector of gridDim.x*width, tagged prnn_step_tag(r), into slot r%2 of words[2][len rounded up
// to a multiple of 4] (store(word, tagged word); with the zeros that end the last quad, as the
// persistent kernels do), and gathers the whole vector (gather(slot, rows, tag, sink)), counting
// words whose value is wrong in *errors. The block barrier per round is the persistent kernels'
// too: no thread publishes round r+1 while another still reads round r-1's slot. Returns the last
// round completed.
// The gather of both exchange kernels: prnn_gather_tagged of N quads in flight through Load. A
// functor, not a generic lambda: NVRTC 13.0 compiles a lambda with an `auto` parameter as a host
// function inside a kernel (13.5 accepts it), and the H100 image has 13.0.
template <int N, class Load>
struct TaggedGather {
  PrnnControl* ctl;
  unsigned long long timeout_ns;
  template <class Sink>
  PRNN_DEVICE bool operator()(const unsigned* slot, const ExchangeRow& row, unsigned tag, Sink sink) const {
    return prnn_gather_tagged<N>(slot, row, tag, (int)blockDim.x, ctl, timeout_ns, Load{}, sink);
  }
};

template <class Store, class Gather>
PRNN_DEVICE int exchange_loop(unsigned* words, PrnnControl* ctl, int rounds, int width,
                              const PrnnStall& stall, unsigned* errors, Store store,
                              Gather gather) {
  const int len = (int)gridDim.x * width, row_words = exchange_row_words(len);
  const ExchangeRow row{row_words / 4, row_words};
  int r = 0;
  for (; r < rounds; ++r) {
    prnn_maybe_stall(stall, r);
    unsigned* slot = words + (size_t)(r & 1) * row_words;
    const unsigned tag = prnn_step_tag(r);
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
      const int k = (int)blockIdx.x * width + i;
      prnn_publish(slot + k, k, len, exchange_value(k, r), tag, store);
    }
    unsigned wrong = 0;
    const bool ok = gather(slot, row, tag, [&](int k, const float (&v)[4]) {
      for (int e = 0; e < 4; ++e) wrong += v[e] != (k + e < len ? exchange_value(k + e, r) : 0.0f);
    });
    if (wrong != 0u) prnn_atomic_add_release(errors, wrong);
    if (prnn_sync_block_or(!ok)) break;
  }
  return r - 1;
}

// The grid's exchange: words in global memory (zeroed by the host), gathered with batched strong
// polls, 8 quads in flight per thread. progress[cta] = last round completed.
PRNN_KERNEL void exchange_rounds(unsigned* exchange, PrnnControl* ctl, int rounds, int width,
                                 unsigned long long timeout_ns, int stall_block, int stall_step,
                                 unsigned long long stall_ns, unsigned long long* elapsed_ns,
                                 unsigned* errors) {
  const PrnnStall stall{stall_block, stall_step, stall_ns};
  prnn_note_started(ctl);
  const unsigned long long start = prnn_globaltimer_ns();
  const int done = exchange_loop(
      exchange, ctl, rounds, width, stall, errors,
      [](unsigned* word, unsigned v) { prnn_store_relaxed(word, v); },
      TaggedGather<8, PrnnGlobalQuads>{ctl, timeout_ns});
  if (threadIdx.x == 0) {
    ctl->progress[blockIdx.x] = done;
    elapsed_ns[blockIdx.x] = prnn_globaltimer_ns() - start;
  }
}

// The tagged word format alone: out[i] and tag[i] are in[i] published with tag 1 + i % 3 and read
// back (prnn_tagged, prnn_value_of, prnn_tag_of), so that tests can hold the exchange's rounding
// and its NaN and Inf against float64 and torch's semantics.
PRNN_KERNEL void exchange_word_round_trip(const float* in, float* out, unsigned* tag, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const unsigned w = prnn_tagged(in[i], 1u + (unsigned)i % 3u);
    out[i] = prnn_value_of(w);
    tag[i] = prnn_tag_of(w);
  }
}

// Thread 0 of every CTA waits for a word that never arrives (prnn_keep_polling), CTA b's
// deadline at (b + 1) * timeout_ns and the abort word read only every 2^30th poll, so that each
// CTA passes its own deadline and records its reason in turn. On a grid that is not co-resident
// the first CTA finds CTAs not started (kPrnnNotResident) and exits; a waiting CTA then starts,
// and the later deadlines find every CTA started: they must not overwrite the first reason.
PRNN_KERNEL void abort_reasons(PrnnControl* ctl, unsigned long long timeout_ns) {
  prnn_note_started(ctl);
  if (threadIdx.x != 0) return;
  PrnnWait wait{0u, 0ull};
  while (prnn_keep_polling<PrnnWaitPolicy<0, (1 << 30)>>(ctl, wait, (blockIdx.x + 1ull) * timeout_ns)) {
  }
}

#ifdef PRNN_CLUSTER
// The cluster's exchange (built with -DPRNN_CLUSTER = the grid size, sm_90): each CTA stores its
// words into every CTA's copy in shared memory (8 * (len rounded up to a multiple of 4) bytes of
// dynamic shared memory) and polls its own; the cluster meets after zeroing and before exiting.
PRNN_KERNEL void PRNN_CLUSTER_DIMS cluster_exchange_rounds(
    PrnnControl* ctl, int rounds, int width, unsigned long long timeout_ns, int stall_block,
    int stall_step, unsigned long long stall_ns, unsigned long long* elapsed_ns, unsigned* errors) {
  const PrnnStall stall{stall_block, stall_step, stall_ns};
  const int len = (int)gridDim.x * width;
  prnn_note_started(ctl);
  unsigned* words = prnn_shared_memory<unsigned>();
  for (int i = threadIdx.x; i < 2 * exchange_row_words(len); i += blockDim.x) words[i] = 0u;
  prnn_cluster_sync();
  const unsigned long long start = prnn_globaltimer_ns();
  const int done = exchange_loop(
      words, ctl, rounds, width, stall, errors,
      [](unsigned* word, unsigned v) {
        for (int cta = 0; cta < PRNN_CLUSTER; ++cta) prnn_store_cluster_u32(word, cta, v);
      },
      TaggedGather<4, PrnnClusterQuads>{ctl, timeout_ns});
  if (threadIdx.x == 0) {
    ctl->progress[blockIdx.x] = done;
    elapsed_ns[blockIdx.x] = prnn_globaltimer_ns() - start;
  }
  prnn_cluster_sync();
}
#endif
