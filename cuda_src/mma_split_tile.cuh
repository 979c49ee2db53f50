// mma_split_tile.cuh - the backward's matrix product on the tensor cores (issue 28): a 16-bit
// W_hh^T slice held in registers as B fragments of mma.sync.m16n8k16 for the whole launch, the
// fp32 gradient dgh_{t+1} split into two 16-bit parts as the A fragment, fp32 accumulation; or
// (fp32 weights, settings.allow_tf32) an fp32 W_hh^T rounded to TF32 as B fragments of
// mma.sync.m16n8k8, dgh rounded to TF32 as the A fragment.
//
// -D PRNN_MMA=2 (a 16-bit layer backward, or an fp32 one in TF32: no PRNN_WEIGHT_DTYPE; plan.py)
// makes it persistent_common.cuh's RegisterTile
// (mma_tile.cuh includes this header and names it MmaTile); the kernel's code is unchanged:
// multiply_rows / multiply_exchanged below (picked by overload) leave the partial sums
// part_s[(b * ksplit + chunk) * local_rows + row] where the CUDA-core tile's reduce-scatter does.
//
// Why B fragments, not A as the forward (docs/design.md, "Tensor-core tiles", the backward): the
// backward's rows are the CTA's units (8 for LSTM, 16 for GRU and RNN), the N of the mma in
// n-tiles of 8 - no padding rows, 2 weight registers per k-step and 8 units. The M of 16 rows
// then holds the dgh of 8 batch rows twice: rows g take the 16-bit rounding of each value
// (hi), rows g + 8 the 16-bit rounding of what is left (lo = x - hi, exact in fp32), so ONE
// HMMA per k-step and unit n-tile gives both products and D's rows g and g + 8 are added at the
// end: x ~ hi + lo to about 22 significant bits for fp16, against the 24 of the fp32 FMA of the
// CUDA-core tile. bf16 (8 bits a part) splits off a third part, the rounding of x - hi - lo, in
// a second HMMA (rows g + 8 zero): 24 bits (docs/design.md has the errors against float64).
// TF32 does not split: dgh is rounded to TF32 as the weights are (rows g + 8 zero), the same
// bound as the forward's (a split would halve it at best, the weights being rounded anyway, and
// cost the latency model's gain at B = 4: docs/design.md, "TF32 tiles").
//
// fp16's range (|x| from 2^-14 to 65504; 2^-24 at the least) would lose small gradients and
// overflow large ones, so for fp16 each batch row's values are scaled by a power of two chosen
// per (warp, n-tile, batch row) from their largest magnitude m - m scaled into [2^14, 2^15) -,
// and the row's sums are scaled back: exact (a power of two) but where the fp32 result leaves
// fp32's normal range. The scale is the warp's own (its column chunk's partial sums are its
// own: the pointwise step adds the chunks), found by a first pass over the chunk's values.
// bf16 has fp32's range: no scale.
//
// k order: as the forward tile (mma_tile.cuh): lane (g = lane / 4, t = lane % 4) takes A's
// k-columns 2t, 2t+1, 8+2t, 8+2t+1 of a k-step from the staged columns 4t .. 4t+3 (one 16-byte
// shared load of batch row g), and its B registers hold the matching weight words 2t, 2t+1;
// TF32: the load serves two k-steps, k-step `sub` taking A's k-columns t and t + 4 from columns
// 4t + 2 sub and 4t + 2 sub + 1, its B registers the matching weights.
// Non-finite values: an infinite dgh makes its lo part NaN (inf - inf), so its sums are NaN
// where an fp32 FMA would give +-Inf; NaN stays NaN.
#pragma once

namespace prnn {

// A word of two 16-bit values as fp32 (lo in the low half).
PRNN_DEVICE void unpack_16bit(unsigned w, float& lo, float& hi) {
#if PRNN_WEIGHT_DTYPE == 2
  prnn_bf16x2_to_float(w, lo, hi);
#else
  prnn_f16x2_to_float(w, lo, hi);
#endif
}

// Whether the dgh split is scaled (fp16's range).
constexpr bool kScaledSplit = PRNN_WEIGHT_DTYPE == 1;

// Parts a value is split into: fp16 two (11 + 11 significant bits, about 22), bf16 three (8 + 8
// + 8: the whole fp32 significand), the third in a second HMMA whose rows g + 8 are zero; TF32
// one (in the 2-part layout, rows g + 8 zero).
constexpr int kSplitParts = PRNN_WEIGHT_DTYPE == 2 ? 3 : 2;

// y as two 16-bit words: a word of the 16-bit roundings of (y0, y1), and the rests y - those,
// exact in fp32 (left in y).
PRNN_DEVICE unsigned split_off(float (&y)[2]) {
  const unsigned w = pack_16bit(y[0], y[1]);
  float h0, h1;
  unpack_16bit(w, h0, h1);
  y[0] -= h0;
  y[1] -= h1;
  return w;
}

// The A fragments of k-step `sub` of a 16-column block from a lane's four values x (its columns
// 4t .. 4t+3, batch row g) times `scale`: a[0] registers 0 and 2 (rows g) their 16-bit
// roundings, 1 and 3 (rows g + 8) the roundings of the remainders; bf16 (kSplitParts 3): a[1]
// registers 0 and 2 the roundings of what is left then, 1 and 3 zero. TF32: registers 0 and 2
// the TF32 roundings of values 2 sub and 2 sub + 1 (k-columns t and t + 4), 1 and 3 zero.
PRNN_DEVICE void split_fragment(const float (&x)[4], int sub, float scale,
                                unsigned (&a)[kSplitParts - 1][4]) {
  if constexpr (kTf32) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      a[0][2 * p] = prnn_tf32_bits(x[2 * sub + p]);
      a[0][2 * p + 1] = 0u;
    }
    return;
  }
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    float y[2] = {kScaledSplit ? x[2 * p] * scale : x[2 * p],
                  kScaledSplit ? x[2 * p + 1] * scale : x[2 * p + 1]};
    a[0][2 * p] = split_off(y);
    if constexpr (kSplitParts == 3) {
      a[0][2 * p + 1] = split_off(y);
      a[kSplitParts - 2][2 * p] = pack_16bit(y[0], y[1]);
      a[kSplitParts - 2][2 * p + 1] = 0u;
    } else {
      a[0][2 * p + 1] = pack_16bit(y[0], y[1]);
    }
  }
}

