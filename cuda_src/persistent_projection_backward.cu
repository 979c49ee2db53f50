// persistent_projection_backward.cu - backward through time of one LSTM-with-projection
// layer-direction, W_hh^T and W_hr^T in registers (persistent_projection.cuh).
//
// CTA c owns rows q0 = c*PRNN_PROJ_ROWS.. of r (rows of W_hh^T, tile A over K = 4H) and hidden
// units j0 = c*PRNN_UNITS.. (rows of W_hr^T, tile B over K = P). Going down from `start`, per step t:
//   wait for dg_{t+1} (the gates' gradient, exchange; a launch's first step: dgh[t+1]) ->
//   dr_t = dy_t + carry + W_hh^T dg_{t+1} for the owned rows; drs[t] = dr_t (0 past a length);
//   publish it -> wait for drs_t (every row) -> dh_t = W_hr^T drs_t for the owned units (tile B)
//   -> the LSTM cell's backward -> dgh[t] and the dc carry; publish dg_t.
// Past a length (r_t = r_{t-1}) the step passes dr_t to step t-1 as the carry and its gates'
// gradient is zero; within it the carry is zero (dr_{t-1} is then W_hh^T dg_t, next step's
// product). The carries (dr: [2][B][P], dc: [2][B][H]) are kept by step parity in global memory as
// in persistent_backward.cu: a CTA publishes step t's dr only after it read every CTA's dg_{t+1},
// and its dg_t only after every CTA's dr_t, so no CTA is two steps ahead of another and a restart
// from max(progress)-1 finds the carries of the step above intact. The host seeds parity T%2 with
// dh_n (of r) and dc_n.
#include "persistent_projection.cuh"

namespace prnn {
// Slots of a unit's read-only inputs: c_t, c_{t-1}, then the cell's saved activations.
constexpr int kC = 0, kCPrev = 1, kSavedSlot = 2, kInputs = kSavedSlot + ThisCell::S;
}  // namespace prnn

