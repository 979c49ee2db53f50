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
//   PRNN_WEIGHT_DTYPE  0 fp32 (default), 1 fp16, 2 bf16: how M is held (below)
//   PRNN_WIDENED_FROM  1 fp16, 2 bf16 (fp32 tiles): M arrives as a 16-bit layer's words of pairs
//                      and the tile holds its values widened to fp32 (read once per launch), h_t
//                      rounded to that type (cells.cuh): plan.widened_pass
//   PRNN_SMEM_<REGION>  the dynamic shared memory's regions, carved in order (shared_layout.cuh)
//
// 16-bit weights: M arrives as 32-bit words of two 16-bit values (columns 2c, 2c+1 of a row, rows
// padded to an even length), and a register holds one word, so a lane's KPT columns of a row take
// KPT/2 registers. Lane l holds words chunk/2 + l + 32*i: the two staged values it multiplies
// are adjacent (one 8-byte shared load). Products and sums are fp32. The forward rounds h_t to the
// 16-bit type (round_state) where it stores it: the state is what y holds, so a relaunch resumes
// from exactly the values a run without one uses.
#pragma once
#include "cells.cuh"
#include "chain.cuh"
#include "exchange.cuh"
#include "shared_layout.cuh"
#ifdef PRNN_MMA
#include "mma_tile.cuh"  // the tensor-core tile: RegisterTile below (issue 28)
#endif

namespace prnn {

constexpr int kWarp = 32;
constexpr int kUnits = PRNN_UNITS;
constexpr int kRows = PRNN_ROWS;
constexpr int kKsplit = PRNN_KSPLIT;
constexpr int kKpt = PRNN_KPT;
constexpr int kChunk = kWarp * kKpt;        // columns per warp
constexpr int kPadded = kKsplit * kChunk;   // staged vector length per batch row
constexpr int kThreads = kWarp * PRNN_WARPS;  // blockDim.x
using ThisCell = Cell<PRNN_CELL>;
constexpr bool kHasC = ThisCell::has_c;
constexpr int kSavedSlots = ThisCell::S > 0 ? ThisCell::S : 1;

PRNN_HD constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }
PRNN_HD constexpr int log2_of(int pow2) { return pow2 <= 1 ? 0 : 1 + log2_of(pow2 / 2); }

#ifndef PRNN_WEIGHT_DTYPE
#define PRNN_WEIGHT_DTYPE 0
#endif
#if PRNN_WEIGHT_DTYPE == 0
using WeightWord = float;
constexpr int kPerWord = 1;
PRNN_DEVICE void unpack_word(WeightWord w, float (&f)[1]) { f[0] = w; }
PRNN_DEVICE void load_staged(const float* p, float (&x)[1]) { x[0] = *p; }
PRNN_DEVICE void load_staged(const float* p, float (&x)[4]) { prnn_load_shared_quad(p, x); }
#else
using WeightWord = unsigned;
constexpr int kPerWord = 2;
PRNN_DEVICE void load_staged(const float* p, float (&x)[2]) { prnn_load_shared_pair(p, x[0], x[1]); }
#if PRNN_WEIGHT_DTYPE == 1
PRNN_DEVICE void unpack_word(WeightWord w, float (&f)[2]) { prnn_f16x2_to_float(w, f[0], f[1]); }
#elif PRNN_WEIGHT_DTYPE == 2
PRNN_DEVICE void unpack_word(WeightWord w, float (&f)[2]) { prnn_bf16x2_to_float(w, f[0], f[1]); }
#else
#error "PRNN_WEIGHT_DTYPE must be 0 (fp32), 1 (fp16) or 2 (bf16)"
#endif
#endif
PRNN_DEVICE float round_state(float v) { return prnn_stored_state(v); }

// What a kernel's matrix argument holds (WeightSource) and its word or value at (row, column c
// of k_len): the tile's own words, or a 16-bit layer's words of pairs (rows padded to even
// length) widened to the fp32 tile's values (PRNN_WIDENED_FROM; exact).
#ifdef PRNN_WIDENED_FROM
static_assert(PRNN_WEIGHT_DTYPE == 0, "PRNN_WIDENED_FROM: an fp32 tile of a 16-bit layer");
using WeightSource = unsigned;
constexpr int kSourcePerWord = 2;  // values a WeightSource word holds
PRNN_DEVICE WeightWord source_word(const WeightSource* m, size_t row, int c, int k_len) {
  return prnn_pair_element<PRNN_WIDENED_FROM>(m, row, c, k_len);
}
#else
using WeightSource = WeightWord;
constexpr int kSourcePerWord = kPerWord;
PRNN_DEVICE WeightWord source_word(const WeightSource* m, size_t row, int k, int k_len) {
  return m[row * ((k_len + kPerWord - 1) / kPerWord) + k];
}
#endif
// Whether the matrix loop reads the exchanged vector straight from the tagged words (a cluster:
// they are in this CTA's shared memory) instead of a staged copy. Each warp then waits for the
// words it multiplies, and a step needs one block barrier (the partial sums', which also carries
// the timeout vote) instead of two: no gather, no staging barrier. The partial sums alternate
// between two buffers by step parity, as a warp may start step t+1's product while the
// pointwise step t still reads step t's sums (it has read all of step t's words, so every CTA
// has published step t, but not that every thread of its own CTA has finished).
#ifdef PRNN_CLUSTER
constexpr bool kDirectRead = true;
#else
constexpr bool kDirectRead = false;
#endif

// The step a launch starts from: `start`, or for a resume launch of the device-side chain
// (persistent_rnn/launch.py, device_loop.cu: start == kResumeFromChain) the step prnn_settle wrote
// after the control words. A launch whose start is the pass's end exits at once.
constexpr int kResumeFromChain = -2147483647 - 1;
PRNN_DEVICE int launch_start(const unsigned* control, int start) {
  return start != kResumeFromChain ? start : reinterpret_cast<const int*>(control)[2 + gridDim.x];
}

// Whether a tile's lanes take their columns word by word (TileOf::kSpan = kPerWord), as a
// cluster's direct read needs: in a cluster, and in a kernel that must sum as a cluster kernel
// does without being launched as one (-D PRNN_WORD_SPAN=1: the resident decoder's build of a
// cluster tile, resident_decoder.cu).
#ifndef PRNN_WORD_SPAN
#define PRNN_WORD_SPAN 0
#endif
constexpr bool kWordSpan = kDirectRead || PRNN_WORD_SPAN;

