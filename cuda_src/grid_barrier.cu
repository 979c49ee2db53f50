// grid_barrier.cu - the inter-CTA synchronisation of the persistent kernels alone, `rounds` times
// back to back: the emulation's own tests of the protocols, and the latency microbenchmark (the
// floor per step). Each CTA records the time its loop took in elapsed_ns[blockIdx.x].
//   grid_barrier_rounds  the counter barrier (prnn_grid_barrier: fence, arrival atomic, acquire poll)
//   exchange_rounds      the tagged exchange the persistent kernels use (prnn_gather_tagged)
//   cluster_exchange_rounds  the same within one thread-block cluster (-DPRNN_CLUSTER, sm_90)
//   exchange_word_round_trip  the tagged word format alone (a value in, the value read back out)
//   abort_reasons        every CTA times out in turn: the abort word keeps the first reason
// and the parts of a round (bench/barrier_latency.py --anatomy; docs/design.md, "The round's anatomy"):
//   exchange_warp_rounds  the tagged exchange in a block of one warp, meeting by a warp vote
//   quad_rounds, quad_acquire_rounds  one thread and one 16-byte quad per CTA: the store and
//                        the polls alone, relaxed or release/acquire
//   cluster_exchange_local_rounds  the cluster's exchange with each CTA's own copy stored locally
//   cluster_barrier_rounds  the hardware cluster barrier per round, carrying one word
//   cluster_barrier_relaxed_rounds  the same barrier with a relaxed arrival, carrying nothing
//   timer_probe          the polling machinery: a %globaltimer read, its tick, a back-off's sleep
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

// The gather of the exchange kernels: prnn_gather_tagged of N quads in flight through Load. A
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

// How a CTA's threads meet at the end of an exchange round: whether any thread's gather failed,
// and the barrier after which a thread may publish into the slot the others read the round before.
struct BlockVote {  // any block: a block barrier with a reduction (bar.red), as the kernels do
  PRNN_DEVICE int operator()(int failed) const { return prnn_sync_block_or(failed); }
};
struct WarpVote {  // a block of one warp: __syncwarp and vote.any, no block barrier
  PRNN_DEVICE int operator()(int failed) const { return prnn_sync_warp_or(failed); }
};

// The rounds of the exchange kernels. In round r every CTA publishes its `width` words of a
// vector of gridDim.x*width, tagged prnn_step_tag(r), into slot r%2 of words[2][len rounded up
// to a multiple of 4] (store(word, tagged word); with the zeros that end the last quad, as the
// persistent kernels do), and gathers the whole vector (gather(slot, rows, tag, sink)), counting
// words whose value is wrong in *errors. The vote per round (a block barrier, as the persistent
// kernels have) keeps any thread from publishing round r+1 while another still reads round
// r-1's slot. Returns the last round completed.
template <class Store, class Gather, class Vote>
PRNN_DEVICE int exchange_loop(unsigned* words, PrnnControl* ctl, int rounds, int width,
                              const PrnnStall& stall, unsigned* errors, Store store,
                              Gather gather, Vote vote) {
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
    if (vote(!ok)) break;
  }
  return r - 1;
}

// The parameters of the exchange kernels (after the grid's words), and the arguments of their
// bodies.
#define EXCHANGE_PARAMS                                                                         \
  PrnnControl *ctl, int rounds, int width, unsigned long long timeout_ns, int stall_block,      \
      int stall_step, unsigned long long stall_ns, unsigned long long *elapsed_ns, unsigned *errors
#define EXCHANGE_ARGS \
  ctl, rounds, width, timeout_ns, PrnnStall{stall_block, stall_step, stall_ns}, elapsed_ns, errors

// What an exchange kernel's thread 0 records at the end: the last round done and the time taken.
PRNN_DEVICE void record_rounds(PrnnControl* ctl, int done, unsigned long long start,
                               unsigned long long* elapsed_ns) {
  ctl->progress[blockIdx.x] = done;
  elapsed_ns[blockIdx.x] = prnn_globaltimer_ns() - start;
}

// The grid's exchange: words in global memory (zeroed by the host), gathered with batched strong
// polls, 8 quads in flight per thread, the threads meeting by Vote. progress[cta] = last round
// completed.
template <class Vote>
PRNN_DEVICE void grid_exchange(unsigned* exchange, PrnnControl* ctl, int rounds, int width,
                               unsigned long long timeout_ns, const PrnnStall& stall,
                               unsigned long long* elapsed_ns, unsigned* errors) {
  prnn_note_started(ctl);
  const unsigned long long start = prnn_globaltimer_ns();
  const int done = exchange_loop(
      exchange, ctl, rounds, width, stall, errors,
      [](unsigned* word, unsigned v) { prnn_store_relaxed(word, v); },
      TaggedGather<8, PrnnGlobalQuads>{ctl, timeout_ns}, Vote{});
  if (threadIdx.x == 0) record_rounds(ctl, done, start, elapsed_ns);
}

