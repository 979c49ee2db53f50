// shared_layout.cuh - a kernel's dynamic shared memory, carved region by region in the planner's
// order.
//
// persistent_rnn/plan.py (shared_layout, decoder.py's layout for resident_decoder.cu) is the one
// place that sizes a kernel's regions: each region's 4-byte words per batch row - or, for a
// region of constants, in all - arrive as -D PRNN_SMEM_<REGION> (docs/design.md, "Shared-memory
// layout"), and the launch's bytes are the planner's sum of the same numbers. A kernel takes its
// regions in that order through one SharedCarver and writes no region size of its own: what it
// knows is only how it indexes inside a region. The batch is a launch argument, so a region is
// words-per-row x batch, or fixed words. A start that must be more than 4-byte aligned (a
// cluster's exchange, 16-byte loads) is rounded up as the planner rounds it (its
// PRNN_SMEM_<REGION>_ALIGN). tests/test_plan.py's emulated launches check that the planned bytes
// are exactly what a kernel carves and uses.
#pragma once
#include "hw.cuh"

namespace prnn {

class SharedCarver {
 public:
  PRNN_DEVICE explicit SharedCarver(int batch) : at_(prnn_shared_memory<float>()), batch_(batch) {}

  // The next region: `words` words per batch row.
  template <class T = float>
  PRNN_DEVICE T* rows(int words) { return take<T>(words * batch_); }

  // The next region: `words` words in all (per-CTA constants).
  template <class T = float>
  PRNN_DEVICE T* fixed(int words) { return take<T>(words); }

  // The next region, `words` words per batch row, its start rounded up to `align` bytes (a
  // power of 2).
  template <class T = float>
  PRNN_DEVICE T* aligned_rows(int words, int align) {
    at_ = reinterpret_cast<float*>(((size_t)at_ + align - 1) & ~(size_t)(align - 1));
    return rows<T>(words);
  }

 private:
  template <class T>
  PRNN_DEVICE T* take(int words) {
    static_assert(sizeof(T) == 4, "regions are counted in 4-byte words");
    T* region = reinterpret_cast<T*>(at_);
    at_ += words;
    return region;
  }

  float* at_;  // the next region's start
  int batch_;
};

}  // namespace prnn
