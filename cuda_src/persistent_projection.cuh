// persistent_projection.cuh - what the persistent kernels of the LSTM with projection
// (torch.nn.LSTM(proj_size=P)) share beyond persistent_common.cuh.
//
// The layer: gates_t = gi_t + W_hh r_{t-1} + b_hh (W_hh: 4H x P), c_t and h_t as the LSTM's,
// r_t = W_hr h_t (W_hr: P x H); r_t is the state that recurs and the layer's output. Each CTA
// owns PRNN_UNITS hidden units (their 4 gate rows) and PRNN_PROJ_ROWS rows of r, and holds two
// register tiles, A (the -D tile of persistent_common.cuh: PRNN_ROWS, PRNN_KSPLIT, PRNN_KPT)
// and B (PRNN_ROWS_B, PRNN_KSPLIT_B, PRNN_KPT_B), both spread over the same PRNN_WARPS warps:
//
//   pass      tile A (K)                       tile B (K)
//   forward   gate rows of W_hh (P)            rows of W_hr (H)
//   backward  rows of W_hh^T (4H)              rows of W_hr^T (P)
//
// Per step two vectors are exchanged (tagged words, persistent_common.cuh's ExchangeOf, each in
// rows of its staged vector's length: tile A's padded K or tile B's): forward r_{t-1} (P) and h_t
// (H); backward dr_t (P) and dgates_t (4H).
// The grid path only: a cluster variant is not built (PRNN_CLUSTER is refused).
//
// On the tensor cores (-D PRNN_MMA, 16-bit; tiles.MMA_PROJECTION_TILES, docs/design.md "LSTM
// with projection"): tile A is persistent_common.cuh's RegisterTile - the forward's W_hh as A
// fragments (mma_tile.cuh; r_{t-1} is a 16-bit value), the backward's W_hh^T as B fragments
// (mma_split_tile.cuh, dg split) - and tile B is always the split tile (W_hr, W_hr^T as B
// fragments: the forward's h_t and the backward's drs_t are fp32, split into 16-bit parts).
#pragma once
#include "persistent_common.cuh"
#ifdef PRNN_MMA
#include "mma_split_tile.cuh"
#endif

#ifdef PRNN_CLUSTER
#error "the LSTM-with-projection kernels run on the grid path only (no PRNN_CLUSTER build)"
#endif

namespace prnn {

static_assert(PRNN_CELL == LSTM, "projections are defined for the LSTM only");
constexpr int kProjRows = PRNN_PROJ_ROWS;  // rows of r owned by one CTA
constexpr int kKsplitB = PRNN_KSPLIT_B;
#ifdef PRNN_MMA
using TileB = MmaSplitTileOf<PRNN_ROWS_B, PRNN_KPT_B>;
#else
using TileB = TileOf<PRNN_ROWS_B, PRNN_KPT_B>;
#endif
constexpr int kPaddedB = kKsplitB * TileB::kChunk;  // tile B's staged vector length per batch row

// Loads `tile` (a TileOf or an mma tile, spread over the CTA's warps, `ksplit` warps per row group) from m
// (k_len columns): the warp's local rows r < local_rows are m's rows row_of(r), those past them
// zeros.
template <class Tile, class RowOf>
PRNN_DEVICE void load_tile(Tile& tile, const WeightWord* m, int k_len, int ksplit, int local_rows,
                           RowOf row_of) {
  const int warp = threadIdx.x / kWarp;
  int rows[Tile::kRowCount];
#pragma unroll
  for (int r = 0; r < Tile::kRowCount; ++r) {
    const int local = warp / ksplit * Tile::kRowCount + r;
    rows[r] = local < local_rows ? row_of(local) : -1;
  }
  tile.load(m, rows, warp % ksplit * Tile::kChunk, k_len, threadIdx.x % kWarp);
}

// Zeroes a staged vector's buffer [batch][padded] once per launch: the gathers write the first
// k_len values of each row every step and never touch the padding past it.
PRNN_DEVICE void zero_staged(float* v_s, int batch, int padded) {
  for (int idx = threadIdx.x; idx < batch * padded; idx += blockDim.x) v_s[idx] = 0.0f;
}

}  // namespace prnn
