// mma_tile.cuh - the forward's matrix product on the tensor cores (issue 28): a 16-bit W_hh slice
// held in registers as A fragments of mma.sync.m16n8k16 (fp32 accumulation) for the whole launch,
// or an fp32 one rounded to TF32 as A fragments of mma.sync.m16n8k8 (settings.allow_tf32).
//
// -D PRNN_MMA=1 (a 16-bit layer forward, or an fp32 one in TF32: no PRNN_WEIGHT_DTYPE; plan.py)
// makes it persistent_common.cuh's RegisterTile (-D PRNN_MMA=2: the backward's, mma_split_tile.cuh);
// the kernel's code is unchanged: it loads the tile with the same rows and column chunk, and
// multiply_rows / multiply_exchanged below (picked by overload) leave the same partial sums
// part_s[(b * ksplit + chunk) * local_rows + row] as the CUDA-core tile's reduce-scatter does.
//
// Shape (docs/design.md, "Tensor-core tiles"): warp w holds PRNN_ROWS local rows (row group
// w / PRNN_KSPLIT, in 16-row m-tiles) over column chunk w % PRNN_KSPLIT of 32 * PRNN_KPT columns
// (2 * PRNN_KPT 16-column blocks: a 16-bit k-step each, two TF32 k-steps of 8 columns): the
// CUDA-core tile's shape, ROWS * KPT weights per lane (16-bit: two a register, TF32: one).
// The batch is the mma's N: n-tiles of 8 batch rows, a run-time loop (B = 1..8: one n-tile).
//
// k order: the mma sums over k, so any permutation of a k-step's 16 columns applied to both A and
// B gives the same product. Lane (g = lane / 4, t = lane % 4) takes B's k-rows 2t, 2t+1, 8+2t,
// 8+2t+1 from columns 4t .. 4t+3 of the k-step: one 16-byte shared load of the staged fp32
// vector, packed to two 16-bit pairs (F2FP; exact: h is a 16-bit value), instead of four 4-byte
// loads; its A registers hold the matching weight words (pairs 2t and 2t+1 of the k-step's 8).
// TF32: the same load serves the block's two k-steps, lane t taking B's k-rows t and t + 4 from
// columns 4t + 2 sub and 4t + 2 sub + 1 of k-step `sub` (each rounded, cvt.rna), and A's
// registers the matching weights, rounded once as the tile is loaded.
// On the grid the odd batch rows load a pair of blocks in the other order (and select), so that
// no two lanes of a quarter-warp's 16-byte load share a bank.
// Accumulation: k-steps round-robin into 2 or 4 sets of accumulators (as many dependent HMMA
// chains per m-tile), added at the end in a fixed order, so results are deterministic.
#pragma once
#include "exchange.cuh"

#ifndef PRNN_WEIGHT_DTYPE
#define PRNN_WEIGHT_DTYPE 0
#endif

namespace prnn {

// Whether the tile is TF32's (fp32 weights): k-steps of 8 columns, one value a register.
constexpr bool kTf32 = PRNN_WEIGHT_DTYPE == 0;
constexpr int kStepsPerBlock = kTf32 ? 2 : 1;  // k-steps per 16-column block
constexpr int kColumnsPerWord = kTf32 ? 1 : 2;

// d = A B + c in the layer's tensor-core type (fp16, bf16: m16n8k16; TF32: m16n8k8).
PRNN_DEVICE void mma_typed(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                           const float (&c)[4]) {
#if PRNN_WEIGHT_DTYPE == 0
  prnn_mma_tf32(d, a, b, c);
#elif PRNN_WEIGHT_DTYPE == 2
  prnn_mma_bf16(d, a, b, c);
#else
  prnn_mma_f16(d, a, b, c);
#endif
}

// Two fp32 values as a word of the layer's 16-bit type (lo in the low half).
PRNN_DEVICE unsigned pack_16bit(float lo, float hi) {
#if PRNN_WEIGHT_DTYPE == 2
  return prnn_pack_bf16x2(lo, hi);
#else
  return prnn_pack_f16x2(lo, hi);
#endif
}

// B's registers of k-step `sub` of a 16-column block from the lane's quad q of its columns
// (4t .. 4t+3): 16-bit, the block's one k-step as two packed pairs; TF32, k-step sub's two
// values (columns 4t + 2 sub, +1: B's k-rows t and t + 4), rounded.
PRNN_DEVICE void b_fragment(const float (&q)[4], int sub, unsigned (&f)[2]) {
  if constexpr (kTf32) {
    f[0] = prnn_tf32_bits(q[2 * sub]);
    f[1] = prnn_tf32_bits(q[2 * sub + 1]);
  } else {
    f[0] = pack_16bit(q[0], q[1]);
    f[1] = pack_16bit(q[2], q[3]);
  }
}

// A weight word as an A register: a 16-bit pair as it is, an fp32 value rounded to TF32.
PRNN_DEVICE unsigned a_word(unsigned w) { return w; }
PRNN_DEVICE unsigned a_word(float w) { return prnn_tf32_bits(w); }

// rows[base + g] for the lane's g = lane / 4 (-1 past kRows), chosen by compile-time indices: a
// run-time index would put `rows` in local memory. `base` is a compile-time value once unrolled.
template <int kRows>
PRNN_DEVICE int lane_row(const int (&rows)[kRows], int base, int g) {
  int row = -1;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    if (base + q < kRows) row = q == g ? rows[base + q] : row;
  }
  return row;
}

