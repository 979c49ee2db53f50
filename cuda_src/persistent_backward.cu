// persistent_backward.cu - backward through time of one layer-direction with W_hh^T in registers.
//
// CTA c owns hidden units J = j0 .. j0+PRNN_UNITS-1 and holds the columns W_hh[:, J] (rows J of
// W_hh^T, K = G*H). Going down from step `start`, per step t: wait for dgh_{t+1} (all G*H rows,
// tagged words of the exchange buffer published by every CTA at step t+1; at a launch's first
// step from dgh[t+1]) in shared memory, compute the recurrent part
// dh_rec[J] = sum_k W_hh[k, J] dgh_{t+1}[k], add dy_t and the direct part carried from step t+1,
// apply the cell's backward, write dgi_t/dgh_t for the owned units' gate rows and the direct
// carries to step t-1, and publish dgh_t in the exchange (the publishing is the barrier).
//
// The carries (direct part of the gradient reaching h_{t-1}; the gradient reaching c_{t-1}) are
// double-buffered in global memory by step parity, [2][B][H]. A CTA publishes step t only after
// it has read every CTA's step t+1, so no CTA is more than one step ahead of another: when the
// slowest CTA last completed step m, none has completed m-2, so the carries of step m (parity m%2)
// are intact and a restart from max(progress)-1 finds them; a replayed step is idempotent.
// The host seeds parity T%2 with dh_n / dc_n.
#include "backward_pointwise.cuh"

PRNN_KERNEL void PRNN_CLUSTER_DIMS prnn_persistent_backward(
    const prnn::WeightWord* w_t,  // (H, G*H) = W_hh^T, contiguous; 16-bit: words of pairs
    const float* dy,        // (T, B, H), zero past each length
    const float* y, const float* cs, const float* saved,  // forward buffers (cs: LSTM only)
    const float* h0, const float* c0,  // (B, H)
    const int* lengths,     // (B,) in 1..T
    float* dgi, float* dgh, // (T, B, G*H); the same array unless GRU
    float* dh_carry, float* dc_carry,  // [2][B][H] by step parity (dc_carry: LSTM only)
    unsigned* exchange,     // [2][B][padded] tagged dgh_t by parity, zeroed
                            // (a cluster keeps its own in shared memory instead)
    unsigned* control,      // PrnnControl, 2 + gridDim.x words
    int steps, int batch, int hidden, int start, unsigned long long timeout_ns,
    int stall_block, int stall_step, unsigned long long stall_ns) {
  using namespace prnn;
  constexpr int G = ThisCell::G;
  PrnnControl* ctl = started_launch(control);
  const PrnnStall stall{stall_block, stall_step, stall_ns};
  const int j0 = blockIdx.x * kUnits, gh_len = G * hidden;
  const size_t plane = (size_t)batch * hidden;
  SharedCarver sh(batch);  // (plan.shared_layout)
  float* v_s = staged_region(sh, PRNN_SMEM_STAGED);  // [batch or a group][kPadded]: dgh_{t+1}
  float* rec_s = sh.rows(PRNN_SMEM_PARTIAL);  // [batch][kKsplit][kUnits]: partial W_hh^T dgh
  float* in_s = sh.rows(PRNN_SMEM_INPUTS);    // [kInputBuffers][batch][kInputs][kUnits]: by step
  float* carry_s = sh.rows(PRNN_SMEM_CARRIES);  // [2][batch][kUnits]: dh (direct), dc carries
  int* len_s = sh.rows<int>(PRNN_SMEM_LENGTHS);  // [batch]: lengths
  const Exchange xch = begin_exchange(exchange, sh, batch, gh_len);

  int rows[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int j = j0 + warp_row_group() * kRows + r;
    rows[r] = j < hidden ? j : -1;
  }
  RegisterTile tile;
  tile.load(w_t, rows, warp_chunk() * kChunk, gh_len, threadIdx.x % kWarp);
  // The start only after the weight load: read at entry, it and the early exit cost the largest
  // 16-bit tiles on sm_80 a register (224-240 spill bytes). So a resume launch of a finished
  // backward loads its weights before it exits.
  start = launch_start(control, start);
  if (start < 0) return;  // a resume launch of a pass already complete: nothing to settle

  // The pointwise thread of (b, unit) is the same every step: it keeps that unit's carries.
  for (int idx = threadIdx.x; idx < batch * kUnits; idx += blockDim.x) {
    const int b = idx / kUnits, j = j0 + idx % kUnits;
    if (j >= hidden) continue;
    const size_t at = ((start + 1) & 1) * plane + (size_t)b * hidden + j;
    carry_s[idx] = dh_carry[at];
    if (kHasC) carry_s[batch * kUnits + idx] = dc_carry[at];
  }
  for (int b = threadIdx.x; b < batch; b += blockDim.x) len_s[b] = lengths[b];

  // Fetches step t's read-only inputs into its buffer (asynchronous, may use L1), kInputsAhead
  // steps ahead.
  auto prefetch_inputs = [&](int t) {
    prefetch_backward_inputs(in_s, t, batch, hidden, j0, plane, true, dy, y, h0, cs, c0, saved);
    end_input_fetch();
  };
  for (int s = start; s > start - kInputsAhead && s >= 0; --s) prefetch_inputs(s);
  // Step T-1 has no recurrent input.
  begin_steps(xch, v_s, start + 1,
              start + 1 < steps ? dgh + (size_t)(start + 1) * batch * gh_len : nullptr, batch);
  static_assert(!kDirectRead || kKsplit * kUnits <= PRNN_SMEM_STAGED,
                "odd steps' partial sums fit v_s (plan.shared_layout)");

  int t = start, failed = 0;
  for (;;) {
    const bool recurrent = t + 1 < steps;  // false only at a launch's first step, t = T-1
    float* part_s = step_partials(t, rec_s, v_s);
    // With batch groups, a launch's first step stages its further groups from dgh_{t+1} (at
    // t = T-1 there is no product: batch 0).
    const float* first = kBatchGroup > 0 && t == start ? dgh + (size_t)(t + 1) * batch * gh_len
                                                       : nullptr;
    // dgh_{t+1} (and step t's inputs) -> partial sums; any timeout? The inputs of step
    // t-kInputsAhead go into the buffer last read by step t+1's pointwise.
    if (step_product(tile, xch, t + 1, v_s, part_s, recurrent ? batch : 0, kUnits, failed, ctl,
                     timeout_ns, [&] {
                       if (t - kInputsAhead >= 0) prefetch_inputs(t - kInputsAhead);
                       else end_input_fetch();
                     }, first)) {
      ++t;  // step t was not completed
      break;
    }
    prnn_maybe_stall(stall, t);
    const float* in_t = input_buffer<kInputs * kUnits>(in_s, t, batch);
    backward_pointwise(in_t, gh_len, part_s, carry_s, len_s, t, batch, hidden, j0, true, recurrent,
                       dgi, dgh, dh_carry, dc_carry, plane, t & 1,
                       [&](int b, int k, float, float dgh_k) { xch.publish(t, b, k, dgh_k); });
    if (t == 0) break;
    failed = end_step(xch, v_s, t, ctl, timeout_ns);
    wait_next_inputs();  // step t-1's
    --t;
  }
  prnn_leave_layer(control, t, -1, start);
  end_exchange();
}
