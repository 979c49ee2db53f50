// backward_pointwise.cuh - the backward's pointwise step, shared by the layer
// (persistent_backward.cu) and the stack (stack_backward.cu) kernels: its read-only inputs (their
// slots per (batch row, owned unit), their asynchronous copy into shared memory one step ahead of
// their use) and the step itself (the cell's backward, the gradients, the carries).
#pragma once
#include "persistent_common.cuh"

namespace prnn {
// Slots of the pointwise step's read-only inputs, per batch row and owned unit.
constexpr int kDy = 0, kH = 1, kHPrev = 2, kC = 3, kCPrev = 4;
constexpr int kSavedSlot = kHasC ? 5 : 3;
constexpr int kInputs = kSavedSlot + ThisCell::S;

// Copies step t's inputs of this CTA's units j0 .. j0+kUnits-1 into step t's buffer of in_s,
// [kInputBuffers][batch][kInputs][kUnits] (input_buffer; asynchronous, may use L1): dy_t where `with_dy` (a stack's lower
// layers stage theirs apart), h_t, h_{t-1} (h0 at t = 0), c_t and c_{t-1} for a cell with a cell
// state, and the saved activations. y, dy, cs: (T, B, H), plane = B*H apart; h0, c0: (B, H);
// saved: (T, B, S*H).
PRNN_DEVICE void prefetch_backward_inputs(float* in_s, int t, int batch, int hidden, int j0,
                                          size_t plane, bool with_dy, const float* dy,
                                          const float* y, const float* h0, const float* cs,
                                          const float* c0, const float* saved) {
  constexpr int S = ThisCell::S;
  float* base = input_buffer<kInputs * kUnits>(in_s, t, batch);
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

// The pointwise step t of this CTA's units, once the partial sums part_s
// ([batch][kKsplit][kUnits]) are complete. Per (batch row b, owned unit u), thread b * kUnits + u
// (the same every step, so carry_s, [2][batch][kUnits]: the dh and dc carries, needs no
// barrier): dh = dy_t (`with_dy`) + the direct carry + the recurrent sum (`recurrent`), the
// cell's backward on step t's inputs (in_t: their buffer of step t, prefetch_backward_inputs;
// it and gh_len = G*H come from the caller: computed here, they cost the 16-bit LSTM cluster
// backward 22 instructions a step), then for each gate row
// k = g * hidden + j publish(b, k, dgi, dgh) and dgi_t, dgh_t (T, B, G*H) written, and the
// carries to step t-1 kept in carry_s and written at dh_carry/dc_carry[carry_step * plane +
// b*H + j] (what a restart resumes from; plane = B*H).
template <class Publish>
PRNN_DEVICE void backward_pointwise(const float* in_t, int gh_len, const float* part_s,
                                    float* carry_s, const int* len_s, int t, int batch,
                                    int hidden, int j0,
                                    bool with_dy, bool recurrent, float* dgi, float* dgh,
                                    float* dh_carry, float* dc_carry, size_t plane, int carry_step,
                                    Publish publish) {
  constexpr int G = ThisCell::G, S = ThisCell::S;
  for (int idx = threadIdx.x; idx < batch * kUnits; idx += blockDim.x) {
    const int b = idx / kUnits, u = idx % kUnits, j = j0 + u;
    if (j >= hidden) continue;
    const size_t row = (size_t)t * batch + b, at = (size_t)b * hidden + j;
    const float* in = in_t + b * kInputs * kUnits + u;  // slot k at in[k * kUnits]
    float sv[kSavedSlots], dgiv[G], dghv[G];
#pragma unroll
    for (int s = 0; s < S; ++s) sv[s] = in[(kSavedSlot + s) * kUnits];
    const float dh = (with_dy ? in[kDy * kUnits] : 0.0f) + carry_s[idx] +
                     (recurrent ? row_sum(part_s, b, u, kUnits) : 0.0f);
    const float dc = kHasC ? carry_s[batch * kUnits + idx] : 0.0f;
    const float c = kHasC ? in[kC * kUnits] : 0.0f, c_prev = kHasC ? in[kCPrev * kUnits] : 0.0f;
    float dh_prev, dc_prev;
    cell_backward_masked<PRNN_CELL>(t < len_s[b], dh, dc, sv, in[kH * kUnits], c, in[kHPrev * kUnits],
                                    c_prev, dgiv, dghv, dh_prev, dc_prev);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      publish(b, g * hidden + j, dgiv[g], dghv[g]);
      dgi[row * gh_len + g * hidden + j] = dgiv[g];
      dgh[row * gh_len + g * hidden + j] = dghv[g];
    }
    // The carries stay in shared memory; the global copies are what a restart resumes from.
    dh_carry[carry_step * plane + at] = carry_s[idx] = dh_prev;
    if (kHasC) dc_carry[carry_step * plane + at] = carry_s[batch * kUnits + idx] = dc_prev;
  }
}
}  // namespace prnn