#ifndef PRNN_MMA  // an mma tile's chunk is 2 * PRNN_KPT k-steps of 16 columns: any KPT
static_assert(kKpt % kPerWord == 0, "16-bit tiles need an even PRNN_KPT");
#endif
constexpr int kWordsPerLane = kKpt / kPerWord;  // registers of weights per row and lane

// A register tile of kRows rows by kKpt columns per lane. A template (defaults: the -D tile) so
// that a kernel can hold two matrices of different shapes (the LSTM projection's W_hh and W_hr);
// its parameters hide the namespace constants of the same names, so the body reads the same.
template <int kRows = PRNN_ROWS, int kKpt = PRNN_KPT>
struct TileOf {
  static constexpr int kRowsPow2 = pow2_at_least(kRows);
  static constexpr int kLanesPerRow = kWarp / kRowsPow2;  // lanes that end with the same row's sum
  static constexpr int kWordsPerLane = kKpt / kPerWord;
  static constexpr int kRowCount = kRows;
  static constexpr int kChunk = kWarp * kKpt;  // columns per warp
  static_assert(kRowsPow2 <= kWarp, "at most 32 rows per warp");
  static_assert(kKpt % kPerWord == 0, "16-bit tiles need an even kpt");
  // Columns a lane takes from the staged vector at once (its "span"): an fp32 tile whose lanes
  // hold a multiple of 4 columns takes them as 16-byte quads, one shared load per 4 columns
  // instead of 4 (a cluster's direct read polls word by word: kPerWord). Lane l holds columns
  // kSpan * (l + 32 a) + e of the chunk, span a < kSpans, e < kSpan: a warp's load of span a
  // covers 32 * kSpan contiguous columns, free of bank conflicts.
  static constexpr int kSpan = kPerWord == 1 && kKpt % 4 == 0 && !kWordSpan ? 4 : kPerWord;
  static constexpr int kSpans = kKpt / kSpan;
  static constexpr int kSpanWords = kSpan / kPerWord;  // weight registers per row and span
  WeightWord w[kRows][kWordsPerLane];  // w[r][a * kSpanWords + j]: span a's word j

  // The reduce-scatter's halving levels, k = 0 (lane bit 16) to kLevels - 1: level k takes the
  // level_rows(k) rows a lane holds to level_half(k) (the lanes with the level's bit keep the
  // rows from level_half(k) on and a padding row when level_rows(k) is odd: a sum nobody reads).
  // A level is permuted when it and every level above it split their rows evenly (all of them
  // when kRows is a power of 2).
  static constexpr int kLevels = log2_of(kRowsPow2);
  PRNN_HD static constexpr int level_rows(int k) { return k == 0 ? kRows : (level_rows(k - 1) + 1) / 2; }
  PRNN_HD static constexpr int level_half(int k) { return (level_rows(k) + 1) / 2; }
  PRNN_HD static constexpr bool level_permuted(int k) {
    return level_rows(k) == 2 * level_half(k) && (k == 0 || level_permuted(k - 1));
  }
  PRNN_HD static constexpr int level_lane_bit(int k) { return kWarp / 2 >> k; }

  // The row whose sum `multiply` leaves in `lane`, or -1 where it is a padding row's (call with
  // the lane only; the level functions are evaluated at compile time: they are recursive).
  template <int k = 0>
  PRNN_DEVICE static int row_of(int lane, int row = 0, int count = kRows) {
    if constexpr (k < kLevels) {
      constexpr int half = level_half(k), off = level_lane_bit(k);
      const bool upper = (lane & off) != 0;
      return row_of<k + 1>(lane, upper ? row + half : row,
                           upper ? count - half : count < half ? count : half);
    } else {
      return count >= 1 ? row : -1;
    }
  }