// Word k of row `row` of a matrix of row_words words a row, or 0 (a padding row: -1; a column
// past the matrix).
template <class Word>
PRNN_DEVICE Word row_word(const Word* m, int row, int k, int row_words) {
  return row >= 0 && k < row_words ? m[(size_t)row * row_words + k] : Word(0);
}

// An mma product over kKSteps k-steps: step(s, acc) issues k-step s's HMMAs into the kSets
// accumulator sets of kTiles fragments (independent chains, the k-steps round-robin); the sets
// start at zero and end added in a fixed order, (set 0 + set 1) + (set 2 + set 3), into d.
template <int kSets, int kTiles, int kKSteps, class Step>
PRNN_DEVICE void mma_chain(Step step, float (&d)[kTiles][4]) {
  float acc[kSets][kTiles][4];
#pragma unroll
  for (int e = 0; e < kSets; ++e) {
#pragma unroll
    for (int n = 0; n < kTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[e][n][i] = 0.0f;
    }
  }
#pragma unroll
  for (int s = 0; s < kKSteps; ++s) step(s, acc);
#pragma unroll
  for (int n = 0; n < kTiles; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float sum = kSets >= 2 ? acc[0][n][i] + acc[kSets / 2][n][i] : acc[0][n][i];
      if (kSets == 4) sum = (acc[0][n][i] + acc[1][n][i]) + (acc[2][n][i] + acc[3][n][i]);
      d[n][i] = sum;
    }
  }
}

template <int kRows = PRNN_ROWS, int kKpt = PRNN_KPT>
struct MmaTileOf {
  static constexpr int kLanes = 32;
  static constexpr int kMTiles = kRows / 16;
  static constexpr int kBlocks = 2 * kKpt;  // 16-column blocks: one 16-byte B load each
  static constexpr int kKSteps = kBlocks * kStepsPerBlock;
  static constexpr int kChunk = kLanes * kKpt;  // columns per warp
  static constexpr int kRowCount = kRows;
  // Accumulator sets: k-step s adds into set s % kSets, so an m-tile's HMMAs form kSets
  // independent chains (the HMMA latency is ~8 issue slots, docs/design.md).
  static constexpr int kSets = kKSteps >= 8 ? 4 : kKSteps >= 2 ? 2 : 1;
  static_assert(kRows % 16 == 0, "an mma tile's warp holds whole 16-row m-tiles");
  unsigned a[kMTiles][kKSteps][4];  // A fragments: a[m][s][j], the PTX ISA's register j

