// persistent_projection_forward.cu - forward recurrence of one LSTM-with-projection
// layer-direction, W_hh and W_hr in registers (persistent_projection.cuh).
//
// CTA c owns hidden units j0 = c*PRNN_UNITS.. (all 4 gate rows of them, tile A over K = P) and
// rows q0 = c*PRNN_PROJ_ROWS.. of r (tile B over K = H). Per step t:
//   wait for r_{t-1} (exchange; a launch's first step: y[t-1] or h0) -> gates of the owned units
//   (tile A) -> cell -> hs[t], cs[t], saved[t]; publish h_t -> wait for h_t (every unit) ->
//   the owned rows of r_t = W_hr h_t (tile B; past a length r_t = r_{t-1}) -> y[t]; publish r_t.
// Two exchanges per step; four block barriers on the grid, two in a cluster (its warps read the
// exchanged words in place: persistent_projection.cuh). A step only reads step t-1's results and
// writes its own slots, so a replay is idempotent; a CTA records the last step whose r_t it
// published when it exits and the host restarts from min(progress)+1. 16-bit layers (also where
// the fp32 tile is widened) round r_t (the state, what y holds) to the 16-bit type; h_t stays
// fp32.
#include "persistent_projection.cuh"

PRNN_KERNEL void PRNN_CLUSTER_DIMS prnn_projection_forward(
    const prnn::WeightSource* w_hh,  // (4H, P); 16-bit: (4H, ceil(P/2)) words of pairs
    const prnn::WeightSource* w_hr,  // (P, H); 16-bit: (P, ceil(H/2)) words
    const float* b_hh,      // (4H,) zeros when the layer has no bias
    const float* gi,        // (T, B, 4H)  W_ih x_t + b_ih
    const float* h0, const float* c0,  // (B, P) r_{-1}, (B, H)
    const int* lengths,     // (B,) in 1..T
    float* y, float* hs, float* cs, float* saved,  // (T, B, P) r_t, (T, B, H) h_t and c_t, (T, B, 4H)
    unsigned* exchange_r,  // [2][B][padded A] tagged r_t, zeroed
    unsigned* exchange_h,  // [2][B][padded B] tagged h_t, zeroed
    unsigned* control,      // PrnnControl, 2 + gridDim.x words
    int steps, int batch, int hidden, int proj, int start, unsigned long long timeout_ns,
    int stall_block, int stall_step, unsigned long long stall_ns) {
  using namespace prnn;
  constexpr int G = ThisCell::G, R = G * kUnits, V = kProjRows;
  start = launch_start(control, start);
  if (start >= steps) return;  // a resume launch of a pass already complete: nothing to settle
  PrnnControl* ctl = started_launch(control);
  const PrnnStall stall{stall_block, stall_step, stall_ns};
  const int j0 = blockIdx.x * kUnits, q0 = blockIdx.x * V, gh_len = G * hidden;
  SharedCarver sh(batch);  // (plan.projection_shared_layout)
  float* r_s = sh.rows(PRNN_SMEM_STAGED);     // [batch][kPadded]: r_{t-1} (grid only)
  float* h_s = sh.rows(PRNN_SMEM_STAGED_B);   // [batch][kPaddedB]: h_t (grid only)
  float* gh_s = sh.rows(PRNN_SMEM_PARTIAL);   // [batch][kKsplit][R]: partial W_hh r_{t-1}
  float* pr_s = sh.rows(PRNN_SMEM_PARTIAL_B);  // [batch][kKsplitB][V]: partial W_hr h_t
  float* gi_s = sh.rows(PRNN_SMEM_GI);        // [2][batch][G][kUnits]: gi_t by step parity
  float* c_s = sh.rows(PRNN_SMEM_C);          // [batch][kUnits]: c_{t-1} of the owned units
  float* hp_s = sh.rows(PRNN_SMEM_H);         // [batch][kUnits]: h_{t-1} of the owned units
  float* rp_s = sh.rows(PRNN_SMEM_R);         // [batch][V]: r_{t-1} of the owned rows
  float* bias_s = sh.fixed(PRNN_SMEM_BIAS);   // [G][kUnits]: b_hh of the owned rows
  int* len_s = sh.rows<int>(PRNN_SMEM_LENGTHS);  // [batch]: lengths
  // Each exchange's rows are its staged vector's: r_t in tile A's, h_t in tile B's.
  const Exchange xr = begin_exchange(exchange_r, sh, batch, proj, batch * V);
  const ExchangeOf<kPaddedB> xh = begin_exchange<kPaddedB, true>(exchange_h, sh, batch, hidden);

  const Team team = step_team<G>();  // the whole CTA
  RegisterTile gates;
  load_tile(gates, w_hh, proj, kKsplit, R, [&](int local) {
    const int g = local / kUnits, j = j0 + local % kUnits;
    return j < hidden ? g * hidden + j : -1;
  });
  TileB projection;
  load_tile(projection, w_hr, hidden, kKsplitB, V, [&](int q) { return q0 + q < proj ? q0 + q : -1; });

  load_owned_rows(bias_s, b_hh, G, j0, hidden);
  for (int b = threadIdx.x; b < batch; b += blockDim.x) len_s[b] = lengths[b];
  // h_{t-1} of the units is only read past a length, never at step 0 (h0 is r's). The
  // pointwise thread of (b, row of r) is the same every step too: it keeps r's state.
  load_unit_state<false>(hp_s, c_s, hs, cs, nullptr, c0, start, batch, hidden, j0);
  for (int idx = threadIdx.x; idx < batch * V; idx += blockDim.x) {
    const int b = idx / V, q = q0 + idx % V;
    if (q < proj) rp_s[idx] = start > 0 ? y[((size_t)(start - 1) * batch + b) * proj + q] : h0[(size_t)b * proj + q];
  }
  if (!kDirectRead) zero_staged(h_s, batch, kPaddedB);
  auto prefetch_gi = [&](int t) {
    float* dst = gi_s + (t & 1) * batch * G * kUnits;
    for (int idx = threadIdx.x; idx < batch * G * kUnits; idx += blockDim.x) {
      const int b = idx / (G * kUnits), g = idx / kUnits % G, j = j0 + idx % kUnits;
      if (j < hidden) prnn_copy4_to_shared(dst + idx, gi + ((size_t)t * batch + b) * gh_len + g * hidden + j);
    }
  };
  prefetch_gi(start);
  begin_steps(xr, r_s, start - 1, start > 0 ? y + (size_t)(start - 1) * batch * proj : h0, batch);

  int t = start, failed = 0;
  for (;;) {
    // W_hh r_{t-1} (gi_t is in shared memory); any timeout? Then gi_{t+1}: its buffer was last
    // read by step t-1's pointwise.
    if (projection_product(gates, xr, t - 1, r_s, gh_s, batch, R, kKsplit, failed, ctl, timeout_ns,
                           [&] { if (t + 1 < steps) prefetch_gi(t + 1); })) {
      --t;  // step t was not completed
      break;
    }
    prnn_maybe_stall(stall, t);
    const float* gi_t = gi_s + (t & 1) * batch * G * kUnits;
    // h_t stays fp32 (r_t is the state); hs holds it.
    forward_pointwise<false>(team, t, batch, hidden, j0, len_s, hp_s, c_s, hs, cs, saved,
                             staged_gates(gi_t, gh_s, bias_s, team, R),
                             [&](int b, int j, float h) { xh.publish(t, b, j, h); });
    failed = end_step(xh, h_s, t, ctl, timeout_ns);
    // W_hr h_t; any timeout?
    if (projection_product(projection, xh, t, h_s, pr_s, batch, V, kKsplitB, failed, ctl,
                           timeout_ns, [] {})) {
      --t;
      break;
    }
    for (int idx = threadIdx.x; idx < batch * V; idx += blockDim.x) {
      const int b = idx / V, q = q0 + idx % V;
      if (q >= proj) continue;
      // Past a length r is frozen; 16-bit layers: r_t is a 16-bit value.
      const float r = t < len_s[b] ? round_state(row_sum<kKsplitB>(pr_s, b, idx % V, V)) : rp_s[idx];
      xr.publish(t, b, q, r);
      y[((size_t)t * batch + b) * proj + q] = rp_s[idx] = r;
    }
    if (t + 1 == steps) break;
    failed = end_step(xr, r_s, t, ctl, timeout_ns);
    prnn_copy_wait();  // gi_{t+1}
    ++t;
  }
  prnn_leave_layer(control, t, steps, start);
  end_exchange();
}
