// persistent_forward.cu - forward recurrence of one layer-direction with W_hh in registers.
//
// CTA c owns hidden units j0 = c*PRNN_UNITS .. j0+PRNN_UNITS-1 and all G gate rows of them, so
// the cell update is local. Per step t: stage h_{t-1} (all units, from y[t-1] or h0) in shared
// memory, multiply by the CTA's rows of W_hh, apply the cell, write y[t] (the exchange buffer),
// cs[t], saved[t] for the owned units, then meet the other CTAs at the timed grid barrier. A
// step only reads step t-1's results and writes its own slots, so replaying it is idempotent;
// the host relaunches from min(progress)+1 after a barrier timeout.
#include "persistent_common.cuh"

PRNN_KERNEL void prnn_persistent_forward(
    const float* w_hh,      // (G*H, H)
    const float* b_hh,      // (G*H,) zeros when the layer has no bias
    const float* gi,        // (T, B, G*H)  W_ih x_t + b_ih
    const float* h0, const float* c0,  // (B, H); c0 only read for LSTM
    const int* lengths,     // (B,) in 1..T
    float* y, float* cs, float* saved,  // (T, B, H), (T, B, H) LSTM only, (T, B, S*H)
    unsigned* control,      // PrnnControl, 2 + gridDim.x words
    int steps, int batch, int hidden, int start, unsigned long long timeout_ns,
    int stall_block, int stall_step, unsigned long long stall_ns) {
  using namespace prnn;
  constexpr int G = ThisCell::G, S = ThisCell::S, R = G * kUnits;
  PrnnControl* ctl = reinterpret_cast<PrnnControl*>(control);
  const PrnnStall stall{stall_block, stall_step, stall_ns};
  const int j0 = blockIdx.x * kUnits, gh_len = G * hidden;
  float* h_s = prnn_shared_memory<float>();  // [batch][kPadded]: h_{t-1}
  float* gh_s = h_s + batch * kPadded;        // [batch][kKsplit][R]: partial W_hh h_{t-1}
  float* gi_s = gh_s + batch * kKsplit * R;   // [batch][G][kUnits]: gi_t of the owned units
  float* c_s = gi_s + batch * G * kUnits;     // [batch][kUnits]: c_{t-1} of the owned units (LSTM)
  // Constants of the pointwise step, kept in shared memory: the barrier's acquire may invalidate
  // L1, and a reload from L2 every step would sit on the critical path.
  float* bias_s = c_s + batch * kUnits;        // [G][kUnits]: b_hh of the owned rows
  int* len_s = reinterpret_cast<int*>(bias_s + G * kUnits);  // [batch]: lengths

  int rows[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int local = warp_row_group() * kRows + r, g = local / kUnits, u = local % kUnits;
    rows[r] = j0 + u < hidden ? g * hidden + j0 + u : -1;
  }
  RegisterTile tile;
  tile.load(w_hh, rows, warp_chunk() * kChunk, hidden, threadIdx.x % kWarp);

  for (int idx = threadIdx.x; idx < G * kUnits; idx += blockDim.x) {
    const int j = j0 + idx % kUnits;
    if (j < hidden) bias_s[idx] = b_hh[(idx / kUnits) * hidden + j];
  }
  for (int b = threadIdx.x; b < batch; b += blockDim.x) len_s[b] = lengths[b];
  for (int idx = threadIdx.x; kHasC && idx < batch * kUnits; idx += blockDim.x) {
    const int b = idx / kUnits, j = j0 + idx % kUnits;
    if (j < hidden) c_s[idx] = start > 0 ? cs[((size_t)(start - 1) * batch + b) * hidden + j] : c0[(size_t)b * hidden + j];
  }

  for (int t = start; t < steps; ++t) {
    // gi_t is read-only: fetch it asynchronously while h_{t-1} is staged and multiplied.
    for (int idx = threadIdx.x; idx < batch * G * kUnits; idx += blockDim.x) {
      const int b = idx / (G * kUnits), g = idx / kUnits % G, j = j0 + idx % kUnits;
      if (j < hidden) prnn_copy4_to_shared(gi_s + idx, gi + ((size_t)t * batch + b) * gh_len + g * hidden + j);
    }
    stage_exchanged(h_s, t > 0 ? y + (size_t)(t - 1) * batch * hidden : h0, batch, hidden);
    multiply_batch(tile, h_s, gh_s, batch, R);
    for (int idx = threadIdx.x; idx < batch * kUnits; idx += blockDim.x) {
      const int b = idx / kUnits, u = idx % kUnits, j = j0 + u;
      if (j >= hidden) continue;
      const size_t row = (size_t)t * batch + b;
      float giv[G], ghv[G], sv[kSavedSlots];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        giv[g] = gi_s[(b * G + g) * kUnits + u];
        ghv[g] = row_sum(gh_s, b, g * kUnits + u, R) + bias_s[g * kUnits + u];
      }
      const float h_prev = h_s[b * kPadded + j];
      const float c_prev = kHasC ? c_s[idx] : 0.0f;
      float h, c;
      cell_forward_masked<PRNN_CELL>(t < len_s[b], giv, ghv, h_prev, c_prev, h, c, sv);
      y[row * hidden + j] = h;
      if (kHasC) cs[row * hidden + j] = c_s[idx] = c;
#pragma unroll
      for (int s = 0; s < S; ++s) saved[row * S * hidden + s * hidden + j] = sv[s];
    }
    prnn_maybe_stall(stall, t);
    if (!prnn_grid_barrier(ctl, t, (unsigned)(t - start + 1), timeout_ns)) return;
  }
}