// The split's scale and its inverse for a batch row whose largest magnitude (over the four lanes
// of the row's quad: `m` of this lane, reduced here) is m: powers of two putting m in [2^14,
// 2^15); 1 where m is not finite, the largest representable where m is 0 or subnormal.
PRNN_DEVICE void split_scale(float m, float& scale, float& inverse) {
  m = fmaxf(m, prnn_shfl_xor(m, 1));
  m = fmaxf(m, prnn_shfl_xor(m, 2));
  const int e = (int)(prnn_float_bits(m) >> 23);  // m >= 0: the biased exponent
  const int field = e == 255 ? 127 : (268 - e < 253 ? 268 - e : 253);  // 127 + 14 - (e - 127)
  scale = prnn_bits_float((unsigned)field << 23);
  inverse = prnn_bits_float((unsigned)(254 - field) << 23);
}

template <int kRows = PRNN_ROWS, int kKpt = PRNN_KPT>
struct MmaSplitTileOf {
  static constexpr int kLanes = 32;
  static constexpr int kNTiles = (kRows + 7) / 8;  // n-tiles of 8 rows (units)
  static constexpr int kBlocks = 2 * kKpt;  // 16-column blocks: one 16-byte A load each
  static constexpr int kKSteps = kBlocks * kStepsPerBlock;
  static constexpr int kChunk = kLanes * kKpt;  // columns per warp
  static constexpr int kRowCount = kRows;
  // Accumulator sets: k-step s adds into set s % kSets (independent HMMA chains per n-tile).
  static constexpr int kSets = kKSteps >= 8 ? 4 : kKSteps >= 2 ? 2 : 1;
  unsigned w[kNTiles][kKSteps][2];  // B fragments: w[n][s][j], the PTX ISA's register j

  // rows[r]: row of M (16-bit: words of two columns, rows padded to an even length; TF32: fp32
  // values) for the warp's r-th row, or -1 (zeros); col0: the warp's first column; k_len: M's
  // columns. Register j of (n, s): row 8n + g, word pair 2t + j of 16-bit k-step s; TF32 column
  // 4t + 2 sub + j of block s / 2, sub = s % 2 (the k order above).
  template <class Word>
  PRNN_DEVICE void load(const Word* m, const int (&rows)[kRows], int col0, int k_len, int lane) {
    const int row_words = (k_len + kColumnsPerWord - 1) / kColumnsPerWord, g = lane / 4, t = lane % 4;
    constexpr int kBlockWords = 16 / kColumnsPerWord, kLaneWords = 4 / kColumnsPerWord;
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) {
      const int row = lane_row(rows, 8 * n, g);
#pragma unroll
      for (int s = 0; s < kKSteps; ++s) {
        const int k = col0 / kColumnsPerWord + s / kStepsPerBlock * kBlockWords + kLaneWords * t
                      + 2 * (s % kStepsPerBlock);
        w[n][s][0] = a_word(row_word(m, row, k, row_words));
        w[n][s][1] = a_word(row_word(m, row, k + 1, row_words));
      }
    }
  }

  // The product of the tile and 8 batch rows whose values value(c, x) gives (this lane's four of
  // 16-column block c, a compile-time c once unrolled) times `scale`: the sums of (batch row g,
  // row 8n + 2t + i) end in d[n][i] (hi part) and d[n][i + 2] (lo part).
  template <class Value>
  PRNN_DEVICE void multiply(Value value, float scale, float (&d)[kNTiles][4]) const {
    mma_chain<kSets, kNTiles, kKSteps>([&](int s, float (&acc)[kSets][kNTiles][4]) {
      float x[4];
      value(s / kStepsPerBlock, x);
      unsigned a[kSplitParts - 1][4];
      split_fragment(x, s % kStepsPerBlock, scale, a);
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) {
        // bf16's third part into the next set: its own chain (every set's rows are added at the end)
#pragma unroll
        for (int part = 0; part < kSplitParts - 1; ++part) {
          float (&c)[4] = acc[(s + part) % kSets][n];
          mma_typed(c, a[part], w[n][s], c);
        }
      }
    }, d);
  }

  // Stores the sums of batch row n0 + g (below `batch`): hi + lo parts, times `inverse` (the
  // scale's), as partial sums of chunk `chunk` for the warp's rows from `row0`.
  PRNN_DEVICE static void store(const float (&d)[kNTiles][4], float inverse, float* part_s, int n0,
                                int batch, int row0, int chunk, int ksplit, int local_rows,
                                int lane) {
    const int b = n0 + lane / 4, t = lane % 4;
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = 8 * n + 2 * t + i;
        const float sum = d[n][i] + d[n][i + 2];
        if (b < batch && row < kRows) {
          part_s[(b * ksplit + chunk) * local_rows + row0 + row] = kScaledSplit ? sum * inverse : sum;
        }
      }
    }
  }
};
#if PRNN_MMA == 2  // (the projection forward includes this header at 1 for its tile B)
using MmaTile = MmaSplitTileOf<>;
#endif

