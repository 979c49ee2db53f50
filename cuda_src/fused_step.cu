// fused_step.cu - one step of a cell in one launch: both matrix products and the pointwise math.
//
// For a decoder that advances one step per call (torch.nn's RNNCell/GRUCell/LSTMCell), a step is
// otherwise three kernels (two GEMMs and the pointwise update). Here one warp computes hidden
// unit j for a tile of up to BATCH_TILE batch rows: its lanes stride over k, so that every load
// of a weight row W_ih[g*H + j, :] and W_hh[g*H + j, :] is coalesced and serves every row of the
// tile (the weights come from L2/HBM: nothing is kept between calls), accumulate in fp32, and
// reduce with a shuffle butterfly; lane 0 then adds the biases and runs the cell
// (prnn::Cell<CELL>::forward from cells.cuh, the code every other path runs) and writes h, c and
// the saved activations. The summation order is fixed, so results are bitwise reproducible.
// Nothing is allocated and nothing is read back: the launch can be captured in a CUDA graph.
//
// Layouts (row-major, contiguous): x (B, I), h_prev and h (B, H), c_prev and c (B, H; has_c only),
// w_ih (G*H, I), w_hh (G*H, H), b_ih and b_hh (G*H; read only when has_bias != 0), saved
// (B, S*H) with activation s of unit j at column s*H + j (persistent_rnn/cells.py's layout).
// Pointers a cell does not use may be any valid buffer. Launch: blockDim.x a multiple of 32,
// at least ceil(B / BATCH_TILE) * H warps in all (extra warps return at once). One cell per
// build: -D PRNN_CELL (its prnn::CellKind) and -D PRNN_BATCH_TILE (cell_step.BATCH_TILE, which
// sizes the grid).
#include "cells.cuh"

namespace prnn {

constexpr int BATCH_TILE = PRNN_BATCH_TILE;  // batch rows per warp: a weight load serves each

// Lane 0 gets out[r] = sum_k w[k] * v[r*n + k] for the tile's rows r < rows (fp32, fixed order;
// rows past the batch stay 0); the other lanes partial sums.
PRNN_DEVICE void warp_dots(const float* w, const float* v, int n, int rows, int lane,
                           float (&out)[BATCH_TILE]) {
#pragma unroll
  for (int r = 0; r < BATCH_TILE; ++r) out[r] = 0.0f;
  for (int k = lane; k < n; k += 32) {
    const float wk = w[k];
#pragma unroll
    for (int r = 0; r < BATCH_TILE; ++r) {
      if (r < rows) out[r] += wk * v[(size_t)r * n + k];
    }
  }
#pragma unroll
  for (int r = 0; r < BATCH_TILE; ++r) {
    for (int mask = 16; mask > 0; mask >>= 1) out[r] += prnn_shfl_xor(out[r], mask);
  }
}

template <int CELL>
PRNN_DEVICE void fused_step(int batch, int input, int hidden, const float* x, const float* h_prev,
                            const float* c_prev, const float* w_ih, const float* w_hh,
                            const float* b_ih, const float* b_hh, int has_bias, float* h, float* c,
                            float* saved) {
  constexpr int G = Cell<CELL>::G;
  constexpr int S = Cell<CELL>::S;
  const size_t thread = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t warp = thread / 32;  // one warp per (batch tile, j): the whole warp leaves together
  const int lane = (int)(thread % 32);
  const size_t tiles = ((size_t)batch + BATCH_TILE - 1) / BATCH_TILE;
  if (warp >= tiles * hidden) return;
  const size_t j = warp % hidden, b0 = warp / hidden * BATCH_TILE;
  const int rows = batch - b0 < BATCH_TILE ? (int)(batch - b0) : BATCH_TILE;
  float gi[G][BATCH_TILE], gh[G][BATCH_TILE];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const size_t row = (size_t)g * hidden + j;
    warp_dots(w_ih + row * input, x + b0 * input, input, rows, lane, gi[g]);
    warp_dots(w_hh + row * hidden, h_prev + b0 * hidden, hidden, rows, lane, gh[g]);
  }
  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < BATCH_TILE; ++r) {
    if (r >= rows) break;
    const size_t b = b0 + r, unit = b * hidden + j;
    float gi_u[G], gh_u[G], saved_u[S > 0 ? S : 1];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      gi_u[g] = gi[g][r] + (has_bias ? b_ih[(size_t)g * hidden + j] : 0.0f);
      gh_u[g] = gh[g][r] + (has_bias ? b_hh[(size_t)g * hidden + j] : 0.0f);
    }
    float hv, cv;
    Cell<CELL>::forward(gi_u, gh_u, h_prev[unit], Cell<CELL>::has_c ? c_prev[unit] : 0.0f, hv, cv,
                        saved_u);
    h[unit] = hv;
    if (Cell<CELL>::has_c) c[unit] = cv;
#pragma unroll
    for (int s = 0; s < S; ++s) saved[(b * S + s) * hidden + j] = saved_u[s];
  }
}

}  // namespace prnn

PRNN_KERNEL void prnn_fused_step_f32(int batch, int input, int hidden, const float* x,
                                     const float* h_prev, const float* c_prev, const float* w_ih,
                                     const float* w_hh, const float* b_ih, const float* b_hh,
                                     int has_bias, float* h, float* c, float* saved) {
  prnn::fused_step<PRNN_CELL>(batch, input, hidden, x, h_prev, c_prev, w_ih, w_hh, b_ih, b_hh,
                              has_bias, h, c, saved);
}
