// stack_common.cuh - what the stack kernels (stack_forward.cu, stack_backward.cu) share.
//
// A unidirectional stack of `layers` layers runs in one launch: CTAs l*P .. l*P+P-1 (P =
// ceil(H / PRNN_UNITS)) are layer l's, all built from the one tile of persistent_common.cuh.
// The tile's columns are two halves of kKsplit/2 column chunks each, chunk-aligned so that the
// partial sums of each half stay apart: forward [W_ih | W_hh] times [y_{l-1}[t]; h_l[t-1]]
// (the input projection of the layers above the first inside the kernel; layer 0 holds zeros in
// its W_ih half and reads gi, the GEMM before the launch), backward [W_hh,l^T | W_ih,l+1^T]
// times [dgh_l[t+1]; dgi_{l+1}[t]].
//
// The exchange (StackExchange) keeps one slot per (layer, step) instead of two by step parity:
// [layers][steps][batch][kHalf] tagged words, step t tagged prnn_step_tag(t) (a slot is written
// once per pass, so any tag but 0 would do). No slot is ever reused
// within a pass, so no reader can be overtaken: layer l+1 may fall any number of steps behind
// layer l (a stalled CTA, CTAs not co-resident) and still finds y_l[t] intact, and the layers
// need neither a global lockstep nor backpressure. The wavefront emerges from the waits alone:
// layer l+1 computes step t once layer l has published it, while layer l computes t+1.
// Every word is written only by the pointwise thread of its (layer, batch row, unit), and every
// write of it, in any launch of the pass, stores the same bits: a step's inputs are words that
// are themselves final once tagged, and the arithmetic is deterministic (fixed summation
// order). So a restart needs no zeroing: the host zeroes the buffer once before the pass, and a
// relaunch reads the words earlier launches published (the first step of a resumed layer takes
// h_{t-1} from its own exchange, the layer below's y_{l-1}[t] from that layer's) and replays
// bitwise the same results. The cost is memory: 4 bytes per staged word and step (forward B*kHalf,
// kHalf >= H; backward kHalf >= G*H; per layer and step) instead of two steps' worth.
#pragma once
#include "persistent_common.cuh"

#ifdef PRNN_CLUSTER
#error "the stack kernels run on the grid path (no thread-block cluster)"
#endif

namespace prnn {

static_assert(kKsplit % 2 == 0, "a stack tile splits its column chunks into two halves");
constexpr int kHalfChunks = kKsplit / 2;
constexpr int kHalf = kHalfChunks * kChunk;  // columns per half of the staged vector

// Tagged quads a thread of a stack gather loads at once: persistent_common.cuh's kGatherQuads,
// -D PRNN_GATHER_QUADS from the planner (plan.stack_gather_quads).
static_assert(kGatherQuads > 0, "a stack kernel needs -DPRNN_GATHER_QUADS (plan.pass_plan)");

// CTAs per layer.
PRNN_DEVICE int stack_ctas_per_layer(int hidden) { return (hidden + kUnits - 1) / kUnits; }

// Which CTA runs which layer: not blockIdx.x, which says nothing about when a CTA starts, but the
// order CTAs started in (prnn_start_order): the first per_layer CTAs take the layer that waits
// for no other layer (the forward's first, the backward's top), the next per_layer the layer
// after it, and so on. A CTA then only ever waits for CTAs of its own layer and for CTAs that
// started before it, so the stack needs only each layer's CTAs resident together, whatever order
// the GPU starts CTAs in: where the grid does not fit at once, CTAs of finished layers exit and
// make room for later ones. The host sees CTA `cta` (progress[], a stall's block) as layer-major,
// layer * per_layer + the CTA's place in its layer.
PRNN_DEVICE int stack_cta(int layer, int order, int per_layer) {
  return layer * per_layer + order % per_layer;
}

// The tagged words of every (layer, step) of a stack pass: k_len values per batch row, in rows of
// kHalf words (a half of the staged vector: word k of row b lands at v_s[b * kPadded + half + k]);
// the writer of a row's last value also publishes zeros up to the end of its quad, so that readers
// poll whole quads.
struct StackExchange {
  unsigned* words;
  PrnnTaggedRows<kHalf> rows;
  int steps, k_len;

  PRNN_DEVICE unsigned* slot(int layer, int t) const {
    return words + ((size_t)layer * steps + t) * rows.quads * 4;
  }
  // Publishes value k of batch row b of (layer, t) (and the zeros that end the row's last quad).
  PRNN_DEVICE void publish(int layer, int t, int b, int k, float v) const {
    prnn_publish(slot(layer, t) + b * kHalf + k, k, k_len, v, prnn_step_tag(t),
                 [](unsigned* w, unsigned v) { prnn_store_relaxed(w, v); });
  }
  // Waits for the values of (layer, t) and hands each quad to sink(b, k, values[4]) (k a
  // multiple of 4). False on timeout/abort.
  template <class Sink>
  PRNN_DEVICE bool gather(int layer, int t, PrnnControl* ctl, unsigned long long timeout_ns,
                          Sink sink) const {
    return prnn_gather_tagged<kGatherQuads>(
        slot(layer, t), rows, prnn_step_tag(t), kThreads, ctl, timeout_ns, PrnnGlobalQuads{},
        [sink](int word, const float (&v)[4]) { sink(word / kHalf, word % kHalf, v); });
  }
  // The same words in another buffer of the same shape (the GRU backward's dgi beside dgh).
  PRNN_DEVICE StackExchange with_words(unsigned* other) const {
    StackExchange x = *this;
    x.words = other;
    return x;
  }
};

// The exchange of a stack launch (host buffer [layers][steps][batch][kHalf] words).
PRNN_DEVICE StackExchange begin_stack_exchange(unsigned* words, int steps, int batch, int k_len) {
  return StackExchange{words, {batch * kHalf / 4, exchange_row_words(k_len)}, steps, k_len};
}

// Zeroes the staged vector (both halves and their padding): the gathers write only the values.
PRNN_DEVICE void clear_staged(float* v_s, int batch) {
  for (int idx = threadIdx.x; idx < batch * kPadded; idx += blockDim.x) v_s[idx] = 0.0f;
  prnn_sync_block();
}

}  // namespace prnn
