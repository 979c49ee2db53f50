// grid_barrier.cu - the inter-CTA synchronisation of the persistent kernels alone, `rounds` times
// back to back: the emulation's own tests of the protocols, and the latency microbenchmark (the
// floor per step). Each CTA records the time its loop took in elapsed_ns[blockIdx.x].
//   grid_barrier_rounds  the counter barrier (prnn_grid_barrier: fence, arrival atomic, acquire poll)
//   exchange_rounds      the tagged exchange the persistent kernels use (prnn_gather_tagged)
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

// In round r every CTA publishes its `width` words of a vector of gridDim.x*width (tagged r+1,
// into slot r%2 of exchange[2][len rounded up to even], zeroed by the host) and gathers the whole
// vector, counting words whose value is wrong in *errors. The block barrier per round is the
// persistent kernels' too: no thread publishes round r+1 while another still reads round r-1's slot.
// progress[cta] = last round completed.
PRNN_KERNEL void exchange_rounds(unsigned long long* exchange, PrnnControl* ctl, int rounds,
                                 int width, unsigned long long timeout_ns, int stall_block,
                                 int stall_step, unsigned long long stall_ns,
                                 unsigned long long* elapsed_ns, unsigned* errors) {
  const PrnnStall stall{stall_block, stall_step, stall_ns};
  const int len = (int)gridDim.x * width, row_words = len + (len & 1);
  const unsigned long long start = prnn_globaltimer_ns();
  int r = 0;
  for (; r < rounds; ++r) {
    prnn_maybe_stall(stall, r);
    unsigned long long* slot = exchange + (size_t)(r & 1) * row_words;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
      const int k = (int)blockIdx.x * width + i;
      prnn_publish(slot + k, exchange_value(k, r), (unsigned)r + 1u);
    }
    unsigned wrong = 0;
    const bool ok = prnn_gather_tagged<4>(
        slot, 1, row_words, len, (unsigned)r + 1u, ctl, timeout_ns, PrnnGlobalPairs{},
        [&](int, int k, float v) { wrong += v != exchange_value(k, r); });
    if (wrong != 0u) prnn_atomic_add_release(errors, wrong);
    if (prnn_sync_block_or(!ok)) break;
  }
  if (threadIdx.x == 0) {
    ctl->progress[blockIdx.x] = r - 1;
    elapsed_ns[blockIdx.x] = prnn_globaltimer_ns() - start;
  }
}
