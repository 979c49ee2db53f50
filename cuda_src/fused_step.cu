// fused_step.cu - one step of a cell in one launch: both matrix products and the pointwise math.
//
// For a decoder that advances one step per call (torch.nn's RNNCell/GRUCell/LSTMCell), a step is
// otherwise three kernels (two GEMMs and the pointwise update). Here one warp computes one
// (batch row b, hidden unit j): its lanes stride over k, so that every load of a weight row
// W_ih[g*H + j, :] and W_hh[g*H + j, :] is coalesced (the weights come from L2/HBM: nothing is
// kept between calls), accumulate in fp32, and reduce with a shuffle butterfly; lane 0 then adds
// the biases and runs the cell (prnn::Cell<CELL>::forward from cells.cuh, the code every other
// path runs) and writes h, c and the saved activations. The summation order is fixed, so results
// are bitwise reproducible. Nothing is allocated and nothing is read back: the launch can be
// captured in a CUDA graph.
//
// Layouts (row-major, contiguous): x (B, I), h_prev and h (B, H), c_prev and c (B, H; LSTM only),
// w_ih (G*H, I), w_hh (G*H, H), b_ih and b_hh (G*H; read only when has_bias != 0), saved
// (B, S*H) with activation s of unit j at column s*H + j (persistent_rnn/cells.py's layout).
// Pointers a cell does not use may be any valid buffer. Launch: blockDim.x a multiple of 32,
// at least B*H warps in all (extra warps return at once).
#include "cells.cuh"

namespace prnn {

// Lane 0 gets sum_k w[k] * v[k] over k < n (fp32, fixed order); the other lanes partial sums.
PRNN_DEVICE float warp_dot(const float* w, const float* v, int n, int lane) {
  float acc = 0.0f;
  for (int k = lane; k < n; k += 32) acc += w[k] * v[k];
  for (int mask = 16; mask > 0; mask >>= 1) acc += prnn_shfl_xor(acc, mask);
  return acc;
}

template <int CELL>
PRNN_DEVICE void fused_step(int batch, int input, int hidden, const float* x, const float* h_prev,
                            const float* c_prev, const float* w_ih, const float* w_hh,
                            const float* b_ih, const float* b_hh, int has_bias, float* h, float* c,
                            float* saved) {
  constexpr int G = Cell<CELL>::G;
  constexpr int S = Cell<CELL>::S;
  const size_t thread = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t unit = thread / 32;  // one warp per (b, j): the whole warp leaves together
  const int lane = (int)(thread % 32);
  if (unit >= (size_t)batch * hidden) return;
  const size_t b = unit / hidden, j = unit % hidden;
  float gi[G], gh[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const size_t row = (size_t)g * hidden + j;
    gi[g] = warp_dot(w_ih + row * input, x + b * input, input, lane);
    gh[g] = warp_dot(w_hh + row * hidden, h_prev + b * hidden, hidden, lane);
  }
  if (lane != 0) return;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (has_bias) {
      gi[g] += b_ih[(size_t)g * hidden + j];
      gh[g] += b_hh[(size_t)g * hidden + j];
    }
  }
  float hv, cv, saved_u[S > 0 ? S : 1];
  Cell<CELL>::forward(gi, gh, h_prev[unit], CELL == LSTM ? c_prev[unit] : 0.0f, hv, cv, saved_u);
  h[unit] = hv;
  if (CELL == LSTM) c[unit] = cv;
#pragma unroll
  for (int s = 0; s < S; ++s) saved[(b * S + s) * hidden + j] = saved_u[s];
}

}  // namespace prnn

#define PRNN_FUSED_STEP(NAME, CELL)                                                              \
  PRNN_KERNEL void prnn_fused_step_##NAME##_f32(                                                \
      int batch, int input, int hidden, const float* x, const float* h_prev, const float* c_prev, \
      const float* w_ih, const float* w_hh, const float* b_ih, const float* b_hh, int has_bias,  \
      float* h, float* c, float* saved) {                                                        \
    prnn::fused_step<CELL>(batch, input, hidden, x, h_prev, c_prev, w_ih, w_hh, b_ih, b_hh,      \
                           has_bias, h, c, saved);                                               \
  }

PRNN_FUSED_STEP(rnn_tanh, prnn::RNN_TANH)
PRNN_FUSED_STEP(rnn_relu, prnn::RNN_RELU)
PRNN_FUSED_STEP(lstm, prnn::LSTM)
PRNN_FUSED_STEP(gru, prnn::GRU)
