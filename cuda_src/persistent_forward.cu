// persistent_forward.cu - forward recurrence of one layer-direction with W_hh in registers.
//
// CTA c owns hidden units j0 = c*PRNN_UNITS .. j0+PRNN_UNITS-1 and all G gate rows of them, so
// the cell update is local. Per step t: wait for h_{t-1} (every unit, tagged words of the exchange
// buffer; at a launch's first step from y[t-1] or h0) in shared memory, multiply by the CTA's rows
// of W_hh, apply the cell, write y[t], cs[t], saved[t] for the owned units and publish h_t in the
// exchange: the publishing is the barrier (exchange.cuh, the tagged exchange). A step only reads step
// t-1's results and writes its own slots, so replaying it is idempotent; each CTA records the last
// step it completed when it exits and the host restarts from min(progress)+1.
//
// Per step, grid: two block barriers (staged h_{t-1} visible + timeout vote; partial sums
// visible; with warp teams, kWarpTeams, a warp barrier instead of the second), one L2 round trip
// per batch of quads a thread gathers (the gather: one at the large tiles' usual batch sizes), no
// fence and no atomic; gi_{t+1} is fetched during step t's product.
// Cluster (kDirectRead): each warp reads h_{t-1} straight from the tagged words in its CTA's
// shared memory, no gather; and each warp holds all gate rows of its own units (kWarpTeams): it
// finishes them itself (pointwise, publish, gi_{t+1}) after a warp barrier, so a step has no
// block barrier (persistent_common.cuh, Team and step_product).
#include "persistent_common.cuh"