PRNN_KERNEL void PRNN_CLUSTER_DIMS prnn_projection_backward(
    const prnn::WeightWord* w_hh_t,  // (P, 4H) = W_hh^T, contiguous; 16-bit: words of pairs
    const prnn::WeightWord* w_hr_t,  // (H, P) = W_hr^T, contiguous
    const float* dy,        // (T, B, P), zero past each length
    const float* cs, const float* saved, const float* c0,  // forward's (T, B, H), (T, B, 4H), (B, H)
    const int* lengths,     // (B,) in 1..T
    float* dgh, float* drs, // (T, B, 4H) gates' gradient; (T, B, P) dr_t, zero past each length
    float* dr_carry, float* dc_carry,  // [2][B][P], [2][B][H] by step parity
    unsigned* exchange_r,  // [2][B][padded B] tagged drs_t, zeroed
    unsigned* exchange_g,  // [2][B][padded A] tagged dg_t, zeroed
    unsigned* control,      // PrnnControl, 2 + gridDim.x words
    int steps, int batch, int hidden, int proj, int start,
    unsigned long long timeout_ns, int stall_block, int stall_step, unsigned long long stall_ns) {
  using namespace prnn;
  constexpr int G = ThisCell::G, S = ThisCell::S, V = kProjRows;
  start = launch_start(control, start);
  if (start < 0) return;  // a resume launch of a pass already complete: nothing to settle
  PrnnControl* ctl = started_launch(control);
  const PrnnStall stall{stall_block, stall_step, stall_ns};
  const int j0 = blockIdx.x * kUnits, q0 = blockIdx.x * V, gh_len = G * hidden;
  const size_t plane = (size_t)batch * hidden, rplane = (size_t)batch * proj;
  SharedCarver sh(batch);  // (plan.projection_shared_layout)
  float* g_s = sh.rows(PRNN_SMEM_STAGED);     // [batch][kPadded]: dg_{t+1} (grid only)
  float* r_s = sh.rows(PRNN_SMEM_STAGED_B);   // [batch][kPaddedB]: drs_t (grid only)
  float* pa_s = sh.rows(PRNN_SMEM_PARTIAL);   // [batch][kKsplit][V]: partial W_hh^T dg_{t+1}
  float* pb_s = sh.rows(PRNN_SMEM_PARTIAL_B);  // [batch][kKsplitB][kUnits]: partial W_hr^T drs_t
  float* in_s = sh.rows(PRNN_SMEM_INPUTS);    // [2][batch][kInputs][kUnits]: inputs by parity
  float* dy_s = sh.rows(PRNN_SMEM_DY);        // [2][batch][V]: dy_t of the owned rows
  float* dc_s = sh.rows(PRNN_SMEM_DC);        // [batch][kUnits]: dc carry
  float* dr_s = sh.rows(PRNN_SMEM_DR);        // [batch][V]: dr carry
  int* len_s = sh.rows<int>(PRNN_SMEM_LENGTHS);  // [batch]: lengths
  // Each exchange's rows are its staged vector's: drs_t in tile B's, dg_t in tile A's.
  const ExchangeOf<kPaddedB> xr = begin_exchange<kPaddedB, true>(exchange_r, sh, batch, proj, batch * V);
  const Exchange xg = begin_exchange(exchange_g, sh, batch, gh_len);

  RegisterTile rec;
  load_tile(rec, w_hh_t, gh_len, kKsplit, V, [&](int q) { return q0 + q < proj ? q0 + q : -1; });
  TileB back;
  load_tile(back, w_hr_t, proj, kKsplitB, kUnits, [&](int u) { return j0 + u < hidden ? j0 + u : -1; });

  // The pointwise thread of (b, unit) and of (b, row of r) is the same every step: it keeps the carry.
  const int parity = (start + 1) & 1;
  for (int idx = threadIdx.x; idx < batch * kUnits; idx += blockDim.x) {
    const int b = idx / kUnits, j = j0 + idx % kUnits;
    if (j < hidden) dc_s[idx] = dc_carry[parity * plane + (size_t)b * hidden + j];
  }
  for (int idx = threadIdx.x; idx < batch * V; idx += blockDim.x) {
    const int b = idx / V, q = q0 + idx % V;
    if (q < proj) dr_s[idx] = dr_carry[parity * rplane + (size_t)b * proj + q];
  }
  for (int b = threadIdx.x; b < batch; b += blockDim.x) len_s[b] = lengths[b];
  if (!kDirectRead) zero_staged(r_s, batch, kPaddedB);

  auto prefetch_inputs = [&](int t) {
    float* base = in_s + (t & 1) * batch * kInputs * kUnits;
    for (int idx = threadIdx.x; idx < batch * kUnits; idx += blockDim.x) {
      const int b = idx / kUnits, u = idx % kUnits, j = j0 + u;
      if (j >= hidden) continue;
      const size_t at = ((size_t)t * batch + b) * hidden + j;
      float* in = base + b * kInputs * kUnits + u;
      prnn_copy4_to_shared(in + kC * kUnits, cs + at);
      prnn_copy4_to_shared(in + kCPrev * kUnits, t > 0 ? cs + (at - plane) : c0 + (size_t)b * hidden + j);
#pragma unroll
      for (int s = 0; s < S; ++s) {
        prnn_copy4_to_shared(in + (kSavedSlot + s) * kUnits,
                             saved + ((size_t)t * batch + b) * S * hidden + (size_t)s * hidden + j);
      }
    }
    float* dyt = dy_s + (t & 1) * batch * V;
    for (int idx = threadIdx.x; idx < batch * V; idx += blockDim.x) {
      const int b = idx / V, q = q0 + idx % V;
      if (q < proj) prnn_copy4_to_shared(dyt + idx, dy + ((size_t)t * batch + b) * proj + q);
    }
  };
  prefetch_inputs(start);
  // dg_{start+1} (none at step T-1: it has no recurrent input)
  begin_steps(xg, g_s, start + 1,
              start + 1 < steps ? dgh + (size_t)(start + 1) * batch * gh_len : nullptr, batch);

  int t = start, failed = 0;
  for (;;) {
    // W_hh^T dg_{t+1} (step t's inputs are in shared memory); any timeout? Then step t-1's
    // inputs: their buffer was last read by step t+1's pointwise.
    const bool recurrent = t + 1 < steps;  // false only at a launch's first step, t = T-1
    if (projection_product(rec, xg, t + 1, g_s, pa_s, recurrent ? batch : 0, V, kKsplit, failed,
                           ctl, timeout_ns, [&] { if (t > 0) prefetch_inputs(t - 1); })) {
      ++t;  // step t was not completed
      break;
    }
    prnn_maybe_stall(stall, t);
    const float* dyt = dy_s + (t & 1) * batch * V;
    for (int idx = threadIdx.x; idx < batch * V; idx += blockDim.x) {
      const int b = idx / V, q = q0 + idx % V;
      if (q >= proj) continue;
      const float dr = dyt[idx] + dr_s[idx] + (recurrent ? row_sum(pa_s, b, idx % V, V) : 0.0f);
      const bool active = t < len_s[b];
      const float through = active ? dr : 0.0f;  // what reaches W_hr h_t
      xr.publish(t, b, q, through);
      drs[((size_t)t * batch + b) * proj + q] = through;
      // The carry stays in shared memory; the global copy is what a restart resumes from.
      dr_carry[(t & 1) * rplane + (size_t)b * proj + q] = dr_s[idx] = active ? 0.0f : dr;
    }
    failed = end_step(xr, r_s, t, ctl, timeout_ns);
    // W_hr^T drs_t; any timeout?
    if (projection_product(back, xr, t, r_s, pb_s, batch, kUnits, kKsplitB, failed, ctl,
                           timeout_ns, [] {})) {
      ++t;
      break;
    }
    const float* in_t = in_s + (t & 1) * batch * kInputs * kUnits;
    for (int idx = threadIdx.x; idx < batch * kUnits; idx += blockDim.x) {
      const int b = idx / kUnits, u = idx % kUnits, j = j0 + u;
      if (j >= hidden) continue;
      const size_t row = (size_t)t * batch + b;
      const float* in = in_t + b * kInputs * kUnits + u;  // slot k at in[k * kUnits]
      float sv[S], dgiv[G], dghv[G], dh_prev, dc_prev;
#pragma unroll
      for (int s = 0; s < S; ++s) sv[s] = in[(kSavedSlot + s) * kUnits];
      const float dh = row_sum<kKsplitB>(pb_s, b, u, kUnits);
      // The LSTM's backward reads neither h_t nor h_{t-1}; past a length its gradients are zero.
      cell_backward_masked<PRNN_CELL>(t < len_s[b], dh, dc_s[idx], sv, 0.0f, in[kC * kUnits], 0.0f,
                                      in[kCPrev * kUnits], dgiv, dghv, dh_prev, dc_prev);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        xg.publish(t, b, g * hidden + j, dghv[g]);
        dgh[row * gh_len + g * hidden + j] = dghv[g];
      }
      dc_carry[(t & 1) * plane + (size_t)b * hidden + j] = dc_s[idx] = dc_prev;
    }
    if (t == 0) break;
    failed = end_step(xg, g_s, t, ctl, timeout_ns);
    prnn_copy_wait();  // step t-1's inputs
    --t;
  }
  prnn_leave_layer(control, t, -1, start);
  end_exchange();
}
