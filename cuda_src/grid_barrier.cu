// grid_barrier.cu - `rounds` grid barriers back to back: the emulation's own test of the barrier
// protocol, and the grid-barrier latency microbenchmark (the floor per step of the persistent
// kernels). Each CTA records the time its loop took in elapsed_ns[blockIdx.x].
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