// multiply_rows (persistent_common.cuh) for the split tile: per n-tile of 8 batch rows, A from
// the staged vector (row stride `padded`; rows past the batch multiply the last row again, their
// sums are not stored), the partial sums into part_s. No barrier: the caller's makes them visible.
template <int kRows, int kKpt>
PRNN_DEVICE void multiply_rows(const MmaSplitTileOf<kRows, kKpt>& tile, const float* v_s,
                               float* part_s, int batch, int local_rows, int ksplit = PRNN_KSPLIT,
                               int padded = PRNN_KSPLIT * 32 * PRNN_KPT) {
  using Tile = MmaSplitTileOf<kRows, kKpt>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, chunk = warp % ksplit;
  const int g = lane / 4, t = lane % 4;
#pragma unroll 1  // one n-tile per trip: at B <= 8 the only one
  for (int n0 = 0; n0 < batch; n0 += 8) {
    const int b = n0 + g < batch ? n0 + g : batch - 1;
    const float* x = v_s + b * padded + chunk * Tile::kChunk + 4 * t;
    float scale = 1.0f, inverse = 1.0f;
    if constexpr (kScaledSplit) {  // the first pass: the row's largest magnitude
      float m = 0.0f;
#pragma unroll
      for (int s = 0; s < Tile::kBlocks; ++s) {
        float q[4];
        prnn_load_shared_quad(x + 16 * s, q);
#pragma unroll
        for (int e = 0; e < 4; ++e) m = fmaxf(m, fabsf(q[e]));
      }
      split_scale(m, scale, inverse);
    }
    float d[Tile::kNTiles][4];
    tile.multiply([x](int s, float (&q)[4]) { prnn_load_shared_quad(x + 16 * s, q); }, scale, d);
    Tile::store(d, inverse, part_s, n0, batch, warp / ksplit * kRows, chunk, ksplit, local_rows,
                lane);
  }
}

#ifdef PRNN_CLUSTER
// multiply_exchanged (persistent_common.cuh, kDirectRead) for the split tile: per n-tile, each
// lane waits for its words of step s in the cluster's copy of the exchange (wait_mma_quads,
// mma_tile.cuh) and multiplies them; returns whether this thread's wait failed.
template <int kRows, int kKpt, int Padded>
PRNN_DEVICE int multiply_exchanged(const MmaSplitTileOf<kRows, kKpt>& tile,
                                   const ExchangeOf<Padded>& xch, int s, float* part_s, int batch,
                                   int local_rows, PrnnControl* ctl, unsigned long long timeout_ns,
                                   int ksplit = PRNN_KSPLIT) {
  using Tile = MmaSplitTileOf<kRows, kKpt>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, chunk = warp % ksplit;
  return for_exchanged_ntiles<Tile::kBlocks, Tile::kChunk>(
      xch, s, batch, ctl, timeout_ns, ksplit, [&](int n0, const unsigned (&w)[Tile::kBlocks][4]) {
        float scale = 1.0f, inverse = 1.0f;
        if constexpr (kScaledSplit) {
          float m = 0.0f;
#pragma unroll
          for (int k = 0; k < Tile::kBlocks; ++k) {
#pragma unroll
            for (int e = 0; e < 4; ++e) m = fmaxf(m, fabsf(prnn_value_of(w[k][e])));
          }
          split_scale(m, scale, inverse);
        }
        float d[Tile::kNTiles][4];
        tile.multiply([&w](int k, float (&q)[4]) {
#pragma unroll
          for (int e = 0; e < 4; ++e) q[e] = prnn_value_of(w[k][e]);
        }, scale, d);
        Tile::store(d, inverse, part_s, n0, batch, warp / ksplit * kRows, chunk, ksplit,
                    local_rows, lane);
      });
}
#endif

}  // namespace prnn
