// grid_barrier.cu - the inter-CTA synchronisation of the persistent kernels alone, `rounds` times
// back to back: the emulation's own tests of the protocols, and the latency microbenchmark (the
// floor per step). Each CTA records the time its loop took in elapsed_ns[blockIdx.x].
//   grid_barrier_rounds  the counter barrier (prnn_grid_barrier: fence, arrival atomic, acquire poll)
//   exchange_rounds      the tagged exchange the persistent kernels use (prnn_gather_tagged)
//   cluster_exchange_rounds  the same within one thread-block cluster (-DPRNN_CLUSTER, sm_90)
#include "hw.cuh"

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

// The value word k of the vector carries in round r: every word differs between rounds.
PRNN_DEVICE float exchange_value(int k, int r) { return (float)(k * 8 + (r & 7)); }

// The vector of the exchange kernels: one row, every word below the row's length wanted.
using ExchangeRow = PrnnTaggedRows<(1 << 30)>;

// The rounds of both exchange kernels. In round r every CTA publishes its `width` words of a
// vector of gridDim.x*width, tagged r+1, into slot r%2 of words[2][len rounded up to even]
// (publish(word, tagged value); the padding word of an odd length as a zero, as the persistent
// kernels do), and gathers the whole vector (gather(slot, rows, tag, sink)), counting words whose
// value is wrong in *errors. The block barrier per round is the persistent kernels' too: no thread
// publishes round r+1 while another still reads round r-1's slot. Returns the last round completed.
template <class Publish, class Gather>
PRNN_DEVICE int exchange_loop(unsigned long long* words, PrnnControl* ctl, int rounds, int width,
                              const PrnnStall& stall, unsigned* errors, Publish publish,
                              Gather gather) {
  const int len = (int)gridDim.x * width, row_words = len + (len & 1);
  const ExchangeRow row{row_words / 2, row_words};
  int r = 0;
  for (; r < rounds; ++r) {
    prnn_maybe_stall(stall, r);
    unsigned long long* slot = words + (size_t)(r & 1) * row_words;
    const unsigned tag = (unsigned)r + 1u;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
      const int k = (int)blockIdx.x * width + i;
      publish(slot + k, prnn_tagged(exchange_value(k, r), tag));
      if (k + 1 == len && (len & 1)) publish(slot + k + 1, prnn_tagged(0.0f, tag));
    }
    unsigned wrong = 0;
    const bool ok = gather(slot, row, tag, [&](int k, float v0, float v1) {
      wrong += v0 != exchange_value(k, r);
      wrong += v1 != (k + 1 < len ? exchange_value(k + 1, r) : 0.0f);
    });
    if (wrong != 0u) prnn_atomic_add_release(errors, wrong);
    if (prnn_sync_block_or(!ok)) break;
  }
  return r - 1;
}

// The grid's exchange: words in global memory (zeroed by the host), gathered with batched strong
// polls, 8 pairs in flight per thread. progress[cta] = last round completed.
PRNN_KERNEL void exchange_rounds(unsigned long long* exchange, PrnnControl* ctl, int rounds,
                                 int width, unsigned long long timeout_ns, int stall_block,
                                 int stall_step, unsigned long long stall_ns,
                                 unsigned long long* elapsed_ns, unsigned* errors) {
  const PrnnStall stall{stall_block, stall_step, stall_ns};
  prnn_note_started(ctl);
  const unsigned long long start = prnn_globaltimer_ns();
  const int done = exchange_loop(
      exchange, ctl, rounds, width, stall, errors,
      [](unsigned long long* word, unsigned long long v) { prnn_store_relaxed_u64(word, v); },
      [&](const unsigned long long* slot, const ExchangeRow& row, unsigned tag, auto sink) {
        return prnn_gather_tagged<8>(slot, row, tag, ctl, timeout_ns, PrnnGlobalPairs{}, sink);
      });
  if (threadIdx.x == 0) {
    ctl->progress[blockIdx.x] = done;
    elapsed_ns[blockIdx.x] = prnn_globaltimer_ns() - start;
  }
}

#ifdef PRNN_CLUSTER
// The cluster's exchange (built with -DPRNN_CLUSTER = the grid size, sm_90): each CTA stores its
// words into every CTA's copy in shared memory (16 * (len rounded up to even) bytes of dynamic
// shared memory) and polls its own; the cluster meets after zeroing and before exiting.
PRNN_KERNEL void PRNN_CLUSTER_DIMS cluster_exchange_rounds(
    PrnnControl* ctl, int rounds, int width, unsigned long long timeout_ns, int stall_block,
    int stall_step, unsigned long long stall_ns, unsigned long long* elapsed_ns, unsigned* errors) {
  const PrnnStall stall{stall_block, stall_step, stall_ns};
  const int len = (int)gridDim.x * width;
  prnn_note_started(ctl);
  unsigned long long* words = prnn_shared_memory<unsigned long long>();
  for (int i = threadIdx.x; i < 2 * (len + (len & 1)); i += blockDim.x) words[i] = 0ull;
  prnn_cluster_sync();
  const unsigned long long start = prnn_globaltimer_ns();
  const int done = exchange_loop(
      words, ctl, rounds, width, stall, errors,
      [](unsigned long long* word, unsigned long long v) {
        for (int cta = 0; cta < PRNN_CLUSTER; ++cta) prnn_store_cluster_u64(word, cta, v);
      },
      [&](const unsigned long long* slot, const ExchangeRow& row, unsigned tag, auto sink) {
        return prnn_gather_tagged<4>(slot, row, tag, ctl, timeout_ns, PrnnClusterPairs{}, sink);
      });
  if (threadIdx.x == 0) {
    ctl->progress[blockIdx.x] = done;
    elapsed_ns[blockIdx.x] = prnn_globaltimer_ns() - start;
  }
  prnn_cluster_sync();
}
#endif