  // rows[r]: row of M for the warp's r-th row, or -1 for a row past the matrix (held as zeros);
  // col0: the warp's first column (a multiple of kPerWord); k_len: M's columns (rows are padded to
  // a multiple of kPerWord).
  PRNN_DEVICE void load(const WeightSource* m, const int (&rows)[kRows], int col0, int k_len,
                        int lane) {
    const int row_words = (k_len + kPerWord - 1) / kPerWord;
    // held[s]: the row register slot s holds in this lane (permute_rows).
    int held[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) held[r] = rows[r];
    permute_rows<0>(held, lane);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int i = 0; i < kWordsPerLane; ++i) {
        const int span = i / kSpanWords;  // word i % kSpanWords of the lane's span
        const int k = col0 / kPerWord + kSpanWords * (lane + kWarp * span) + i % kSpanWords;
        w[r][i] = (held[r] >= 0 && k < row_words) ? source_word(m, held[r], k, k_len) : WeightWord(0);
      }
    }
  }

  // Multiplies by the staged chunk v; returns the sum over the warp's columns of row
  // row_of(lane) (a reduce-scatter: each halving level sends half the rows to the partner lane,
  // so kRows rows cost about kRows + log2(kLanesPerRow) shuffles, not 5*kRows).
  PRNN_DEVICE float multiply(const float* v, int lane) const {
    return multiply_values([v, lane](int a, float (&x)[kSpan]) {
      load_staged(v + kSpan * (lane + kWarp * a), x);
    }, lane);
  }

  // The same with the lane's values of the chunk given by value(a, x): x = the kSpan values at
  // chunk columns kSpan * (lane + 32 a) (a a compile-time index once unrolled).
  template <class Value>
  PRNN_DEVICE float multiply_values(Value value, int lane) const {
    float a[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) a[r] = 0.0f;
#pragma unroll
    for (int sp = 0; sp < kSpans; ++sp) {
      float x[kSpan];
      value(sp, x);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int j = 0; j < kSpanWords; ++j) {
          float f[kPerWord];
          unpack_word(w[r][sp * kSpanWords + j], f);
#pragma unroll
          for (int e = 0; e < kPerWord; ++e) a[r] += f[e] * x[j * kPerWord + e];
        }
      }
    }
    reduce_scatter<0>(a, lane);
    return sum_lanes<kLanesPerRow / 2>(a[0]);
  }

 private:
  // One halving level of the reduce-scatter (level k: n rows to `half`), then the next. Every
  // lane adds what its partner sends into slot j < half, so every index into `a` is a
  // compile-time constant (a run-time index puts `a` in local memory). The lane with the level's
  // bit keeps rows half.. (slot j + half) and sends rows ..half-1 (slot j), its partner the
  // reverse:
  // * at a permuted level the lane's registers hold them the other way round already
  //   (permute_rows): both send slot j + half and keep slot j, no select;
  // * where j + half is past n (n odd), the lower lane needs its partner's row j and the upper
  //   lane's slot j becomes the padding row: both send and keep slot j;
  // * otherwise two selects choose what a lane keeps and sends.
  template <int k>
  PRNN_DEVICE static void reduce_scatter(float (&a)[kRows], int lane) {
    if constexpr (k < kLevels) {
      constexpr int n = level_rows(k), half = level_half(k), off = level_lane_bit(k);
      constexpr bool permuted = level_permuted(k);
      const bool upper = (lane & off) != 0;
#pragma unroll
      for (int j = 0; j < half; ++j) {
        const int p = j + half < n ? j + half : j;
        const bool swap = !permuted && p != j && upper;
        const float keep = swap ? a[p] : a[j];
        const float send = swap ? a[j] : a[p];
        a[j] = keep + prnn_shfl_xor(send, off);
      }
      reduce_scatter<k + 1>(a, lane);
    }
  }
  // Lays out the rows for the permuted levels from k down: a lane with level k's bit holds row
  // j + half in slot j and row j in slot j + half (j < half), within every block of level_rows(k)
  // slots (the levels above split evenly: each block is the rows one lane of a level above keeps
  // or sends), so that what a lane sends at level k sits where its partner keeps the same row.
  template <int k>
  PRNN_DEVICE static void permute_rows(int (&held)[kRows], int lane) {
    if constexpr (k < kLevels && level_permuted(k)) {
      constexpr int n = level_rows(k), half = level_half(k), off = level_lane_bit(k);
      if (lane & off) {
#pragma unroll
        for (int s = 0; s < kRows; ++s) {
          if (s % n < half) {
            const int t = held[s];
            held[s] = held[s + half];
            held[s + half] = t;
          }
        }
      }
      permute_rows<k + 1>(held, lane);
    }
  }
  // The butterfly sum over the kLanesPerRow lanes that hold the same row.
  template <int off>
  PRNN_DEVICE static float sum_lanes(float s) {
    if constexpr (off >= 1) {
      return sum_lanes<off / 2>(s + prnn_shfl_xor(s, off));
    } else {
      return s;
    }
  }
};
#ifdef PRNN_MMA
using RegisterTile = MmaTile;
#else
using RegisterTile = TileOf<>;
#endif

// Row group and column chunk of this thread's warp.
PRNN_DEVICE int warp_row_group() { return (int)(threadIdx.x / kWarp) / kKsplit; }
PRNN_DEVICE int warp_chunk() { return (int)(threadIdx.x / kWarp) % kKsplit; }

// Waits for this thread's asynchronous copies, then makes every thread's visible to the block.
PRNN_DEVICE void finish_copies() {
  prnn_copy_wait();
  prnn_sync_block();
}

// Stages `batch` vectors of length k_len (row stride k_len; written by an earlier launch or the
// host, read through L2 only) into v_s, zero-padded to kPadded each, as the exchange delivers
// them (prnn_exchange_value: a restarted launch's first step multiplies by exactly the values the
// gather gave the step it replays): the first step of a launch. When rows are 16-byte aligned the
// copies are asynchronous (no registers, all in flight at once): staging is one L2 round trip per
// step rather than one per element a thread stages. No block barrier (stage_exchanged's).
PRNN_DEVICE void stage_rows(float* v_s, const float* src, int batch, int k_len) {
  constexpr int kQuads = kPadded / 4;
  const bool async = k_len % 4 == 0 && ((size_t)src & 15) == 0;
  for (int idx = threadIdx.x; idx < batch * kQuads; idx += blockDim.x) {
    const int b = idx / kQuads, k = 4 * (idx % kQuads);
    float* dst = v_s + b * kPadded + k;
    for (int e = 0; e < 4; ++e) {
      if (k + e >= k_len) dst[e] = 0.0f;
      else if (!async) dst[e] = prnn_load_cg(src + (size_t)b * k_len + k + e);
    }
    if (async && k < k_len) prnn_copy16_to_shared(dst, src + (size_t)b * k_len + k);
  }
  prnn_copy_wait();  // this thread's copies: it rounds the quads it staged
  for (int idx = threadIdx.x; idx < batch * kQuads; idx += blockDim.x) {
    float* dst = v_s + idx / kQuads * kPadded + 4 * (idx % kQuads);
    for (int e = 0; e < 4; ++e) dst[e] = prnn_exchange_value(dst[e]);
  }
}

// stage_rows, then a block barrier that makes the staged rows visible.
PRNN_DEVICE void stage_exchanged(float* v_s, const float* src, int batch, int k_len) {
  stage_rows(v_s, src, batch, k_len);
  prnn_sync_block();
}

// Batch groups (-D PRNN_BATCH_GROUP, plan.batch_group; docs/design.md, "Tensor-core tiles"):
// where a grid pass's staged vector for the whole batch does not fit shared memory, it holds a
// group of kBatchGroup batch rows (a multiple of 8: whole n-tiles), and a step multiplies group
// after group: the gather after the pointwise step fetches the first group's rows, and each
// further group's rows are gathered (a launch's first step: staged from its source) into the
// same buffer once every warp has multiplied the group before, between two block barriers. The
// partial sums stay sized for the whole batch. 0 (the default): the whole batch at once.
#ifndef PRNN_BATCH_GROUP
#define PRNN_BATCH_GROUP 0
#endif
constexpr int kBatchGroup = PRNN_BATCH_GROUP;
static_assert(kBatchGroup % 8 == 0 && kBatchGroup >= 0, "batch groups of whole n-tiles");
#if PRNN_BATCH_GROUP && defined(PRNN_CLUSTER)
#error "PRNN_BATCH_GROUP: a cluster reads the exchange in place, it stages no vector"
#endif

