// stack_backward.cu - backward through time of a whole unidirectional stack in one launch.
//
// Layer l's CTAs (stack_common.cuh) own units J of h_l and hold rows J of
// [W_hh,l^T | W_ih,l+1^T] (the top layer: [W_hh^T | 0]). Going down from T-1, per step t a CTA
// waits for dgh_l[t+1] (its own layer's exchange; nothing at T-1) and, below the top layer, for
// dgi_{l+1}[t] (the layer above's exchange: the gradient reaching y_l[t] through layer l+1's
// input projection, W_ih,l+1^T dgi_{l+1}[t], is the second half of the same matrix product),
// adds the top layer's dy_t and the direct carries, and applies the cell's backward exactly as
// persistent_backward.cu does. The wavefront runs in reverse: layer l works on step t while the
// layer above works on t-1. LSTM and RNN publish dgh only (dgi is the same); GRU publishes dgi
// too, into a second exchange of the same shape.
//
// The direct carries (dh: the part of the gradient reaching h_{t-1} that bypasses W_hh; dc for
// the LSTM) are written to global memory at every step, [layers][T+1][B][H] (slot t+1 holds what
// step t+1 carried down; slot T the host's dh_n/dc_n), so that a restart from step s of a layer
// finds step s+1's carries whatever the others did; like every other word they are rewritten
// only with the same bits.
#include "backward_pointwise.cuh"
#include "stack_common.cuh"

