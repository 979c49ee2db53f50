// persistent_backward.cu - backward through time of one layer-direction with W_hh^T in registers.
//
// CTA c owns hidden units J = j0 .. j0+PRNN_UNITS-1 and holds the columns W_hh[:, J] (rows J of
// W_hh^T, K = G*H). Going down from step `start`, per step t: stage dgh_{t+1} (all G*H rows, the
// exchange buffer written by every CTA at step t+1) in shared memory, compute the recurrent part
// dh_rec[J] = sum_k W_hh[k, J] dgh_{t+1}[k], add dy_t and the direct part carried from step t+1,
// apply the cell's backward, write dgi_t/dgh_t for the owned units' gate rows and the direct
// carries to step t-1, then meet at the timed grid barrier.
//
// The carries (direct part of the gradient reaching h_{t-1}; the gradient reaching c_{t-1}) are
// double-buffered in global memory by step parity, [2][B][H]: a CTA is never more than one step
// ahead of another, so a relaunch from max(progress)-1 finds the carries of step max(progress)
// intact, and a replayed step is idempotent. The host seeds parity T%2 with dh_n / dc_n.
#include "persistent_common.cuh"

PRNN_KERNEL void prnn_persistent_backward(
    const float* w_t,       // (H, G*H) = W_hh^T, contiguous
    const float* dy,        // (T, B, H), zero past each length
    const float* y, const float* cs, const float* saved,  // forward buffers (cs: LSTM only)
    const float* h0, const float* c0,  // (B, H)
    const int* lengths,     // (B,) in 1..T
    float* dgi, float* dgh, // (T, B, G*H); the same array unless GRU
    float* dh_carry, float* dc_carry,  // [2][B][H] by step parity (dc_carry: LSTM only)
    unsigned* control,      // PrnnControl, 2 + gridDim.x words
    int steps, int batch, int hidden, int start, unsigned long long timeout_ns,
    int stall_block, int stall_step, unsigned long long stall_ns) {
  using namespace prnn;
  constexpr int G = ThisCell::G, S = ThisCell::S;
  PrnnControl* ctl = reinterpret_cast<PrnnControl*>(control);
  const PrnnStall stall{stall_block, stall_step, stall_ns};
  const int j0 = blockIdx.x * kUnits, gh_len = G * hidden;
  const size_t plane = (size_t)batch * hidden;
  float* v_s = prnn_shared_memory<float>();  // [batch][kPadded]: dgh_{t+1}
  float* rec_s = v_s + batch * kPadded;       // [batch][kKsplit][kUnits]: partial W_hh^T dgh

  int rows[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int j = j0 + warp_row_group() * kRows + r;
    rows[r] = j < hidden ? j : -1;
  }
  RegisterTile tile;
  tile.load(w_t, rows, warp_chunk() * kChunk, gh_len, threadIdx.x % kWarp);

  for (int t = start; t >= 0; --t) {
    const bool recurrent = t + 1 < steps;
    if (recurrent) {
      stage_exchanged(v_s, dgh + (size_t)(t + 1) * batch * gh_len, batch, gh_len);
      multiply_batch(tile, v_s, rec_s, batch, kUnits);
    }
    const float* dh_in = dh_carry + ((t + 1) & 1) * plane;
    const float* dc_in = dc_carry + ((t + 1) & 1) * plane;
    for (int idx = threadIdx.x; idx < batch * kUnits; idx += blockDim.x) {
      const int b = idx / kUnits, u = idx % kUnits, j = j0 + u;
      if (j >= hidden) continue;
      const size_t row = (size_t)t * batch + b, at = (size_t)b * hidden + j;
      float sv[kSavedSlots], dgiv[G], dghv[G];
#pragma unroll
      for (int s = 0; s < S; ++s) sv[s] = saved[row * S * hidden + s * hidden + j];
      const float dh = dy[row * hidden + j] + dh_in[at] + (recurrent ? row_sum(rec_s, b, u, kUnits) : 0.0f);
      const float h_prev = t > 0 ? y[(row - batch) * hidden + j] : h0[at];
      float dc = 0.0f, c = 0.0f, c_prev = 0.0f;
      if (kHasC) {
        dc = dc_in[at];
        c = cs[row * hidden + j];
        c_prev = t > 0 ? cs[(row - batch) * hidden + j] : c0[at];
      }
      float dh_prev, dc_prev;
      cell_backward_masked<PRNN_CELL>(t < lengths[b], dh, dc, sv, y[row * hidden + j], c, h_prev, c_prev,
                                      dgiv, dghv, dh_prev, dc_prev);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        dgi[row * gh_len + g * hidden + j] = dgiv[g];
        dgh[row * gh_len + g * hidden + j] = dghv[g];
      }
      dh_carry[(t & 1) * plane + at] = dh_prev;
      if (kHasC) dc_carry[(t & 1) * plane + at] = dc_prev;
    }
    prnn_maybe_stall(stall, t);
    if (!prnn_grid_barrier(ctl, t, (unsigned)(start - t + 1), timeout_ns)) return;
  }
}