// Batch rows the staged vector holds at once: the batch, or a group.
PRNN_DEVICE int staged_rows(int batch) {
  return kBatchGroup > 0 && kBatchGroup < batch ? kBatchGroup : batch;
}

// The staged vector's region of `words` (plan.shared_layout's STAGED, PRNN_SMEM_STAGED: words per
// batch row, or with batch groups in all).
PRNN_DEVICE float* staged_region(SharedCarver& sh, int words) {
  return kBatchGroup > 0 ? sh.fixed(words) : sh.rows(words);
}

// Tagged quads a thread of the grid's gather loads at once (four registers each): chosen by the
// planner (persistent_rnn/plan.py: gather_quads for the layer kernels, stack_gather_quads for
// the stack kernels) from the quads a thread gathers per step and the registers the weights
// leave. A cluster has no gather (kDirectRead): it leaves it undefined.
#ifdef PRNN_GATHER_QUADS
constexpr int kGatherQuads = PRNN_GATHER_QUADS;
#else
constexpr int kGatherQuads = 0;  // ExchangeOf::gather refuses it, should a gather be compiled
#endif

// How long a thread with no pointwise work (thread index >= batch * kUnits in both kernels)
// sleeps before its first poll: it reaches the gather while the other CTAs are still in their
// pointwise step, so its first polls would only miss and load L2. Not measured on a GPU: about
// one pointwise step of the large tiles.
constexpr unsigned kIdleStartNs = 200;

// The vector every CTA needs each step (forward h_t, backward dgh_t: k_len values per batch row),
// exchanged as tagged words (exchange.cuh), step t tagged prnn_step_tag(t), in [2][batch][Padded] by
// step parity (Padded: the staged vector's row stride, kPadded but for the LSTM projection's
// second tile): the staged vector's layout, so that word i of a step lands at v_s[i] with no index
// arithmetic. The first k_len words of a row are published.
// * grid: one buffer in global memory, zeroed by the host before every launch that uses it; a
//   row is rounded up to whole quads with zeros by the writer of the row's last value, so that a
//   reader polls whole quads; the rest of a row is never written nor read;
// * cluster (-DPRNN_CLUSTER=grid size, sm_90): a copy in each CTA's shared memory, zeroed at launch
//   start, which every CTA stores its values into (distributed shared memory): a lane polls the
//   words it multiplies in its own shared memory instead of L2, those past k_len never (zeros).
// Either way the words a CTA waits for are the barrier: there is no other per-step synchronisation.
template <int Padded = kPadded>
struct ExchangeOf {
  unsigned* words;
  PrnnTaggedRows<Padded> rows;
  int k_len;
  bool idle;  // this thread has no pointwise work: it sleeps before its first poll

  PRNN_DEVICE size_t slot() const { return (size_t)rows.quads * 4; }

  // Publishes value k of batch row b for step t (the grid: and the zeros that end the row's last
  // quad; a cluster's lanes wait for the words below k_len only, wait_lane).
  PRNN_DEVICE void publish(int t, int b, int k, float v) const {
    unsigned* word = words + (t & 1) * slot() + b * Padded + k;
#ifdef PRNN_CLUSTER
    store(word, prnn_tagged(v, prnn_step_tag(t)));
#else
    prnn_publish(word, k, k_len, v, prnn_step_tag(t), store);
#endif
  }

  // Waits for step t's values and writes them into v_s (row stride Padded; the zero padding past
  // k_len was written once at launch start, and the padding words write zeros). False on
  // timeout or abort. The caller's next block barrier makes v_s visible to the block. The grid's
  // (global words); a cluster's warps read their words where they are (wait_lane).
  // With batch groups (kBatchGroup), the rows of the group from batch row r0 alone, into v_s's
  // first rows; only the first group's gather (r0 0, after the pointwise step) lets idle threads
  // sleep.
  PRNN_DEVICE bool gather(float* v_s, int t, PrnnControl* ctl, unsigned long long timeout_ns,
                          int r0 = 0) const {
    const auto sink = [v_s](int word, const float (&v)[4]) { prnn_store_shared_quad(v_s + word, v); };
    static_assert(kGatherQuads > 0 || Padded < 0, "a grid kernel needs -DPRNN_GATHER_QUADS "
                  "(persistent_rnn/plan.py, gather_quads)");
    const unsigned* src = words + (t & 1) * slot();
    if (idle && r0 == 0) prnn_sleep_ns(kIdleStartNs);
    if constexpr (kBatchGroup > 0) {
      const int batch = rows.quads * 4 / Padded;
      const PrnnTaggedRows<Padded> group{staged_rows(batch - r0) * Padded / 4, rows.row_len};
      return prnn_gather_tagged<kGatherQuads>(src + (size_t)r0 * Padded, group, prnn_step_tag(t),
                                              kThreads, ctl, timeout_ns, PrnnGlobalQuads{}, sink);
    }
    return prnn_gather_tagged<kGatherQuads>(src, rows, prnn_step_tag(t), kThreads, ctl, timeout_ns,
                                            PrnnGlobalQuads{}, sink);
  }

#ifdef PRNN_CLUSTER
  // Writes step s's vector from src ([batch][k_len], written by an earlier launch or the host)
  // into this CTA's words of step s, tagged as if published, zeros past k_len: a launch's first
  // step reads it like any other (kDirectRead). The caller's block barrier makes it visible.
  PRNN_DEVICE void fill(int s, const float* src, int batch) const {
    unsigned* dst = words + (s & 1) * slot();
    for (int idx = threadIdx.x; idx < batch * Padded; idx += blockDim.x) {
      const int b = idx / Padded, k = idx % Padded;
      const float v = k < k_len ? prnn_load_cg(src + (size_t)b * k_len + k) : 0.0f;
      // (relaxed, like the other CTAs' stores into these words two steps on)
      prnn_store_shared_relaxed_u32(dst + idx, prnn_tagged(v, prnn_step_tag(s)));
    }
  }