PRNN_KERNEL void exchange_rounds(unsigned* exchange, EXCHANGE_PARAMS) {
  grid_exchange<BlockVote>(exchange, EXCHANGE_ARGS);
}

// The same in a block of one warp (launched with 32 threads), which meets by a warp vote: the
// round without its block barrier.
PRNN_KERNEL void exchange_warp_rounds(unsigned* exchange, EXCHANGE_PARAMS) {
  grid_exchange<WarpVote>(exchange, EXCHANGE_ARGS);
}

// How the quad kernels store and load a quad (Store, Load), and wait: polls without a timer read
// or a sleep for the first 1024 (about 0.5 ms through L2), so that a round measures the words'
// way alone.
template <void (*Store)(unsigned*, const unsigned (&)[4]),
          void (*Load)(const unsigned*, unsigned (&)[4])>
struct SpinQuad {
  using Wait = PrnnWaitPolicy<1024, 8>;
  PRNN_DEVICE static void store(unsigned* p, const unsigned (&w)[4]) { Store(p, w); }
  PRNN_DEVICE void operator()(const unsigned* p, unsigned (&w)[4]) const { Load(p, w); }
};
using RelaxedQuad = SpinQuad<prnn_store_relaxed_u32x4, prnn_load_relaxed_u32x4>;
using AcquireQuad = SpinQuad<prnn_store_release_u32x4, prnn_load_acquire_u32x4>;

// The grid's round reduced to its store and loads: thread 0 of each CTA only (the others exit),
// no block barrier. In round r it publishes exchange_value(cta, r) and three zeros, tagged, as one
// 16-byte store (Quad::store) into quad cta of slot r%2 of words[2][4 * gridDim.x] (zeroed by
// the host), then gathers every CTA's quad (16 in flight; Quad's loads and wait), counting wrong
// values in *errors. One thread reads all of round r before it publishes r+1 (the slot rule).
template <class Quad>
PRNN_DEVICE void quad_exchange(unsigned* words, PrnnControl* ctl, int rounds,
                               unsigned long long timeout_ns, unsigned long long* elapsed_ns,
                               unsigned* errors) {
  prnn_note_started(ctl);
  if (threadIdx.x != 0) return;
  const int len = 4 * (int)gridDim.x;
  const ExchangeRow row{(int)gridDim.x, len};
  const unsigned long long start = prnn_globaltimer_ns();
  int r = 0;
  for (; r < rounds; ++r) {
    unsigned* slot = words + (size_t)(r & 1) * len;
    const unsigned tag = prnn_step_tag(r);
    const unsigned quad[4] = {prnn_tagged(exchange_value(blockIdx.x, r), tag), tag, tag, tag};
    Quad::store(slot + 4 * blockIdx.x, quad);
    unsigned wrong = 0;
    const bool ok = prnn_gather_tagged<16>(slot, row, tag, 1, ctl, timeout_ns, Quad{},
                                           [&](int k, const float (&v)[4]) {
      wrong += v[0] != exchange_value(k / 4, r) || v[1] != 0.0f || v[2] != 0.0f || v[3] != 0.0f;
    });
    if (wrong != 0u) prnn_atomic_add_release(errors, wrong);
    if (!ok) break;
  }
  record_rounds(ctl, r - 1, start, elapsed_ns);
}

PRNN_KERNEL void quad_rounds(unsigned* words, PrnnControl* ctl, int rounds,
                             unsigned long long timeout_ns, unsigned long long* elapsed_ns,
                             unsigned* errors) {
  quad_exchange<RelaxedQuad>(words, ctl, rounds, timeout_ns, elapsed_ns, errors);
}
PRNN_KERNEL void quad_acquire_rounds(unsigned* words, PrnnControl* ctl, int rounds,
                                     unsigned long long timeout_ns, unsigned long long* elapsed_ns,
                                     unsigned* errors) {
  quad_exchange<AcquireQuad>(words, ctl, rounds, timeout_ns, elapsed_ns, errors);
}

