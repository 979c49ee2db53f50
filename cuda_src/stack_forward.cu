// stack_forward.cu - forward recurrence of a whole unidirectional stack in one launch.
//
// Layer l's CTAs (stack_common.cuh) own units j0 .. j0+PRNN_UNITS-1 of h_l and hold the rows
// g*H + j of [W_ih,l | W_hh,l] in registers (layer 0: [0 | W_hh,0]). Per step t a CTA waits for
// h_l[t-1] (its own layer's exchange; h0 at t = 0) and, above the first layer, for y_{l-1}[t]
// (the layer below's exchange; zero past a sequence's length, as the layer-by-layer path feeds
// its masked output), multiplies, keeps the two halves' sums apart (gi = W_ih y + b_ih,
// gh = W_hh h + b_hh: GRU's n gate needs them apart) and applies the cell exactly as
// persistent_forward.cu does. Layer 0 takes gi from the GEMM before the launch (prefetched a step
// ahead). Layers form a wavefront: layer l+1 runs step t while layer l runs t+1.
//
// Restart: each CTA records the last step it completed; the host resumes every layer from the
// first step some CTA of it has not completed (`starts`, per layer; T for a finished layer) in
// the same exchange buffer (never zeroed between launches, see stack_common.cuh), so a resumed
// step reads exactly the words its first run read.
#include "stack_common.cuh"