  // Waits until the words of step s that this lane multiplies (batch row b, columns
  // col0 + kPerWord * (lane + 32 i) + e) carry step s's tag, and returns their values in x[i][e].
  // Words past k_len are never published in a cluster (publish): zeros since the launch started
  // (zeroed, or filled as zeros), not waited for. All of a lane's
  // words are loaded at once and reloaded together on a miss. False on timeout or abort, or at
  // once if they are not there and `give_up` (an earlier wait of the step failed): x then holds
  // whatever the words held (the step is discarded).
  template <int kWords>
  PRNN_DEVICE bool wait_lane(int s, int b, int col0, int lane, float (&x)[kWords][kPerWord],
                             bool give_up, PrnnControl* ctl, unsigned long long timeout_ns) const {
    const PrnnSharedWord mine =
        prnn_shared_word(words + (s & 1) * slot() + b * Padded + col0 + kPerWord * lane);
    const int published = k_len - col0 - kPerWord * lane;  // words of `mine` published
    const unsigned tag = prnn_step_tag(s);
    constexpr int k = kPerWord * kWarp;  // word i's offset from `mine`: k * i + e
    // Every word of the lane published (H a multiple of the chunk, as at the tile's largest H):
    // the tags are checked without bounds, one instruction per word.
    const bool whole = published >= k * kWords;
    unsigned w[kWords][kPerWord];
    PrnnWait wait{0u, 0ull};
    bool ready;
    for (;;) {
      unsigned miss = 0u;  // the tag bits of a word whose tag differs from `tag` are not zero
#pragma unroll
      for (int i = 0; i < kWords; ++i) {
        if constexpr (kPerWord == 2) {
          prnn_load_shared_relaxed_u32x2(prnn_shared_at(mine, k * i), w[i][0], w[i][1]);
        } else {
          w[i][0] = prnn_load_shared_relaxed_u32(prnn_shared_at(mine, k * i));
        }
      }
      if (whole) {
#pragma unroll
        for (int i = 0; i < kWords; ++i) {
#pragma unroll
          for (int e = 0; e < kPerWord; ++e) miss |= w[i][e] ^ tag;
        }
      } else {
#pragma unroll
        for (int i = 0; i < kWords; ++i) {
#pragma unroll
          for (int e = 0; e < kPerWord; ++e) miss |= k * i + e < published ? w[i][e] ^ tag : 0u;
        }
      }
      ready = prnn_tag_of(miss) == 0u;
      if (ready || give_up || !prnn_keep_polling<PrnnClusterWait>(ctl, wait, timeout_ns)) break;
    }
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
#pragma unroll
      for (int e = 0; e < kPerWord; ++e) x[i][e] = prnn_value_of(w[i][e]);
    }
    return ready;
  }
#endif

 private:
  PRNN_DEVICE static void store(unsigned* word, unsigned tagged) {
#ifdef PRNN_CLUSTER
    for (int cta = 0; cta < PRNN_CLUSTER; ++cta) prnn_store_cluster_u32(word, cta, tagged);
#else
    prnn_store_relaxed(word, tagged);
#endif
  }
};
using Exchange = ExchangeOf<>;

// The exchange of a launch, rows of Padded words (the staged vector's row stride; default the
// -D tile's). `global`: the host's buffer (grid); `sh`: the kernel's shared memory, carved up to
// here, whose next region (EXCHANGE, plan.shared_layout; kSecondRegion: EXCHANGE_B, the LSTM
// projection's exchange of its second tile, plan.projection_shared_layout) a cluster keeps its
// copy of the words in. In a cluster every CTA zeroes its copy, then the cluster meets once, so
// no store can land before the zeroing. `busy`: the threads with pointwise work before this
// exchange's gather (default batch * kUnits). Every thread calls it.
template <int Padded = kPadded, bool kSecondRegion = false>
PRNN_DEVICE ExchangeOf<Padded> begin_exchange(unsigned* global, SharedCarver& sh, int batch,
                                              int k_len, int busy = -1) {
  if (busy < 0) busy = batch * kUnits;
  ExchangeOf<Padded> x{global, {batch * Padded / 4, exchange_row_words(k_len)}, k_len,
                       (int)threadIdx.x >= busy};
#ifdef PRNN_CLUSTER
  if constexpr (kSecondRegion) {
#ifdef PRNN_SMEM_EXCHANGE_B
    x.words = sh.aligned_rows<unsigned>(PRNN_SMEM_EXCHANGE_B, PRNN_SMEM_EXCHANGE_B_ALIGN);
#else
    static_assert(!kSecondRegion, "a second exchange needs -D PRNN_SMEM_EXCHANGE_B");
#endif
  } else {
    x.words = sh.aligned_rows<unsigned>(PRNN_SMEM_EXCHANGE, PRNN_SMEM_EXCHANGE_ALIGN);
  }
  for (size_t i = threadIdx.x; i < 2 * x.slot(); i += blockDim.x) x.words[i] = 0u;
  prnn_cluster_sync();
#endif
  return x;
}

// At the end of a launch (every thread): in a cluster no CTA may exit while another can still
// store into its shared memory, so the cluster meets again. Every CTA gets here: its waits are
// timed.
PRNN_DEVICE void end_exchange() {
#ifdef PRNN_CLUSTER
  prnn_cluster_sync();
#endif
}

// For every batch row, multiplies the tile by the staged vector (row stride `padded`); the
// partial sum of local row `row` over column chunk `c` goes to
// part_s[(b * ksplit + c) * local_rows + row]. Warp w holds row group w / ksplit, chunk w % ksplit
// (defaults: the -D tile). No barrier: the caller's makes the sums visible (multiply_batch).
template <class Tile = RegisterTile>
PRNN_DEVICE void multiply_rows(const Tile& tile, const float* v_s, float* part_s, int batch,
                               int local_rows, int ksplit = kKsplit, int padded = kPadded) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, chunk = warp % ksplit;
  const int row = Tile::row_of(lane);
  const bool writer = lane % Tile::kLanesPerRow == 0 && row >= 0;
  for (int b = 0; b < batch; ++b) {
    const float sum = tile.multiply(v_s + b * padded + chunk * Tile::kChunk, lane);
    if (writer) part_s[(b * ksplit + chunk) * local_rows + warp / ksplit * Tile::kRowCount + row] = sum;
  }
}

// multiply_rows, then a block barrier that makes the partial sums visible to every thread.
template <class Tile = RegisterTile>
PRNN_DEVICE void multiply_batch(const Tile& tile, const float* v_s, float* part_s, int batch,
                                int local_rows, int ksplit = kKsplit, int padded = kPadded) {
  multiply_rows(tile, v_s, part_s, batch, local_rows, ksplit, padded);
  prnn_sync_block();
}

