// backward_inputs.cuh - the read-only inputs of the backward's pointwise step, shared by the layer
// (persistent_backward.cu) and the stack (stack_backward.cu) kernels: their slots per (batch row,
// owned unit), and their asynchronous copy into shared memory one step ahead of their use.
#pragma once
#include "persistent_common.cuh"

namespace prnn {
// Slots of the pointwise step's read-only inputs, per batch row and owned unit.
constexpr int kDy = 0, kH = 1, kHPrev = 2, kC = 3, kCPrev = 4;
constexpr int kSavedSlot = kHasC ? 5 : 3;
constexpr int kInputs = kSavedSlot + ThisCell::S;

// Copies step t's inputs of this CTA's units j0 .. j0+kUnits-1 into slot t % 2 of in_s,
// [2][batch][kInputs][kUnits] (asynchronous, may use L1): dy_t where `with_dy` (a stack's lower
// layers stage theirs apart), h_t, h_{t-1} (h0 at t = 0), c_t and c_{t-1} for a cell with a cell
// state, and the saved activations. y, dy, cs: (T, B, H), plane = B*H apart; h0, c0: (B, H);
// saved: (T, B, S*H).
PRNN_DEVICE void prefetch_backward_inputs(float* in_s, int t, int batch, int hidden, int j0,
                                          size_t plane, bool with_dy, const float* dy,
                                          const float* y, const float* h0, const float* cs,
                                          const float* c0, const float* saved) {
  constexpr int S = ThisCell::S;
  float* base = in_s + (t & 1) * batch * kInputs * kUnits;
  for (int idx = threadIdx.x; idx < batch * kUnits; idx += blockDim.x) {
    const int b = idx / kUnits, u = idx % kUnits, j = j0 + u;
    if (j >= hidden) continue;
    const size_t at = ((size_t)t * batch + b) * hidden + j, at0 = (size_t)b * hidden + j;
    float* in = base + b * kInputs * kUnits + u;
    if (with_dy) prnn_copy4_to_shared(in + kDy * kUnits, dy + at);
    prnn_copy4_to_shared(in + kH * kUnits, y + at);
    prnn_copy4_to_shared(in + kHPrev * kUnits, t > 0 ? y + (at - plane) : h0 + at0);
    if (kHasC) {
      prnn_copy4_to_shared(in + kC * kUnits, cs + at);
      prnn_copy4_to_shared(in + kCPrev * kUnits, t > 0 ? cs + (at - plane) : c0 + at0);
    }
#pragma unroll
    for (int s = 0; s < S; ++s) {
      prnn_copy4_to_shared(in + (kSavedSlot + s) * kUnits,
                           saved + ((size_t)t * batch + b) * S * hidden + (size_t)s * hidden + j);
    }
  }
}
}  // namespace prnn
