// persistent_common.cuh - what the persistent forward and backward kernels share.
//
// Both passes multiply a slice of a row-major matrix M (rows x K) by one vector per batch row and
// step: forward M = W_hh (K = H), backward M = W_hh^T (K = G*H). The slice lives in registers for
// the whole launch (RegisterTile: compile-time indices only, so nothing spills to local memory);
// the vector is staged in shared memory, zero-padded to 32*KPT per batch row so that the unrolled
// loop needs no bounds checks.
//
// Configuration (-D, identical for NVRTC and the host emulation; chosen by persistent_rnn/plan.py):
//   PRNN_CELL   prnn::CellKind            PRNN_UNITS  hidden units owned by one CTA
//   PRNN_ROWS   matrix rows per warp      PRNN_KPT    matrix columns per lane (K <= 32*PRNN_KPT)
//   PRNN_WARPS  warps per CTA (blockDim.x == 32*PRNN_WARPS)
#pragma once
#include "cells.cuh"

namespace prnn {

constexpr int kWarp = 32;
constexpr int kUnits = PRNN_UNITS;
constexpr int kRows = PRNN_ROWS;
constexpr int kKpt = PRNN_KPT;
constexpr int kPadded = kWarp * kKpt;  // staged vector length per batch row
using ThisCell = Cell<PRNN_CELL>;
constexpr bool kHasC = PRNN_CELL == LSTM;
constexpr int kSavedSlots = ThisCell::S > 0 ? ThisCell::S : 1;

// kRows rows of M held by one warp; lane `lane` holds columns lane + 32*i, i < kKpt, so that both
// the one-time load from global memory and the per-step reads of shared memory are coalesced /
// free of bank conflicts.
struct RegisterTile {
  float w[kRows][kKpt];

  // rows[r]: row of M for the warp's r-th row, or -1 for a row past the matrix (held as zeros).
  PRNN_DEVICE void load(const float* m, const int (&rows)[kRows], int k_len, int lane) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int i = 0; i < kKpt; ++i) {
        const int k = lane + kWarp * i;
        w[r][i] = (rows[r] >= 0 && k < k_len) ? m[(size_t)rows[r] * k_len + k] : 0.0f;
      }
    }
  }

  // out[r] = sum_k M[row r, k] * v[k] for the staged vector v, complete in every lane.
  PRNN_DEVICE void multiply(const float* v, int lane, float (&out)[kRows]) const {
#pragma unroll
    for (int r = 0; r < kRows; ++r) out[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < kKpt; ++i) {
      const float x = v[lane + kWarp * i];
#pragma unroll
      for (int r = 0; r < kRows; ++r) out[r] += w[r][i] * x;
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int off = kWarp / 2; off > 0; off /= 2) out[r] += prnn_shfl_xor(out[r], off);
    }
  }
};

// Stages `batch` vectors of length k_len (row stride k_len, written by other CTAs during this
// launch, hence the L1-bypassing load) into v_s, zero-padded to kPadded each.
PRNN_DEVICE void stage_exchanged(float* v_s, const float* src, int batch, int k_len) {
  for (int idx = threadIdx.x; idx < batch * kPadded; idx += blockDim.x) {
    const int b = idx / kPadded, k = idx % kPadded;
    v_s[idx] = k < k_len ? prnn_load_cg(src + (size_t)b * k_len + k) : 0.0f;
  }
  prnn_sync_block();
}

// For every batch row, multiplies the tile by the staged vector and stores the warp's kRows
// results at res_s[b * res_stride + warp * kRows + r].
PRNN_DEVICE void multiply_batch(const RegisterTile& tile, const float* v_s, float* res_s, int batch,
                                int res_stride) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int b = 0; b < batch; ++b) {
    float acc[kRows];
    tile.multiply(v_s + b * kPadded, lane, acc);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) res_s[b * res_stride + warp * kRows + r] = acc[r];
    }
  }
  prnn_sync_block();
}

}  // namespace prnn