#ifdef PRNN_CLUSTER
// multiply_batch for kDirectRead: for every batch row, waits for this lane's words of step s in
// the exchange, multiplies, and stores the partial sums as multiply_batch does. Returns whether
// this thread's wait failed (timeout or abort); the caller's barrier (its team's, Team) makes the
// sums visible and votes.
template <class Tile = RegisterTile, int Padded = kPadded>
PRNN_DEVICE int multiply_exchanged(const Tile& tile, const ExchangeOf<Padded>& xch, int s,
                                   float* part_s, int batch, int local_rows, PrnnControl* ctl,
                                   unsigned long long timeout_ns, int ksplit = kKsplit) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, chunk = warp % ksplit;
  const int row = Tile::row_of(lane);
  const bool writer = lane % Tile::kLanesPerRow == 0 && row >= 0;
  static_assert(Tile::kSpan == kPerWord, "a direct read takes a lane's columns word by word");
  int failed = 0;
  for (int b = 0; b < batch; ++b) {
    float x[Tile::kWordsPerLane][kPerWord];  // after a failure: any values (every lane still
    // takes part in the product's shuffles)
    failed |= !xch.wait_lane(s, b, chunk * Tile::kChunk, lane, x, failed, ctl, timeout_ns);
    const float sum = tile.multiply_values([&x](int i, float (&v)[kPerWord]) {
#pragma unroll
      for (int e = 0; e < kPerWord; ++e) v[e] = x[i][e];
    }, lane);
    if (writer) part_s[(b * ksplit + chunk) * local_rows + warp / ksplit * Tile::kRowCount + row] = sum;
  }
  return failed;
}
#endif

// The threads that finish a step for a set of the CTA's units once the partial sums of those
// units' rows are complete (the pointwise step and the next step's prefetch), and the barrier
// that makes the sums visible to them: the whole CTA for all kUnits units (a block barrier), or
// each warp alone for its own units (a warp barrier, kWarpTeams) - then a cluster's step has no
// block barrier at all, and the grid's only the staged vector's. A team's loops over (batch row,
// unit) items give item i to its thread i % size, and unit unit0 + i % units.
struct Team {
  int thread;  // this thread's index in the team
  int size;    // threads in the team
  int unit0;   // the team's first unit (CTA-local)
  int units;   // units the team finishes
  int row0;    // the team's first local row of the tile (the partial sums' rows)

  // Local row r of the tile (warp_row_group() * kRows + r') as (gate, CTA-local unit): a team's
  // rows are gate-major over its units.
  PRNN_DEVICE int gate_of(int local) const { return (local - row0) / units; }
  PRNN_DEVICE int unit_of(int local) const { return unit0 + (local - row0) % units; }
  // The local row of (gate g, CTA-local unit u).
  PRNN_DEVICE int row_of(int g, int u) const { return row0 + g * units + u - unit0; }
};

// Whether each warp finishes its own units (-D PRNN_WARP_TEAMS, the planner's plan.warp_teams):
// a forward whose warps hold all G gate rows of their units over all of K (PRNN_KSPLIT 1). In a
// cluster a warp then depends on the other warps only through the exchange; on the grid the step
// keeps one block barrier, the staged vector's (with the timeout vote), and the staged vector
// alternates between two buffers by step parity (-D PRNN_STAGED_BUFFERS 2, plan.staged_buffers),
// as a warp may gather step t while another still multiplies step t-1's. Both are the layer
// forward's (persistent_forward.cu); other kernels take the defaults.
#ifndef PRNN_WARP_TEAMS
#define PRNN_WARP_TEAMS 0
#endif
#ifndef PRNN_STAGED_BUFFERS
#define PRNN_STAGED_BUFFERS 1
#endif
// The layer passes' buffers of their pointwise inputs by step (the forward's gi, the backward's
// dy, h, c, saved; -D PRNN_INPUT_BUFFERS, plan.input_buffers): two, and step t fetches the next
// step's; three (plan.CLUSTER_INPUTS_AHEAD 2, a cluster's only) fetch two steps on, after the
// step's product frees the buffer (step_product) - measured slower on an H200, so not the default.
#ifndef PRNN_INPUT_BUFFERS
#define PRNN_INPUT_BUFFERS 2
#endif
constexpr bool kWarpTeams = PRNN_WARP_TEAMS;
constexpr int kStagedBuffers = PRNN_STAGED_BUFFERS;
constexpr int kInputBuffers = PRNN_INPUT_BUFFERS;
static_assert(kBatchGroup == 0 || (kStagedBuffers == 1 && !kWarpTeams),
              "batch groups share one staged buffer, and the block's barriers");
static_assert(kInputBuffers == 2 || kInputBuffers == 3, "inputs one or two steps ahead");
constexpr int kInputsAhead = kInputBuffers - 1;  // steps fetched ahead of the step that reads them

// Step t's buffer of a layer pass's pointwise inputs in `base`, [kInputBuffers][batch][kRowWords].
template <int kRowWords, class T>
PRNN_DEVICE T* input_buffer(T* base, int t, int batch) {
  return base + (unsigned)t % kInputBuffers * batch * kRowWords;
}
// Ends one step's fetch of inputs: fetched two steps ahead, each step's copies are a commit
// group of their own (also an empty one where a step fetches nothing), so that
// wait_next_inputs can leave the newest in flight.
PRNN_DEVICE void end_input_fetch() {
  if (kInputsAhead > 1) prnn_copy_commit();
}
// At a step's end: the next step's inputs have landed (one step ahead: every copy of this
// thread, the gather's too; two steps ahead: every group but the newest).
PRNN_DEVICE void wait_next_inputs() {
  if (kInputsAhead == 1) {
    prnn_copy_wait();
  } else {
    prnn_copy_wait_prior();
  }
}

// What warp teams need of a tile of G gate rows per unit: each warp all G rows of whole units.
template <int G>
constexpr bool kWholeUnitsPerWarp = kKsplit == 1 && kRows % G == 0 && kRows / G * PRNN_WARPS == kUnits;