  // rows[r]: row of M (16-bit: words of two columns, rows padded to an even length; TF32: fp32
  // values) for the warp's r-th row, or -1 (zeros); col0: the warp's first column; k_len: M's
  // columns. Register j of (m, s): row 16m + g + 8 (j % 2), column pair 2t + j / 2 of 16-bit
  // k-step s; TF32 column 4t + 2 sub + j / 2 of block s / 2, sub = s % 2 (the k order above).
  template <class Word>
  PRNN_DEVICE void load(const Word* m, const int (&rows)[kRows], int col0, int k_len, int lane) {
    const int row_words = (k_len + kColumnsPerWord - 1) / kColumnsPerWord, g = lane / 4, t = lane % 4;
    constexpr int kBlockWords = 16 / kColumnsPerWord, kLaneWords = 4 / kColumnsPerWord;
    // rows[16m + g + 8h] by compile-time indices (a run-time index would put `rows` in local memory)
    int held[kMTiles][2];  // rows g and g + 8 of each m-tile
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) held[mt][h] = lane_row(rows, 16 * mt + 8 * h, g);
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int s = 0; s < kKSteps; ++s) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int k = col0 / kColumnsPerWord + s / kStepsPerBlock * kBlockWords + kLaneWords * t
                        + 2 * (s % kStepsPerBlock) + j / 2;
          a[mt][s][j] = a_word(row_word(m, held[mt][j % 2], k, row_words));
        }
      }
    }
  }

  // The product of the tile and n-tile columns given by fragment(s, b): B's registers of k-step
  // s for this lane (a compile-time s once unrolled); the sums of (row 16m + g + 8 (i / 2), batch
  // column 2t + i % 2) end in d[m][i].
  template <class Fragment>
  PRNN_DEVICE void multiply(Fragment fragment, float (&d)[kMTiles][4]) const {
    mma_chain<kSets, kMTiles, kKSteps>([&](int s, float (&acc)[kSets][kMTiles][4]) {
      unsigned b[2];
      fragment(s, b);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) mma_typed(acc[s % kSets][mt], a[mt][s], b, acc[s % kSets][mt]);
    }, d);
  }

  // Stores an n-tile's sums (columns n0 + 2t + i % 2 below `batch`) as partial sums of chunk
  // `chunk` for the warp's rows from `row0`, where the CUDA-core tile puts them.
  PRNN_DEVICE static void store(const float (&d)[kMTiles][4], float* part_s, int n0, int batch,
                                int row0, int chunk, int ksplit, int local_rows, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int b = n0 + 2 * t + i % 2, row = row0 + 16 * mt + g + 8 * (i / 2);
        if (b < batch) part_s[(b * ksplit + chunk) * local_rows + row] = d[mt][i];
      }
    }
  }
};
#if PRNN_MMA != 2  // 2: the backward's tile (mma_split_tile.cuh, included below)
using MmaTile = MmaTileOf<>;
#endif

// multiply_rows (persistent_common.cuh) for an mma tile: per n-tile of 8 batch rows, B from the
// staged vector (row stride `padded`; columns past the batch multiply the last row again, their
// sums are not stored), the partial sums into part_s. No barrier: the caller's makes them visible.
template <int kRows, int kKpt>
PRNN_DEVICE void multiply_rows(const MmaTileOf<kRows, kKpt>& tile, const float* v_s, float* part_s,
                               int batch, int local_rows, int ksplit = PRNN_KSPLIT,
                               int padded = PRNN_KSPLIT * 32 * PRNN_KPT) {
  using Tile = MmaTileOf<kRows, kKpt>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, chunk = warp % ksplit;
  const int g = lane / 4, t = lane % 4, odd = g & 1;
#pragma unroll 1  // one n-tile per trip: at B <= 8 the only one
  for (int n0 = 0; n0 < batch; n0 += 8) {
    const int b = n0 + g < batch ? n0 + g : batch - 1;
    const float* x = v_s + b * padded + chunk * Tile::kChunk + 4 * t;
    float d[Tile::kMTiles][4];
    constexpr int kPair = 2 * kStepsPerBlock;  // the k-steps of two blocks, loaded together
    unsigned held[kPair][2];
    tile.multiply([x, odd, &held](int s, unsigned (&f)[2]) {
      if (s % kPair == 0) {
        // blocks c and c+1 by two loads, each taking one block in the even batch rows (g) and
        // the other in the odd ones: the two rows of a quarter-warp then read different banks
        // (rows are a multiple of 32 words apart).
        const int c = s / kStepsPerBlock;
        float q[2][4];
        prnn_load_shared_quad(x + 16 * (c + odd), q[0]);
        prnn_load_shared_quad(x + 16 * (c + 1 - odd), q[1]);
        unsigned w[2][kStepsPerBlock][2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
          for (int sub = 0; sub < kStepsPerBlock; ++sub) b_fragment(q[i], sub, w[i][sub]);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
          for (int sub = 0; sub < kStepsPerBlock; ++sub) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              held[i * kStepsPerBlock + sub][j] = odd ? w[1 - i][sub][j] : w[i][sub][j];
            }
          }
        }
      }
      f[0] = held[s % kPair][0];
      f[1] = held[s % kPair][1];
    }, d);
    Tile::store(d, part_s, n0, batch, warp / ksplit * kRows, chunk, ksplit, local_rows, lane);
  }
}

#ifdef PRNN_CLUSTER
template <int Padded>
struct ExchangeOf;  // persistent_common.cuh