PRNN_KERNEL void prnn_stack_forward(
    const prnn::WeightSource* w_ih,  // (layers-1, G*H, H): W_ih of layers 1.. (layer 0's
                                     // projection is gi); 16-bit (or an fp32 tile widened
                                     // from them): (layers-1, G*H, ceil(H/2)) words of pairs
    const prnn::WeightSource* w_hh,  // (layers, G*H, H); 16-bit: words as w_ih
    const float* b_ih,      // (layers, G*H); layer 0's row unused (gi holds it); zeros without bias
    const float* b_hh,      // (layers, G*H)
    const float* gi,        // (T, B, G*H): layer 0's W_ih x_t + b_ih; unchained (groups, T, B, G*H)
    const float* h0, const float* c0,  // (layers, B, H); c0 only read for LSTM
    const int* lengths,     // (B,) in 1..T
    int chained,            // 1: a stack (group l reads group l-1's output); 0: the two directions
                            // of one layer side by side, each group reading its own gi
    const int* starts,      // (layers,): each layer's first step in this launch (T: none left)
    float* y, float* cs, float* saved,  // (layers, T, B, H), (layers, T, B, H) LSTM only, (layers, T, B, S*H)
    unsigned* exchange,  // (layers, T, B, padded / 2) tagged h_t, zeroed once per pass
    unsigned* control,      // PrnnControl, 2 + gridDim.x words
    int steps, int batch, int hidden, unsigned long long timeout_ns,
    int stall_block, int stall_step, unsigned long long stall_ns) {
  using namespace prnn;
  constexpr int G = ThisCell::G, S = ThisCell::S, R = G * kUnits;
  PrnnControl* ctl = reinterpret_cast<PrnnControl*>(control);
  // The CTAs that started first take the layers that wait for no other (stack_common.cuh).
  const int order = prnn_start_order(ctl, prnn_shared_memory<unsigned>());
  const PrnnStall stall{stall_block, stall_step, stall_ns};
  const int per_layer = stack_ctas_per_layer(hidden), layers = gridDim.x / per_layer;
  const int layer = order / per_layer, cta = stack_cta(layer, order, per_layer);
  const int j0 = (order % per_layer) * kUnits;
  const int gh_len = G * hidden, start = starts[layer];
  const bool own_gi = layer == 0 || !chained;  // the input projection was the GEMM before
  const size_t rows_l = (size_t)steps * batch;  // (T, B) rows of one layer's arrays
  const float* gi_l = gi + (chained ? 0 : layer) * rows_l * G * hidden;
  float* y_l = y + layer * rows_l * hidden;
  float* cs_l = cs + layer * rows_l * hidden;
  float* saved_l = saved + layer * rows_l * S * hidden;
  const float* h0_l = h0 + (size_t)layer * batch * hidden;
  const float* c0_l = c0 + (size_t)layer * batch * hidden;

  SharedCarver sh(batch);  // (plan.shared_layout)
  float* v_s = sh.rows(PRNN_SMEM_STAGED);    // [batch][kPadded]: [y_{l-1}[t] | h_l[t-1]], halves
  float* part_s = sh.rows(PRNN_SMEM_PARTIAL);  // [batch][kKsplit][R]: partial sums
  float* gi_s = sh.rows(PRNN_SMEM_GI);       // [2][batch][G][kUnits]: gi_t by parity (own_gi)
  float* c_s = sh.rows(PRNN_SMEM_C);         // [batch][kUnits]: c_{t-1} of the owned units (LSTM)
  float* hp_s = sh.rows(PRNN_SMEM_H);        // [batch][kUnits]: h_{t-1} of the owned units
  float* bias_s = sh.fixed(PRNN_SMEM_BIAS);  // [2][G][kUnits]: b_ih, b_hh of the owned rows
  int* len_s = sh.rows<int>(PRNN_SMEM_LENGTHS);  // [batch]: lengths
  const StackExchange xch = begin_stack_exchange(exchange, steps, batch, hidden);
  if (start >= steps) {  // this layer finished in an earlier launch
    prnn_leave(control, layers, cta, steps - 1, steps, 0, starts);
    return;
  }

  // Chunks of the first half multiply y_{l-1}[t] by W_ih (none where gi is given), the rest h
  // by W_hh.
  const bool input_half = warp_chunk() < kHalfChunks;
  int rows[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int local = warp_row_group() * kRows + r, g = local / kUnits, u = local % kUnits;
    rows[r] = j0 + u < hidden && !(input_half && own_gi) ? g * hidden + j0 + u : -1;
  }
  // (16-bit words: pairs, rows padded)
  const int row_words = (hidden + kSourcePerWord - 1) / kSourcePerWord;
  const WeightSource* m = input_half ? w_ih + (size_t)(layer > 0 ? layer - 1 : 0) * gh_len * row_words
                                     : w_hh + (size_t)layer * gh_len * row_words;
  RegisterTile tile;
  tile.load(m, rows, warp_chunk() % kHalfChunks * kChunk, hidden, threadIdx.x % kWarp);

  load_owned_rows(bias_s, b_ih + (size_t)layer * gh_len, G, j0, hidden);
  load_owned_rows(bias_s + G * kUnits, b_hh + (size_t)layer * gh_len, G, j0, hidden);
  for (int b = threadIdx.x; b < batch; b += blockDim.x) len_s[b] = lengths[b];
  load_unit_state(hp_s, c_s, y_l, cs_l, h0_l, c0_l, start, batch, hidden, j0);
  clear_staged(v_s, batch);  // also publishes len_s to the block

  // Fetches gi_t (own_gi) of the owned rows into its parity's buffer (read-only: asynchronous).
  auto prefetch_gi = [&](int t) {
    float* dst = gi_s + (t & 1) * batch * G * kUnits;
    for (int idx = threadIdx.x; idx < batch * G * kUnits; idx += blockDim.x) {
      const int b = idx / (G * kUnits), g = idx / kUnits % G, j = j0 + idx % kUnits;
      if (j < hidden) prnn_copy4_to_shared(dst + idx, gi_l + ((size_t)t * batch + b) * gh_len + g * hidden + j);
    }
  };
  // Stages step t's vector: h_l[t-1] into the second half, y_{l-1}[t] into the first.
  auto gather = [&](int t) -> bool {
    if (t == 0) {
      for (int idx = threadIdx.x; idx < batch * hidden; idx += blockDim.x) {
        v_s[idx / hidden * kPadded + kHalf + idx % hidden] = prnn_exchange_value(h0_l[idx]);
      }
    } else if (!xch.gather(layer, t - 1, ctl, timeout_ns, [v_s](int b, int k, const float (&v)[4]) {
                 prnn_store_shared_quad(v_s + b * kPadded + kHalf + k, v);
               })) {
      return false;
    }
    return own_gi || xch.gather(layer - 1, t, ctl, timeout_ns,
                                [v_s, len_s, t](int b, int k, const float (&v)[4]) {
                                  const bool live = t < len_s[b];
                                  const float w[4] = {live ? v[0] : 0.0f, live ? v[1] : 0.0f,
                                                      live ? v[2] : 0.0f, live ? v[3] : 0.0f};
                                  prnn_store_shared_quad(v_s + b * kPadded + k, w);
                                });
  };

  if (own_gi) prefetch_gi(start);
  int t = start, failed = !gather(start);
  prnn_copy_wait();
  for (;;) {
    // step t's vector (and gi_t where own_gi) are in shared memory; any timeout?
    if (prnn_sync_block_or(failed)) {
      --t;  // step t was not completed
      break;
    }
    if (own_gi && t + 1 < steps) prefetch_gi(t + 1);  // its buffer was last read at step t-1
    multiply_batch(tile, v_s, part_s, batch, R);  // ends with a block barrier
    prnn_maybe_stall(stall, t, cta);
    const float* gi_t = gi_s + (t & 1) * batch * G * kUnits;
    // gi = W_ih y_{l-1}[t] + b_ih (the first half's sums) unless given, gh = W_hh h + b_hh.
    const auto gates = [&](int b, int u, float (&giv)[G], float (&ghv)[G]) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int r = g * kUnits + u;
        giv[g] = own_gi ? gi_t[(b * G + g) * kUnits + u]
                        : row_sum<kKsplit, 0, kHalfChunks>(part_s, b, r, R) + bias_s[r];
        ghv[g] = row_sum<kKsplit, kHalfChunks, kKsplit>(part_s, b, r, R) + bias_s[G * kUnits + r];
      }
    };
    forward_pointwise<true>(step_team<G>(), t, batch, hidden, j0, len_s, hp_s, c_s, y_l, cs_l, saved_l,
                            gates, [&](int b, int j, float h) { xch.publish(layer, t, b, j, h); });
    if (t + 1 == steps) break;
    failed = !gather(t + 1);
    prnn_copy_wait();  // gi_{t+1} (own_gi)
    ++t;
  }
  prnn_leave(control, layers, cta, t, steps, 0, starts);
}
