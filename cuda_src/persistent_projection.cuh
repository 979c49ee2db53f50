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
// On the grid both go through L2 and are gathered into the staged vectors. In a cluster
// (-D PRNN_CLUSTER, sm_90; tiles.PROJECTION_CLUSTER_TILES) each CTA keeps a copy of both in its
// shared memory (regions EXCHANGE and EXCHANGE_B, the latter tile B's), every CTA stores its
// values into every copy, and each warp waits for the words it multiplies where they are
// (kDirectRead, multiply_exchanged): no gather; the step's two block barriers are the two
// products' (projection_product). The staged vectors are then empty regions (plan.py).
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

#if defined(PRNN_CLUSTER) && defined(PRNN_MMA)
#error "the LSTM-with-projection cluster kernels are CUDA-core tiles (no PRNN_MMA build)"
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
// (k_len columns; a 16-bit layer's words where the fp32 tile is widened, PRNN_WIDENED_FROM): the
// warp's local rows r < local_rows are m's rows row_of(r), those past them zeros.
template <class Tile, class RowOf>
PRNN_DEVICE void load_tile(Tile& tile, const WeightSource* m, int k_len, int ksplit, int local_rows,
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

// One of a step's two products: `tile` (`ksplit` warps a row group, local_rows rows) times step
// s's vector of `xch`, for `batch` rows (0: none) into part_s [batch][ksplit][local_rows]; ends
// with every thread past a block barrier, which makes the sums visible and votes on the waits.
// The grid's vector is staged in v_s (`failed`: this thread's gather of it failed) and the
// barrier comes first; a cluster's warps wait for their words in the exchange and multiply
// (kDirectRead), then meet. prefetch() runs once the vote passed, where every thread has
// finished the step before. Returns true when any thread's wait failed: the step is not done.
template <class Tile, int Padded, class Prefetch>
PRNN_DEVICE bool projection_product(const Tile& tile, const ExchangeOf<Padded>& xch, int s,
                                    const float* v_s, float* part_s, int batch, int local_rows,
                                    int ksplit, int failed, PrnnControl* ctl,
                                    unsigned long long timeout_ns, Prefetch prefetch) {
#ifdef PRNN_CLUSTER
  failed = multiply_exchanged(tile, xch, s, part_s, batch, local_rows, ctl, timeout_ns, ksplit);
  if (prnn_sync_block_or(failed)) return true;
  prefetch();
#else
  if (prnn_sync_block_or(failed)) return true;
  prefetch();
  multiply_batch(tile, v_s, part_s, batch, local_rows, ksplit, Padded);
#endif
  return false;
}

}  // namespace prnn
