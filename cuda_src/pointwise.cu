// pointwise.cu - the GEMM path's fused per-step pointwise kernels (CuPy on the GPU).
//
// One kernel per step and direction of the recurrence: the GEMM h_{t-1} W_hh^T runs in cuBLAS,
// everything elementwise around it (recurrent bias, the cell, the lengths mask, gradient sums)
// runs here in one launch. One thread per (batch row b, hidden unit j); buffers are contiguous,
// row-major (B, X*H) with gate / saved activation x of unit j at column x*H + j. Indices are
// 64-bit: B*G*H passes 2^31 at sizes the GEMM path accepts.
//
// The cell math is prnn::cell_forward_masked / cell_backward_masked from cells.cuh, the same
// code the persistent kernels run. One cell per build, -D PRNN_CELL (its prnn::CellKind), as for
// the persistent kernels: no list of cells here. Kernels are extern "C" wrappers (PRNN_KERNEL)
// over templates, named prnn_pointwise_{forward,backward}_<f32|f64>, so that the host emulation
// can compile this file unchanged. Pointers a cell does not use (c for cells without a cell state,
// b_hh when has_bias == 0) may be any valid buffer; they are not read or written.
#include "cells.cuh"

namespace prnn {

// h, c, saved of step t from gi_t, gh_t (= h_{t-1} W_hh^T without bias), h_{t-1}, c_{t-1}.
template <int CELL, class T>
PRNN_DEVICE void pointwise_forward(int batch, int hidden, int t, const int* lengths, const T* gi,
                                   const T* gh, const T* b_hh, int has_bias, const T* h_prev,
                                   const T* c_prev, T* h, T* c, T* saved) {
  constexpr int G = Cell<CELL>::G;
  constexpr int S = Cell<CELL>::S;
  const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;  // B*G*H may pass 2^31
  if (idx >= (size_t)batch * hidden) return;
  const size_t b = idx / hidden, j = idx % hidden;
  T gi_u[G], gh_u[G], saved_u[S > 0 ? S : 1];
  for (int g = 0; g < G; ++g) {
    gi_u[g] = gi[(b * G + g) * hidden + j];
    gh_u[g] = gh[(b * G + g) * hidden + j] + (has_bias ? b_hh[(size_t)g * hidden + j] : T(0));
  }
  constexpr bool has_c = Cell<CELL>::has_c;
  const T cp = has_c ? c_prev[idx] : T(0);
  T hv, cv;
  cell_forward_masked<CELL, T>(t < lengths[b], gi_u, gh_u, h_prev[idx], cp, hv, cv, saved_u);
  h[idx] = hv;
  if (has_c) c[idx] = cv;
  for (int s = 0; s < S; ++s) saved[(b * S + s) * hidden + j] = saved_u[s];
}

// Gradients of step t. The gradient reaching h_t is dy_t + dh_direct + dh_rec (dh_rec = the
// part through W_hh from step t+1, dh_direct = the cell's direct part), dc the one reaching c_t.
// Writes dgi_t, dgh_t (the same buffer unless GRU) and the direct parts dh_direct_out, dc_out
// of the gradients reaching h_{t-1}, c_{t-1}.
template <int CELL, class T>
PRNN_DEVICE void pointwise_backward(int batch, int hidden, int t, const int* lengths, const T* dy,
                                    const T* dh_direct, const T* dh_rec, const T* dc,
                                    const T* saved, const T* h, const T* c, const T* h_prev,
                                    const T* c_prev, T* dgi, T* dgh, T* dh_direct_out, T* dc_out) {
  constexpr int G = Cell<CELL>::G;
  constexpr int S = Cell<CELL>::S;
  const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;  // B*G*H may pass 2^31
  if (idx >= (size_t)batch * hidden) return;
  const size_t b = idx / hidden, j = idx % hidden;
  T saved_u[S > 0 ? S : 1], dgi_u[G], dgh_u[G];
  for (int s = 0; s < S; ++s) saved_u[s] = saved[(b * S + s) * hidden + j];
  constexpr bool has_c = Cell<CELL>::has_c;
  const T dhv = dy[idx] + dh_direct[idx] + dh_rec[idx];
  T dh_prev, dc_prev;
  cell_backward_masked<CELL, T>(t < lengths[b], dhv, has_c ? dc[idx] : T(0), saved_u, h[idx],
                                has_c ? c[idx] : T(0), h_prev[idx], has_c ? c_prev[idx] : T(0),
                                dgi_u, dgh_u, dh_prev, dc_prev);
  for (int g = 0; g < G; ++g) {
    dgi[(b * G + g) * hidden + j] = dgi_u[g];
    dgh[(b * G + g) * hidden + j] = dgh_u[g];  // same value as dgi unless GRU's n gate
  }
  dh_direct_out[idx] = dh_prev;
  if (has_c) dc_out[idx] = dc_prev;
}

}  // namespace prnn

#define PRNN_POINTWISE_KERNELS(T, SUFFIX)                                                        \
  PRNN_KERNEL void prnn_pointwise_forward_##SUFFIX(                                                \
      int batch, int hidden, int t, const int* lengths, const T* gi, const T* gh, const T* b_hh,   \
      int has_bias, const T* h_prev, const T* c_prev, T* h, T* c, T* saved) {                     \
    prnn::pointwise_forward<PRNN_CELL, T>(batch, hidden, t, lengths, gi, gh, b_hh, has_bias,       \
                                          h_prev, c_prev, h, c, saved);                           \
  }                                                                                                \
  PRNN_KERNEL void prnn_pointwise_backward_##SUFFIX(                                               \
      int batch, int hidden, int t, const int* lengths, const T* dy, const T* dh_direct,           \
      const T* dh_rec, const T* dc, const T* saved, const T* h, const T* c, const T* h_prev,      \
      const T* c_prev, T* dgi, T* dgh, T* dh_direct_out, T* dc_out) {                             \
    prnn::pointwise_backward<PRNN_CELL, T>(batch, hidden, t, lengths, dy, dh_direct, dh_rec, dc,   \
                                           saved, h, c, h_prev, c_prev, dgi, dgh, dh_direct_out,  \
                                           dc_out);                                               \
  }

PRNN_POINTWISE_KERNELS(float, f32)
PRNN_POINTWISE_KERNELS(double, f64)