PRNN_KERNEL void PRNN_CLUSTER_DIMS prnn_persistent_forward(
    const prnn::WeightSource* w_hh,  // (G*H, H), 16-bit: (G*H, ceil(H/2)) words of pairs
    const float* b_hh,      // (G*H,) zeros when the layer has no bias
    const float* gi,        // (T, B, G*H)  W_ih x_t + b_ih
    const float* h0, const float* c0,  // (B, H); c0 only read for LSTM
    const int* lengths,     // (B,) in 1..T
    float* y, float* cs, float* saved,  // (T, B, H), (T, B, H) LSTM only, (T, B, S*H)
    unsigned* exchange,     // [2][B][padded] tagged h_t by step parity, zeroed
                            // (a cluster keeps its own in shared memory instead)
    unsigned* control,      // PrnnControl, 2 + gridDim.x words
    int steps, int batch, int hidden, int start, unsigned long long timeout_ns,
    int stall_block, int stall_step, unsigned long long stall_ns) {
  using namespace prnn;
  constexpr int G = ThisCell::G, R = G * kUnits;
  constexpr bool kWarpTeam = kWarpTeams;
  constexpr int kStaged = kStagedBuffers;
  start = launch_start(control, start);
  if (start >= steps) return;  // a resume launch of a pass already complete: nothing to settle
  PrnnControl* ctl = started_launch(control);
  const PrnnStall stall{stall_block, stall_step, stall_ns};
  const int j0 = blockIdx.x * kUnits, gh_len = G * hidden;
  SharedCarver sh(batch);  // (plan.shared_layout)
  // [kStaged][batch or a group][kPadded]: h_{t-1} (by parity)
  float* h_s = staged_region(sh, PRNN_SMEM_STAGED);
  float* gh_s = sh.rows(PRNN_SMEM_PARTIAL);   // [batch][kKsplit][R]: partial W_hh h_{t-1}
  float* gi_s = sh.rows(PRNN_SMEM_GI);        // [kInputBuffers][batch][G][kUnits]: gi_t by step
  float* c_s = sh.rows(PRNN_SMEM_C);          // [batch][kUnits]: c_{t-1} of the owned units (LSTM)
  float* hp_s = sh.rows(PRNN_SMEM_H);         // [batch][kUnits]: h_{t-1} of the owned units
  // Constants of the pointwise step, kept in shared memory (no global reload on the step's path).
  float* bias_s = sh.fixed(PRNN_SMEM_BIAS);   // [G][kUnits]: b_hh of the owned rows
  int* len_s = sh.rows<int>(PRNN_SMEM_LENGTHS);  // [batch]: lengths
  // Every warp of a team has pointwise work: none sleeps before its gather.
  const int busy = kWarpTeam ? kThreads : batch * kUnits;
  const Exchange xch = begin_exchange(exchange, sh, batch, hidden, busy);
  // The staged copy of step s's vector (kStagedBuffers: 1 or 2, by step parity).
  const auto staged = [&](int s) { return h_s + (s & (kStaged - 1)) * batch * kPadded; };

  const Team team = step_team<G>();
  int rows[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int local = warp_row_group() * kRows + r, u = team.unit_of(local);
    rows[r] = j0 + u < hidden ? team.gate_of(local) * hidden + j0 + u : -1;
  }
  RegisterTile tile;
  tile.load(w_hh, rows, warp_chunk() * kChunk, hidden, threadIdx.x % kWarp);

  load_owned_rows(bias_s, b_hh, G, j0, hidden);
  for (int b = threadIdx.x; b < batch; b += blockDim.x) len_s[b] = lengths[b];
  load_unit_state(hp_s, c_s, y, cs, h0, c0, start, batch, hidden, j0);
  // Fetches gi_t of the team's rows into its buffer (read-only: asynchronous, may use L1),
  // kInputsAhead steps ahead.
  auto prefetch_gi = [&](int t) {
    float* dst = input_buffer<G * kUnits>(gi_s, t, batch);
#pragma unroll 1  // a warp team's stride is a constant: no unrolled copies (one trip at small B)
    for (int idx = team.thread; idx < batch * G * team.units; idx += team.size) {
      const int b = idx / (G * team.units), g = idx / team.units % G, u = team.unit0 + idx % team.units;
      if (j0 + u < hidden) {
        prnn_copy4_to_shared(dst + (b * G + g) * kUnits + u,
                             gi + ((size_t)t * batch + b) * gh_len + g * hidden + j0 + u);
      }
    }
    end_input_fetch();
  };
  for (int s = start; s < start + kInputsAhead && s < steps; ++s) prefetch_gi(s);
  if (kStaged == 2) {  // the other buffer's zero padding (gathers write the words below hidden)
    for (int idx = threadIdx.x; idx < batch * kPadded; idx += blockDim.x) staged(start)[idx] = 0.0f;
  }
  begin_steps(xch, staged(start - 1), start - 1,
              start > 0 ? y + (size_t)(start - 1) * batch * hidden : h0, batch);
  static_assert(!kDirectRead || kKsplit * R <= PRNN_SMEM_STAGED,
                "odd steps' partial sums fit h_s (plan.shared_layout)");

  // A cluster's warp team with no unit below `hidden` has nothing to compute: it reports every
  // step done (the other warps' steps decide the CTA's progress) rather than wait for words it
  // never uses. (On the grid every warp gathers and meets the block's barrier.)
  const bool idle = kDirectRead && kWarpTeam && j0 + team.unit0 >= hidden;
  int t = idle ? steps - 1 : start, failed = 0;
  while (!idle) {
    float* part_s = step_partials(t, gh_s, h_s);
    // With batch groups, a launch's first step stages its further groups from h_{t-1}.
    const float* first = !(kBatchGroup > 0 && t == start) ? nullptr
                         : t > 0 ? y + (size_t)(t - 1) * batch * hidden : h0;
    // h_{t-1} (and gi_t: this thread's copies waited for) -> partial sums; any timeout?
    // gi_{t+kInputsAhead}'s buffer was last read by step t-1's pointwise.
    if (step_product<kWarpTeam>(tile, xch, t - 1, staged(t - 1), part_s, batch, R, failed, ctl,
                                timeout_ns, [&] {
                                  if (t + kInputsAhead < steps) prefetch_gi(t + kInputsAhead);
                                  else end_input_fetch();
                                }, first)) {
      --t;  // step t was not completed
      break;
    }
    prnn_maybe_stall(stall, t);
    const float* gi_t = input_buffer<G * kUnits>(gi_s, t, batch);
    forward_pointwise<true>(team, t, batch, hidden, j0, len_s, hp_s, c_s, y, cs, saved,
                            staged_gates(gi_t, part_s, bias_s, team, R),
                            [&](int b, int j, float h) { xch.publish(t, b, j, h); });
    if (t + 1 == steps) break;
    failed = end_step(xch, staged(t), t, ctl, timeout_ns);
    wait_next_inputs();  // gi_{t+1}
    ++t;
  }
  t = cta_last_step<kWarpTeam>(t, reinterpret_cast<int*>(gh_s));
  prnn_leave_layer(control, t, steps, start);
  end_exchange();
}