template <int G>
PRNN_DEVICE Team step_team() {
  static_assert(!kWarpTeams || kWholeUnitsPerWarp<G>, "PRNN_WARP_TEAMS on a tile without whole "
                "units per warp");
  if constexpr (kWarpTeams) {
    const int warp = threadIdx.x / kWarp;
    return {(int)threadIdx.x % kWarp, kWarp, warp * (kRows / G), kRows / G, warp * kRows};
  } else {
    return {(int)threadIdx.x, (int)blockDim.x, 0, kUnits, 0};
  }
}

// The team's barrier (a warp's where kWarpTeam): returns whether `pred` was non-zero in any of
// its threads.
template <bool kWarpTeam>
PRNN_DEVICE int team_sync_or(int pred) {
  if constexpr (kWarpTeam) {
    return prnn_sync_warp_or(pred);
  } else {
    return prnn_sync_block_or(pred);
  }
}

// The last step every thread of the CTA completed, from each thread's `t` (warp teams may stop at
// different steps); `slots`: a word per warp that only this thread's warp reads or writes until
// every warp is here. Every thread calls it; thread 0 gets the result.
template <bool kWarpTeam>
PRNN_DEVICE int cta_last_step(int t, int* slots) {
  if constexpr (kWarpTeam) {
    const int warp = threadIdx.x / kWarp;
    if (threadIdx.x % kWarp == 0) slots[warp * kRows] = t;
    prnn_sync_block();
    for (int w = 0; w < PRNN_WARPS; ++w) t = slots[w * kRows] < t ? slots[w * kRows] : t;
  }
  return t;
}

// The steps of the persistent forward and backward, on either exchange (kDirectRead or a staged
// copy), so that the kernels read the same on both.
//
// Before the first step: the vector of step s (src: [batch][k_len], from an earlier launch or
// the host; nullptr: none, the backward's step T-1) - a cluster writes it into its words of step
// s, the grid stages it into v_s (zeros for nullptr; with batch groups the first group's rows,
// step_product stages the others) - then this thread's copies are waited for and a block barrier
// makes it all visible.
PRNN_DEVICE void begin_steps(const Exchange& xch, float* v_s, int s, const float* src, int batch) {
#ifdef PRNN_CLUSTER
  if (src != nullptr) xch.fill(s, src, batch);
  finish_copies();
#else
  if (src != nullptr) {
    stage_exchanged(v_s, src, staged_rows(batch), xch.k_len);
  } else {  // later gathers rely on the zero padding
    const int words = staged_rows(batch) * kPadded;
    for (int idx = threadIdx.x; idx < words; idx += blockDim.x) v_s[idx] = 0.0f;
    finish_copies();
  }
#endif
}

// Where step t's partial sums go: a cluster alternates between part_s and the staging buffer v_s
// (unused there) by step parity (kDirectRead); the grid uses part_s.
PRNN_DEVICE float* step_partials(int t, float* part_s, float* v_s) {
  return kDirectRead && (t & 1) ? v_s : part_s;
}

// With batch groups (kBatchGroup), the grid's product of step s group by group: the first
// group's rows are staged in v_s (the gather after the previous step, or begin_steps); each
// further group's are fetched into v_s once every warp has multiplied the group before - gathered
// from the exchange, or at a launch's first step (`first`: step s's vector [batch][k_len], else
// nullptr) staged as begin_steps does -, between two block barriers. Returns true when any
// thread's wait failed (the step is not done); its copies have landed then (the kernel exits).
template <class Tile, int Padded>
PRNN_DEVICE bool multiply_groups(const Tile& tile, const ExchangeOf<Padded>& xch, int s,
                                 float* v_s, float* part_s, int batch, int local_rows,
                                 const float* first, PrnnControl* ctl,
                                 unsigned long long timeout_ns) {
  for (int r0 = 0;;) {
    const int rows = staged_rows(batch - r0);
    multiply_rows(tile, v_s, part_s + r0 * kKsplit * local_rows, rows, local_rows);
    r0 += kBatchGroup;
    if (r0 >= batch) return false;
    prnn_sync_block();  // every warp has read the group's rows: v_s is free
    int failed = 0;
    if (first != nullptr) {
      stage_rows(v_s, first + (size_t)r0 * xch.k_len, staged_rows(batch - r0), xch.k_len);
    } else {
      failed = !xch.gather(v_s, s, ctl, timeout_ns, r0);
    }
    if (prnn_sync_block_or(failed)) {
      prnn_copy_wait();  // the step's prefetch lands before the kernel exits
      return true;
    }
  }
}

// A step's product of the tile and the vector of step s, for `batch` rows (0: none) into
// part_s; ends with every thread past a block barrier (with kWarpTeam: its warp's barrier only,
// Team). `failed`: this thread's wait for the vector failed (grid: the gather after the previous
// step). Returns true when any thread's (a cluster's kWarpTeam: any lane's) wait failed: the step
// is not done and the kernel (a cluster's warp team: the warp) must stop. prefetch() runs between
// the barrier that settles that and the product (grid) or after the product's barrier (cluster),
// where the buffer it refills has been read by every thread that reads it. `first`: the step's
// vector where it is a launch's first (begin_steps' src), else nullptr (batch groups: the
// further groups' rows are staged from it).
template <bool kWarpTeam = false, class Prefetch>
PRNN_DEVICE bool step_product(const RegisterTile& tile, const Exchange& xch, int s, float* v_s,
                              float* part_s, int batch, int local_rows, int failed,
                              PrnnControl* ctl, unsigned long long timeout_ns, Prefetch prefetch,
                              const float* first = nullptr) {
#ifdef PRNN_CLUSTER
  failed = multiply_exchanged(tile, xch, s, part_s, batch, local_rows, ctl, timeout_ns);
  if (team_sync_or<kWarpTeam>(failed)) return true;
  prefetch();
#else
  if (prnn_sync_block_or(failed)) return true;  // the staged vector visible, and the vote
  prefetch();
  if constexpr (kBatchGroup > 0) {
    if (multiply_groups(tile, xch, s, v_s, part_s, batch, local_rows, first, ctl, timeout_ns)) {
      return true;
    }
  } else {
    multiply_rows(tile, v_s, part_s, batch, local_rows);
  }
  team_sync_or<kWarpTeam>(0);  // the sums visible to the team that finishes them
#endif
  return false;
}

