// cells.cuh - each cell's pointwise forward and backward, written once for every path.
//
// Included by the GEMM path's fused pointwise kernels and by the persistent kernels, for the
// GPU (NVRTC) and the host emulation alike. Mirrors persistent_rnn/cells.py (the NumPy
// reference): same gate order and equations as torch.nn.
//
// Per hidden unit and batch row, a cell sees
//   gi[G]   input part of the pre-activations, W_ih x_t + b_ih (gate g of unit j is row g*H+j)
//   gh[G]   recurrent part, W_hh h_{t-1} + b_hh
//   h_prev, c_prev (c only where Cell<>::has_c: LSTM)
// and produces h, c and S saved activations that its backward needs (layout [s*H + j]); h and c
// are kept for every step by the caller, so saved holds only what they do not give.
// Backward takes the total gradients dh (to h_t) and dc (to c_t) and returns the gradients of
// gi and gh (identical except for GRU's n gate) and the direct parts of dh_prev and dc_prev
// (the part through W_hh is added by the caller).
#pragma once
#include "hw.cuh"

namespace prnn {

enum CellKind { RNN_TANH = 0, RNN_RELU = 1, LSTM = 2, GRU = 3 };

PRNN_HD float act_tanh(float x) { return tanhf(x); }
PRNN_HD double act_tanh(double x) { return tanh(x); }
// On the GPU both e^-x and the reciprocal come from the special-function unit (prnn_exp_approx,
// prnn_reciprocal): e^-x within (2 + 1.173|x|) ulp moves the sigmoid by at most
// sigmoid(x) (1 - sigmoid(x)) (2 + 1.173|x|) 2^-23 < 1e-7 (absolute), the reciprocal by 1 ulp:
// far inside what docs/api.md promises against float64 (2e-5 of the largest value).
PRNN_HD float act_sigmoid(float x) { return prnn_reciprocal(1.0f + prnn_exp_approx(-x)); }
PRNN_HD double act_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

// The type the recurrent state h_t is stored in, rounded to it wherever a step stores it (0 fp32,
// 1 fp16, 2 bf16): a 16-bit layer's - its weights' PRNN_WEIGHT_DTYPE, or PRNN_WIDENED_FROM where
// an fp32 tile holds them widened (persistent_common.cuh) -, so that its state is a 16-bit value
// on every path and a relaunch resumes from exactly what y holds.
#if defined(PRNN_WIDENED_FROM)
#define PRNN_STATE_DTYPE PRNN_WIDENED_FROM
#elif defined(PRNN_WEIGHT_DTYPE)
#define PRNN_STATE_DTYPE PRNN_WEIGHT_DTYPE
#else
#define PRNN_STATE_DTYPE 0
#endif
PRNN_DEVICE float prnn_stored_state(float v) {
#if PRNN_STATE_DTYPE == 1
  return prnn_round_f16(v);
#elif PRNN_STATE_DTYPE == 2
  return prnn_round_bf16(v);
#elif PRNN_STATE_DTYPE == 0
  return v;
#else
#error "PRNN_STATE_DTYPE must be 0 (fp32), 1 (fp16) or 2 (bf16)"
#endif
}

template <int CELL>
struct Cell;

// Elman RNN, h = act(gi + gh), one template for every activation: Act::apply(pre) and
// Act::grad(dh, h), the gradient through act written with its output h (the cell saves nothing).
template <class Act>
struct ElmanCell {
  static constexpr int G = 1;  // gates
  static constexpr int S = 0;  // saved activations per unit (h_t itself is the output)
  static constexpr bool has_c = false;  // a cell state c beside h (LSTM)
  template <class T>
  PRNN_HD static void forward(const T* gi, const T* gh, T h_prev, T c_prev, T& h, T& c, T* saved) {
    h = Act::apply(gi[0] + gh[0]);
    c = c_prev;
  }
  template <class T>
  PRNN_HD static void backward(T dh, T dc, const T* saved, T h, T c, T h_prev, T c_prev, T* dgi, T* dgh,
                               T& dh_prev, T& dc_prev) {
    dgi[0] = dgh[0] = Act::grad(dh, h);
    dh_prev = T(0);
    dc_prev = T(0);
  }
};

struct TanhAct {
  template <class T>
  PRNN_HD static T apply(T pre) { return act_tanh(pre); }
  template <class T>
  PRNN_HD static T grad(T dh, T h) { return dh * (T(1) - h * h); }
};

// NaN stays NaN, as in torch.nn (pre > 0 ? pre : 0 made it 0).
struct ReluAct {
  template <class T>
  PRNN_HD static T apply(T pre) { return pre < T(0) ? T(0) : pre; }
  template <class T>
  PRNN_HD static T grad(T dh, T h) { return h > T(0) ? dh : T(0); }
};

template <>
struct Cell<RNN_TANH> : ElmanCell<TanhAct> {};
template <>
struct Cell<RNN_RELU> : ElmanCell<ReluAct> {};

// LSTM, gates i, f, g, o; saved: i, f, g, o.
template <>
struct Cell<LSTM> {
  static constexpr int G = 4;
  static constexpr int S = 4;
  static constexpr bool has_c = true;
  template <class T>
  PRNN_HD static void forward(const T* gi, const T* gh, T h_prev, T c_prev, T& h, T& c, T* saved) {
    const T i = act_sigmoid(gi[0] + gh[0]);
    const T f = act_sigmoid(gi[1] + gh[1]);
    const T g = act_tanh(gi[2] + gh[2]);
    const T o = act_sigmoid(gi[3] + gh[3]);
    c = f * c_prev + i * g;
    h = o * act_tanh(c);
    saved[0] = i; saved[1] = f; saved[2] = g; saved[3] = o;
  }
  template <class T>
  PRNN_HD static void backward(T dh, T dc, const T* saved, T h, T c, T h_prev, T c_prev, T* dgi, T* dgh,
                               T& dh_prev, T& dc_prev) {
    const T i = saved[0], f = saved[1], g = saved[2], o = saved[3];
    const T tc = act_tanh(c);
    const T dct = dc + dh * o * (T(1) - tc * tc);
    dgi[0] = dgh[0] = dct * g * i * (T(1) - i);
    dgi[1] = dgh[1] = dct * c_prev * f * (T(1) - f);
    dgi[2] = dgh[2] = dct * i * (T(1) - g * g);
    dgi[3] = dgh[3] = dh * tc * o * (T(1) - o);
    dh_prev = T(0);
    dc_prev = dct * f;
  }
};

// GRU, gates r, z, n with n = tanh(gi_n + r * gh_n); saved: r, z, n, gh_n.
template <>
struct Cell<GRU> {
  static constexpr bool has_c = false;  // h is the whole state: z interpolates it
  static constexpr int G = 3;
  static constexpr int S = 4;
  template <class T>
  PRNN_HD static void forward(const T* gi, const T* gh, T h_prev, T c_prev, T& h, T& c, T* saved) {
    const T r = act_sigmoid(gi[0] + gh[0]);
    const T z = act_sigmoid(gi[1] + gh[1]);
    const T n = act_tanh(gi[2] + r * gh[2]);
    h = (T(1) - z) * n + z * h_prev;
    c = c_prev;
    saved[0] = r; saved[1] = z; saved[2] = n; saved[3] = gh[2];
  }
  template <class T>
  PRNN_HD static void backward(T dh, T dc, const T* saved, T h, T c, T h_prev, T c_prev, T* dgi, T* dgh,
                               T& dh_prev, T& dc_prev) {
    const T r = saved[0], z = saved[1], n = saved[2], ghn = saved[3];
    const T dn = dh * (T(1) - z) * (T(1) - n * n);
    const T dz = dh * (h_prev - n) * z * (T(1) - z);
    const T dr = dn * ghn * r * (T(1) - r);
    dgi[0] = dgh[0] = dr;
    dgi[1] = dgh[1] = dz;
    dgi[2] = dn;
    dgh[2] = dn * r;
    dh_prev = dh * z;
    dc_prev = T(0);
  }
};

// Packed-sequence masking, shared by every path: past a sequence's length its state is frozen
// (h_t = h_{t-1}, c_t = c_{t-1}) and gradients pass straight through to the previous step.
template <int CELL, class T>
PRNN_HD void cell_forward_masked(bool active, const T* gi, const T* gh, T h_prev, T c_prev, T& h,
                                 T& c, T* saved) {
  Cell<CELL>::forward(gi, gh, h_prev, c_prev, h, c, saved);
  if (!active) {
    h = h_prev;
    c = c_prev;
  }
}

template <int CELL, class T>
PRNN_HD void cell_backward_masked(bool active, T dh, T dc, const T* saved, T h, T c, T h_prev, T c_prev,
                                  T* dgi, T* dgh, T& dh_prev, T& dc_prev) {
  if (active) {
    Cell<CELL>::backward(dh, dc, saved, h, c, h_prev, c_prev, dgi, dgh, dh_prev, dc_prev);
  } else {
    for (int g = 0; g < Cell<CELL>::G; ++g) dgi[g] = dgh[g] = T(0);
    dh_prev = dh;
    dc_prev = dc;
  }
}

}  // namespace prnn