// Waits until the kQuads quads of step s's words at batch row b, columns col + 16 q .. +3, carry
// step s's tag (those at or past k_len are never published: zeros, not waited for), as
// ExchangeOf::wait_lane does for the CUDA-core tile, and leaves them in w. False on timeout or
// abort, or at once if they are not there and `give_up`. (In the plain order: a quarter-warp's
// two batch rows share banks, but a cluster tile's few warps leave shared memory idle enough
// that multiply_rows' swap would cost more issue than it saves - the latency model.)
template <int kQuads, int Padded>
PRNN_DEVICE bool wait_mma_quads(const ExchangeOf<Padded>& xch, int s, int b, int col,
                                unsigned (&w)[kQuads][4], bool give_up, PrnnControl* ctl,
                                unsigned long long timeout_ns) {
  const unsigned* mine = xch.words + (s & 1) * xch.slot() + b * Padded + col;
  const int published = xch.k_len - col;
  const unsigned tag = prnn_step_tag(s);
  PrnnWait wait{0u, 0ull};
  bool ready;
  for (;;) {
    unsigned miss = 0u;  // the tag bits of a word whose tag differs from `tag` are not zero
#pragma unroll
    for (int q = 0; q < kQuads; ++q) prnn_load_shared_relaxed_u32x4(mine + 16 * q, w[q]);
#pragma unroll
    for (int q = 0; q < kQuads; ++q) {
#pragma unroll
      for (int e = 0; e < 4; ++e) miss |= 16 * q + e < published ? w[q][e] ^ tag : 0u;
    }
    ready = prnn_tag_of(miss) == 0u;
    if (ready || give_up || !prnn_keep_polling<PrnnClusterWait>(ctl, wait, timeout_ns)) break;
  }
  return ready;
}

// A cluster mma tile's step over the exchange, per n-tile of 8 batch rows: each lane waits for
// its kQuads quads of step s (from column kChunk x its warp's chunk) in the cluster's copy of
// the exchange (wait_mma_quads) and hands them to multiply(n0, w); returns whether this
// thread's wait failed (the caller's barrier votes).
template <int kQuads, int kChunk, int Padded, class Multiply>
PRNN_DEVICE int for_exchanged_ntiles(const ExchangeOf<Padded>& xch, int s, int batch,
                                     PrnnControl* ctl, unsigned long long timeout_ns, int ksplit,
                                     Multiply multiply) {
  const int lane = threadIdx.x % 32, chunk = threadIdx.x / 32 % ksplit;
  const int g = lane / 4, t = lane % 4;
  int failed = 0;
#pragma unroll 1
  for (int n0 = 0; n0 < batch; n0 += 8) {
    const int b = n0 + g < batch ? n0 + g : batch - 1;
    unsigned w[kQuads][4];  // after a failure: any values (the step is discarded)
    failed |= !wait_mma_quads(xch, s, b, chunk * kChunk + 4 * t, w, failed, ctl, timeout_ns);
    multiply(n0, w);
  }
  return failed;
}

// multiply_exchanged (persistent_common.cuh, kDirectRead) for an mma tile: per n-tile, each lane
// waits for its B words of step s in the cluster's copy of the exchange and multiplies them;
// returns whether this thread's wait failed (the caller's barrier votes).
template <int kRows, int kKpt, int Padded>
PRNN_DEVICE int multiply_exchanged(const MmaTileOf<kRows, kKpt>& tile, const ExchangeOf<Padded>& xch,
                                   int s, float* part_s, int batch, int local_rows,
                                   PrnnControl* ctl, unsigned long long timeout_ns,
                                   int ksplit = PRNN_KSPLIT) {
  using Tile = MmaTileOf<kRows, kKpt>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, chunk = warp % ksplit;
  return for_exchanged_ntiles<Tile::kBlocks, Tile::kChunk>(
      xch, s, batch, ctl, timeout_ns, ksplit, [&](int n0, const unsigned (&w)[Tile::kBlocks][4]) {
        float d[Tile::kMTiles][4];
        tile.multiply([&w](int k, unsigned (&f)[2]) {
          const unsigned (&quad)[4] = w[k / kStepsPerBlock];
          const float q[4] = {prnn_value_of(quad[0]), prnn_value_of(quad[1]),
                              prnn_value_of(quad[2]), prnn_value_of(quad[3])};
          b_fragment(q, k % kStepsPerBlock, f);
        }, d);
        Tile::store(d, part_s, n0, batch, warp / ksplit * kRows, chunk, ksplit, local_rows, lane);
      });
}
#endif

}  // namespace prnn

#if PRNN_MMA == 2
#include "mma_split_tile.cuh"
#endif
