// persistent_common.cuh - what the persistent forward and backward kernels share.
//
// Both passes multiply a slice of a row-major matrix M (rows x K) by one vector per batch row and
// step: forward M = W_hh (K = H), backward M = W_hh^T (K = G*H). The slice lives in registers for
// the whole launch (RegisterTile: compile-time indices only, so nothing spills to local memory);
// the vector is staged in shared memory, zero-padded so that the unrolled loop needs no bounds
// checks.
//
// Warp w holds PRNN_ROWS local rows (row group w / PRNN_KSPLIT) over one of PRNN_KSPLIT
// contiguous column chunks (w % PRNN_KSPLIT) of 32*PRNN_KPT columns; lane l holds columns
// chunk + l + 32*i. Each staged value read from shared memory feeds PRNN_ROWS FMAs, so shared
// memory bandwidth keeps up with the FMA units; the KSPLIT partial sums of a row are added by the
// pointwise step.
//
// Configuration (-D, identical for NVRTC and the host emulation; chosen by persistent_rnn/plan.py):
//   PRNN_CELL  prnn::CellKind          PRNN_UNITS   hidden units owned by one CTA
//   PRNN_ROWS  matrix rows per warp    PRNN_KSPLIT  warps sharing a row (column chunks)
//   PRNN_KPT   columns per lane        PRNN_WARPS   warps per CTA (blockDim.x == 32*PRNN_WARPS)
#pragma once
#include "cells.cuh"

namespace prnn {

constexpr int kWarp = 32;
constexpr int kUnits = PRNN_UNITS;
constexpr int kRows = PRNN_ROWS;
constexpr int kKsplit = PRNN_KSPLIT;
constexpr int kKpt = PRNN_KPT;
constexpr int kChunk = kWarp * kKpt;        // columns per warp
constexpr int kPadded = kKsplit * kChunk;   // staged vector length per batch row
using ThisCell = Cell<PRNN_CELL>;
constexpr bool kHasC = PRNN_CELL == LSTM;
constexpr int kSavedSlots = ThisCell::S > 0 ? ThisCell::S : 1;

PRNN_HD constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }
constexpr int kRowsPow2 = pow2_at_least(kRows);
static_assert(kRowsPow2 <= kWarp, "at most 32 rows per warp");
constexpr int kLanesPerRow = kWarp / kRowsPow2;  // lanes that end up holding the same row's sum

struct RegisterTile {
  float w[kRows][kKpt];

  // rows[r]: row of M for the warp's r-th row, or -1 for a row past the matrix (held as zeros);
  // col0: the warp's first column.
  PRNN_DEVICE void load(const float* m, const int (&rows)[kRows], int col0, int k_len, int lane) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int i = 0; i < kKpt; ++i) {
        const int k = col0 + lane + kWarp * i;
        w[r][i] = (rows[r] >= 0 && k < k_len) ? m[(size_t)rows[r] * k_len + k] : 0.0f;
      }
    }
  }

  // Multiplies by the staged chunk v; returns the sum over the warp's columns of row
  // row_of_lane(lane) (a reduce-scatter: each halving step sends half the rows to the partner
  // lane, so kRows rows cost about kRowsPow2 + log2(kLanesPerRow) shuffles, not 5*kRows).
  PRNN_DEVICE float multiply(const float* v, int lane) const {
    float a[kRowsPow2];
#pragma unroll
    for (int r = 0; r < kRowsPow2; ++r) a[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < kKpt; ++i) {
      const float x = v[lane + kWarp * i];
#pragma unroll
      for (int r = 0; r < kRows; ++r) a[r] += w[r][i] * x;
    }
    int off = kWarp / 2;
#pragma unroll
    for (int half = kRowsPow2 / 2; half >= 1; half /= 2, off /= 2) {
      const bool upper = (lane & off) != 0;
#pragma unroll
      for (int r = 0; r < half; ++r) {
        const float send = upper ? a[r] : a[r + half];
        const float keep = upper ? a[r + half] : a[r];
        a[r] = keep + prnn_shfl_xor(send, off);
      }
    }
#pragma unroll
    for (; off >= 1; off /= 2) a[0] += prnn_shfl_xor(a[0], off);
    return a[0];
  }
};

// The row whose sum `multiply` leaves in `lane`.
PRNN_DEVICE int row_of_lane(int lane) {
  int row = 0;
#pragma unroll
  for (int half = kRowsPow2 / 2, off = kWarp / 2; half >= 1; half /= 2, off /= 2) {
    if (lane & off) row += half;
  }
  return row;
}