PRNN_KERNEL void prnn_stack_backward(
    const prnn::WeightWord* w_t,     // (layers, H, G*H): W_hh^T of every layer; 16-bit:
                                     // (layers, H, ceil(G*H/2)) words of pairs
    const prnn::WeightWord* w_ih_t,  // (layers-1, H, G*H): W_ih^T of layers 1.. (row l-1 serves
                                     // layer l-1); 16-bit: words as w_t
    const float* dy,        // (T, B, H): gradient of the top layer's output, zero past each length;
                            // unchained: (groups, T, B, H), every group's own
    const float* y, const float* cs, const float* saved,  // forward buffers, (layers, T, B, .)
    const float* h0, const float* c0,  // (layers, B, H)
    const int* lengths,     // (B,) in 1..T
    int chained,            // 1: a stack; 0: the two directions of one layer side by side
    const int* starts,      // (layers,): each layer's first step in this launch (-1: none left)
    float* dgi, float* dgh,  // (layers, T, B, G*H); the same array unless GRU
    float* dh_carry, float* dc_carry,  // (layers, T+1, B, H); dc_carry: LSTM only
    unsigned* exchange_gh,  // (layers, T, B, padded / 2) tagged dgh_t
    unsigned* exchange_gi,  // the same for dgi_t (GRU; otherwise exchange_gh itself)
    unsigned* control,      // PrnnControl, 2 + gridDim.x words
    int steps, int batch, int hidden, unsigned long long timeout_ns,
    int stall_block, int stall_step, unsigned long long stall_ns) {
  using namespace prnn;
  constexpr int G = ThisCell::G, S = ThisCell::S;
  PrnnControl* ctl = reinterpret_cast<PrnnControl*>(control);
  // The CTAs that started first take the layers that wait for no other (stack_common.cuh).
  const int order = prnn_start_order(ctl, prnn_shared_memory<unsigned>());
  const PrnnStall stall{stall_block, stall_step, stall_ns};
  const int per_layer = stack_ctas_per_layer(hidden), layers = gridDim.x / per_layer;
  const int layer = layers - 1 - order / per_layer, cta = stack_cta(layer, order, per_layer);
  const int j0 = (order % per_layer) * kUnits;
  const int gh_len = G * hidden, start = starts[layer];
  const bool top = !chained || layer + 1 == layers;  // dy given, nothing from above
  const float* dy_l = dy + (chained ? 0 : layer) * (size_t)steps * batch * hidden;
  const size_t plane = (size_t)batch * hidden, rows_l = (size_t)steps * batch;
  const float* y_l = y + layer * rows_l * hidden;
  const float* cs_l = cs + layer * rows_l * hidden;
  const float* saved_l = saved + layer * rows_l * S * hidden;
  const float* h0_l = h0 + layer * plane;
  const float* c0_l = c0 + layer * plane;
  float* dgi_l = dgi + layer * rows_l * gh_len;
  float* dgh_l = dgh + layer * rows_l * gh_len;
  float* dh_carry_l = dh_carry + (size_t)layer * (steps + 1) * plane;
  float* dc_carry_l = dc_carry + (size_t)layer * (steps + 1) * plane;

  SharedCarver sh(batch);  // (plan.shared_layout)
  float* v_s = sh.rows(PRNN_SMEM_STAGED);     // [batch][kPadded]: [dgh_l[t+1] | dgi_{l+1}[t]]
  float* rec_s = sh.rows(PRNN_SMEM_PARTIAL);  // [batch][kKsplit][kUnits]: partial sums
  float* in_s = sh.rows(PRNN_SMEM_INPUTS);    // [2][batch][kInputs][kUnits]: inputs by parity
  float* carry_s = sh.rows(PRNN_SMEM_CARRIES);  // [2][batch][kUnits]: dh, dc carries
  int* len_s = sh.rows<int>(PRNN_SMEM_LENGTHS);  // [batch]: lengths
  const StackExchange xgh = begin_stack_exchange(exchange_gh, steps, batch, gh_len);
  const StackExchange xgi = xgh.with_words(exchange_gi);
  if (start < 0) {  // this layer finished in an earlier launch
    prnn_leave(control, layers, cta, 0, -1, 0, starts);
    return;
  }

  // Chunks of the first half multiply dgh_l[t+1] by W_hh^T, the rest dgi_{l+1}[t] by W_ih,l+1^T.
  const bool own_half = warp_chunk() < kHalfChunks;
  int rows[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int j = j0 + warp_row_group() * kRows + r;
    rows[r] = j < hidden && (own_half || !top) ? j : -1;
  }
  const int row_words = (gh_len + kPerWord - 1) / kPerWord;  // (16-bit: pairs, rows padded)
  const WeightWord* m = own_half ? w_t + (size_t)layer * hidden * row_words
                                 : w_ih_t + (size_t)(top ? 0 : layer) * hidden * row_words;
  RegisterTile tile;
  tile.load(m, rows, warp_chunk() % kHalfChunks * kChunk, gh_len, threadIdx.x % kWarp);

  // The pointwise thread of (b, unit) is the same every step: it keeps that unit's carries.
  for (int idx = threadIdx.x; idx < batch * kUnits; idx += blockDim.x) {
    const int b = idx / kUnits, j = j0 + idx % kUnits;
    if (j >= hidden) continue;
    const size_t at = (start + 1) * plane + (size_t)b * hidden + j;
    carry_s[idx] = dh_carry_l[at];
    if (kHasC) carry_s[batch * kUnits + idx] = dc_carry_l[at];
  }
  for (int b = threadIdx.x; b < batch; b += blockDim.x) len_s[b] = lengths[b];
  clear_staged(v_s, batch);

  // Fetches step t's read-only inputs into its parity's buffer (asynchronous, may use L1).
  auto prefetch_inputs = [&](int t) {
    prefetch_backward_inputs(in_s, t, batch, hidden, j0, plane, top, dy_l, y_l, h0_l,
                             cs_l, c0_l, saved_l);
  };
  // Stages step t's vector: dgh_l[t+1] into the first half (zero at T-1), dgi_{l+1}[t] into
  // the second (zero in the top layer).
  auto gather = [&](int t) -> bool {
    if (t + 1 < steps && !xgh.gather(layer, t + 1, ctl, timeout_ns, [v_s](int b, int k, const float (&v)[4]) {
          prnn_store_shared_quad(v_s + b * kPadded + k, v);
        })) {
      return false;
    }
    return top || xgi.gather(layer + 1, t, ctl, timeout_ns, [v_s](int b, int k, const float (&v)[4]) {
             prnn_store_shared_quad(v_s + b * kPadded + kHalf + k, v);
           });
  };

  prefetch_inputs(start);
  int t = start, failed = !gather(start);
  prnn_copy_wait();
  for (;;) {
    // step t's vector and inputs are in shared memory; any timeout?
    if (prnn_sync_block_or(failed)) {
      ++t;  // step t was not completed
      break;
    }
    if (t > 0) prefetch_inputs(t - 1);  // its buffer was last read by step t+1's pointwise
    multiply_batch(tile, v_s, rec_s, batch, kUnits);  // ends with a block barrier
    prnn_maybe_stall(stall, t, cta);
    const float* in_t = in_s + (t & 1) * batch * kInputs * kUnits;
    backward_pointwise(in_t, gh_len, rec_s, carry_s, len_s, t, batch, hidden, j0, top, true,
                       dgi_l, dgh_l, dh_carry_l, dc_carry_l, plane, t,
                       [&](int b, int k, float dgi_k, float dgh_k) {
                         xgh.publish(layer, t, b, k, dgh_k);
                         if (exchange_gi != exchange_gh) xgi.publish(layer, t, b, k, dgi_k);
                       });
    if (t == 0) break;
    failed = !gather(t - 1);
    prnn_copy_wait();  // step t-1's inputs
    --t;
  }
  prnn_leave(control, layers, cta, t, -1, 0, starts);
}