// After a step's pointwise (which published step t): the grid gathers step t into v_s and
// returns whether this thread's wait failed; a cluster has nothing to do (its warps read the
// words in the next product). A template, so that only the kernels that call it build a gather.
template <int Padded>
PRNN_DEVICE int end_step(const ExchangeOf<Padded>& xch, float* v_s, int t, PrnnControl* ctl,
                         unsigned long long timeout_ns) {
#ifdef PRNN_CLUSTER
  return 0;
#else
  return !xch.gather(v_s, t, ctl, timeout_ns);
#endif
}

// The full sum of local row `row` for batch row `b` (the Ksplit partial sums, in fixed order);
// with First/Last, the sum over column chunks First..Last-1 only (the stack kernels keep the two
// halves of their columns apart).
template <int Ksplit = kKsplit, int First = 0, int Last = Ksplit>
PRNN_DEVICE float row_sum(const float* part_s, int b, int row, int local_rows) {
  float s = 0.0f;
#pragma unroll
  for (int c = First; c < Last; ++c) s += part_s[(b * Ksplit + c) * local_rows + row];
  return s;
}


// A launch's control words (PrnnControl), once this CTA has noted that it started (the host's
// check that the grid was co-resident). The layer and projection kernels' first act after
// their start step.
PRNN_DEVICE PrnnControl* started_launch(unsigned* control) {
  PrnnControl* ctl = reinterpret_cast<PrnnControl*>(control);
  prnn_note_started(ctl);
  return ctl;
}

// Copies the CTA's rows g * hidden + j0 + u of src (g < groups, u < kUnits, below `hidden`)
// into dst [groups][kUnits]: a pass's per-row constants (b_hh), read from shared memory at
// every step.
PRNN_DEVICE void load_owned_rows(float* dst, const float* src, int groups, int j0, int hidden) {
  for (int idx = threadIdx.x; idx < groups * kUnits; idx += blockDim.x) {
    const int j = j0 + idx % kUnits;
    if (j < hidden) dst[idx] = src[(idx / kUnits) * hidden + j];
  }
}

// The owned units' state before a launch's first step, into hp_s and (a cell with a cell
// state) c_s, [batch][kUnits]: step start-1's from y and cs ((T, B, H)), or at step 0 h0 and c0
// ((B, H); kH0 false: h zeros, a state nothing reads at the first step). The pointwise thread of
// (b, unit) is the same every step: it keeps that unit's state. (Indexed per element as the
// kernels' own loops were: planes selected first cost the LSTM H=1024 forward an instruction a
// step.)
template <bool kH0 = true>
PRNN_DEVICE void load_unit_state(float* hp_s, float* c_s, const float* y, const float* cs,
                                 const float* h0, const float* c0, int start, int batch,
                                 int hidden, int j0) {
  for (int idx = threadIdx.x; idx < batch * kUnits; idx += blockDim.x) {
    const int b = idx / kUnits, j = j0 + idx % kUnits;
    if (j >= hidden) continue;
    const size_t prev = ((size_t)(start - 1) * batch + b) * hidden + j, at0 = (size_t)b * hidden + j;
    hp_s[idx] = start > 0 ? y[prev] : kH0 ? h0[at0] : 0.0f;
    if (kHasC) c_s[idx] = start > 0 ? cs[prev] : c0[at0];
  }
}

// The forward's pointwise step t for the team's (batch row b, unit u) items (Team), once their
// partial sums are complete: gates(b, u, gi, gh) gives the G pre-activations' input and
// recurrent parts, the cell runs (state frozen past a length), and h_t - rounded to the 16-bit
// state where kRoundState (round_state) - is published (publish(b, j, h)) and stored with c_t
// and the saved activations into y, cs, saved ((T, B, H), (T, B, H), (T, B, S*H)); hp_s and c_s
// ([batch][kUnits], load_unit_state) keep the unit's state. Force-inlined: the callers'
// constants (the team, kRoundState) fold away.
template <bool kRoundState, class Gates, class Publish>
PRNN_DEVICE void forward_pointwise(const Team& team, int t, int batch, int hidden, int j0,
                                   const int* len_s, float* hp_s, float* c_s, float* y, float* cs,
                                   float* saved, Gates gates, Publish publish) {
  constexpr int G = ThisCell::G, S = ThisCell::S;
#pragma unroll 1  // a warp team's stride is a constant: no unrolled copies (one trip at small B)
  for (int idx = team.thread; idx < batch * team.units; idx += team.size) {
    const int b = idx / team.units, u = team.unit0 + idx % team.units, j = j0 + u;
    const int own = b * kUnits + u;  // (b, u) in c_s and hp_s
    if (j >= hidden) continue;
    const size_t row = (size_t)t * batch + b;
    float giv[G], ghv[G], sv[kSavedSlots];
    gates(b, u, giv, ghv);
    const float c_prev = kHasC ? c_s[own] : 0.0f;
    float h, c;
    cell_forward_masked<PRNN_CELL>(t < len_s[b], giv, ghv, hp_s[own], c_prev, h, c, sv);
    if (kRoundState) h = round_state(h);  // 16-bit layers: h_t is a 16-bit value (c_t stays fp32)
    publish(b, j, h);
    y[row * hidden + j] = hp_s[own] = h;
    if (kHasC) cs[row * hidden + j] = c_s[own] = c;
#pragma unroll
    for (int s = 0; s < S; ++s) saved[row * S * hidden + s * hidden + j] = sv[s];
  }
}

// forward_pointwise's gates of a layer kernel: gi_t staged [batch][G][kUnits], gh the sum of
// the team's partial sums (part_s, local_rows rows) + b_hh (bias_s [G][kUnits]).
PRNN_DEVICE auto staged_gates(const float* gi_t, const float* part_s, const float* bias_s,
                              const Team& team, int local_rows) {
  constexpr int G = ThisCell::G;
  return [=](int b, int u, float (&giv)[G], float (&ghv)[G]) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      giv[g] = gi_t[(b * G + g) * kUnits + u];
      ghv[g] = row_sum(part_s, b, team.row_of(g, u), local_rows) + bias_s[g * kUnits + u];
    }
  };
}

}  // namespace prnn