// The polling machinery's own costs, on one thread: out[0] the ns that `rounds` back-to-back
// %globaltimer reads took, out[1] the smallest nonzero step between two consecutive reads (the
// timer's tick, where a read is quicker than one), out[2] how many steps were nonzero (out[0] /
// out[2]: the mean tick), out[3] the ns that `rounds` prnn_backoff() calls took (the sleep after
// each failed poll past the free ones).
PRNN_KERNEL void timer_probe(int rounds, unsigned long long* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  unsigned long long last = prnn_globaltimer_ns(), smallest = ~0ull, changes = 0ull;
  const unsigned long long start = last;
  for (int i = 0; i < rounds; ++i) {
    const unsigned long long t = prnn_globaltimer_ns();
    if (t != last) {
      ++changes;
      smallest = t - last < smallest ? t - last : smallest;
    }
    last = t;
  }
  out[0] = last - start;
  out[1] = smallest;
  out[2] = changes;
  const unsigned long long slept = prnn_globaltimer_ns();
  for (int i = 0; i < rounds; ++i) prnn_backoff();
  out[3] = prnn_globaltimer_ns() - slept;
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
// words into every CTA's copy in shared memory (store(word, cta, tagged word); 8 * (len rounded up
// to a multiple of 4) bytes of dynamic shared memory) and polls its own; the cluster meets after
// zeroing and before exiting.
template <class Store>
PRNN_DEVICE void cluster_exchange(PrnnControl* ctl, int rounds, int width,
                                  unsigned long long timeout_ns, const PrnnStall& stall,
                                  unsigned long long* elapsed_ns, unsigned* errors, Store store) {
  const int len = (int)gridDim.x * width;
  prnn_note_started(ctl);
  unsigned* words = prnn_shared_memory<unsigned>();
  for (int i = threadIdx.x; i < 2 * exchange_row_words(len); i += blockDim.x) words[i] = 0u;
  prnn_cluster_sync();
  const unsigned long long start = prnn_globaltimer_ns();
  const int done = exchange_loop(
      words, ctl, rounds, width, stall, errors,
      [&](unsigned* word, unsigned v) {
        for (int cta = 0; cta < PRNN_CLUSTER; ++cta) store(word, cta, v);
      },
      TaggedGather<4, PrnnClusterQuads>{ctl, timeout_ns}, BlockVote{});
  if (threadIdx.x == 0) record_rounds(ctl, done, start, elapsed_ns);
  prnn_cluster_sync();
}

// Every copy through distributed shared memory (mapa, st.shared::cluster), this CTA's own too,
// as the persistent kernels store.
PRNN_KERNEL void PRNN_CLUSTER_DIMS cluster_exchange_rounds(EXCHANGE_PARAMS) {
  cluster_exchange(EXCHANGE_ARGS, [](unsigned* word, int cta, unsigned v) {
    prnn_store_cluster_u32(word, cta, v);
  });
}

// This CTA's own copy by a store into its own shared memory (st.shared::cta), the others' as above.
PRNN_KERNEL void PRNN_CLUSTER_DIMS cluster_exchange_local_rounds(EXCHANGE_PARAMS) {
  cluster_exchange(EXCHANGE_ARGS, [](unsigned* word, int cta, unsigned v) {
    if (cta == (int)blockIdx.x % PRNN_CLUSTER) {
      prnn_store_shared_relaxed_u32(word, v);
    } else {
      prnn_store_cluster_u32(word, cta, v);
    }
  });
}

// The hardware cluster barrier (arrive.release, wait.acquire) as a round's signal, carrying one
// word: in round r thread 0 stores exchange_value(rank, r) into word r%2 of the next CTA's
// shared memory (2 words of dynamic shared memory), the whole cluster meets, and thread 0 reads
// the word the previous CTA stored, counting wrong ones in *errors. The word of round r is
// overwritten in round r+2, after the barrier of r+1, which its reader passes only after reading
// it. Untimed: every CTA arrives every round (none leaves early) and a cluster runs whole.
PRNN_KERNEL void PRNN_CLUSTER_DIMS cluster_barrier_rounds(int rounds, unsigned long long* elapsed_ns,
                                                          unsigned* errors) {
  unsigned* words = prnn_shared_memory<unsigned>();
  const int rank = (int)blockIdx.x % PRNN_CLUSTER;
  const int next = (rank + 1) % PRNN_CLUSTER, previous = (rank + PRNN_CLUSTER - 1) % PRNN_CLUSTER;
  prnn_cluster_sync();  // every CTA of the cluster runs before any stores into it
  const unsigned long long start = prnn_globaltimer_ns();
  unsigned wrong = 0u;
  for (int r = 0; r < rounds; ++r) {
    if (threadIdx.x == 0) {
      prnn_store_cluster_u32(words + (r & 1), next, prnn_float_bits(exchange_value(rank, r)));
    }
    prnn_cluster_sync();
    if (threadIdx.x == 0) {
      wrong += prnn_load_shared_relaxed_u32(prnn_shared_word(words + (r & 1))) !=
               prnn_float_bits(exchange_value(previous, r));
    }
  }
  if (threadIdx.x == 0) {
    elapsed_ns[blockIdx.x] = prnn_globaltimer_ns() - start;
    if (wrong != 0u) prnn_atomic_add_release(errors, wrong);
  }
}

// The bare hardware barrier: a relaxed arrival (no fence before it) and the wait, carrying
// nothing, so that cluster_barrier_rounds' figure splits into the barrier and its release.
PRNN_KERNEL void PRNN_CLUSTER_DIMS cluster_barrier_relaxed_rounds(int rounds,
                                                                  unsigned long long* elapsed_ns) {
  prnn_cluster_sync();
  const unsigned long long start = prnn_globaltimer_ns();
  for (int r = 0; r < rounds; ++r) prnn_cluster_sync_relaxed();
  if (threadIdx.x == 0) elapsed_ns[blockIdx.x] = prnn_globaltimer_ns() - start;
}
#endif