// Row group and column chunk of this thread's warp.
PRNN_DEVICE int warp_row_group() { return (int)(threadIdx.x / kWarp) / kKsplit; }
PRNN_DEVICE int warp_chunk() { return (int)(threadIdx.x / kWarp) % kKsplit; }

// Waits for this thread's asynchronous copies, then makes every thread's visible to the block.
PRNN_DEVICE void finish_copies() {
  prnn_copy_wait();
  prnn_sync_block();
}

// Stages `batch` vectors of length k_len (row stride k_len; written by an earlier launch or the
// host, read through L2 only) into v_s, zero-padded to kPadded each: the first step of a launch. When rows are
// 16-byte aligned the copies are asynchronous (no registers, all in flight at once): staging is
// one L2 round trip per step rather than one per element a thread stages.
PRNN_DEVICE void stage_exchanged(float* v_s, const float* src, int batch, int k_len) {
  if (k_len % 4 == 0 && ((size_t)src & 15) == 0) {
    constexpr int kQuads = kPadded / 4;
    for (int idx = threadIdx.x; idx < batch * kQuads; idx += blockDim.x) {
      const int b = idx / kQuads, k = 4 * (idx % kQuads);
      float* dst = v_s + b * kPadded + k;
      if (k < k_len) {
        prnn_copy16_to_shared(dst, src + (size_t)b * k_len + k);
      } else {
        dst[0] = dst[1] = dst[2] = dst[3] = 0.0f;
      }
    }
  } else {
    for (int idx = threadIdx.x; idx < batch * kPadded; idx += blockDim.x) {
      const int b = idx / kPadded, k = idx % kPadded;
      v_s[idx] = k < k_len ? prnn_load_cg(src + (size_t)b * k_len + k) : 0.0f;
    }
  }
  finish_copies();
}

// Words per batch row of a tagged exchange buffer ([2][batch][row words] by step parity) of
// k_len values: rounded up to even, so that every thread loads whole 16-byte pairs.
PRNN_HD int exchange_row_words(int k_len) { return k_len + (k_len & 1); }

// Tagged pairs each thread loads at once while gathering: more in flight means fewer round trips
// when the vector is long, but each pair holds 4 registers, which the large tiles do not have.
constexpr int kGatherPairs = kRows * kKpt > 188 ? 1 : kRows * kKpt > 120 ? 2 : 4;

// Waits for step `tag`'s words of the exchange slot `src` (batch rows of k_len values, published
// by every CTA) and writes them into v_s (row stride kPadded; the zero padding past k_len was
// written once by stage_exchanged and is never touched). Returns false on timeout or abort. The
// caller's next block barrier makes v_s visible to the block.
PRNN_DEVICE bool gather_exchanged(float* v_s, const unsigned long long* src, int batch, int k_len,
                                  unsigned tag, PrnnControl* ctl, unsigned long long timeout_ns) {
  return prnn_gather_tagged<kGatherPairs>(
      src, batch, exchange_row_words(k_len), k_len, tag, ctl, timeout_ns,
      [v_s](int b, int k, float v) { v_s[b * kPadded + k] = v; });
}

// For every batch row, multiplies the tile by the staged vector; the partial sum of local row
// `row` over column chunk `c` goes to part_s[(b * kKsplit + c) * local_rows + row].
PRNN_DEVICE void multiply_batch(const RegisterTile& tile, const float* v_s, float* part_s, int batch,
                                int local_rows) {
  const int lane = threadIdx.x % kWarp, chunk = warp_chunk();
  const int row = row_of_lane(lane);
  const bool writer = lane % kLanesPerRow == 0 && row < kRows;
  for (int b = 0; b < batch; ++b) {
    const float sum = tile.multiply(v_s + b * kPadded + chunk * kChunk, lane);
    if (writer) part_s[(b * kKsplit + chunk) * local_rows + warp_row_group() * kRows + row] = sum;
  }
  prnn_sync_block();
}

// The full sum of local row `row` for batch row `b` (the kKsplit partial sums, in fixed order).
PRNN_DEVICE float row_sum(const float* part_s, int b, int row, int local_rows) {
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < kKsplit; ++c) s += part_s[(b * kKsplit + c) * local_rows + row];
  return s;
}

}  // namespace prnn
