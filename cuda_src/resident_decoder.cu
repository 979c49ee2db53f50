// resident_decoder.cu - the resident decoder (persistent_rnn/decoder.py): one layer-direction's
// W_hh stays in registers between single steps, and the kernel waits for each step's input.
//
// Two kernels on the same tile (the -D of the layer's forward on the grid, plan.py):
// * prnn_resident_decoder: launched once (and again after it went idle), on a stream of its own,
//   one launch for all the layers of a stack: its grid is the layers' grids side by side, CTA
//   n * slices + c being slice c of layer n (layer_weights: its operands in the stacked ones).
//   It loads its rows of W_hh into registers exactly as persistent_forward.cu does, then per
//   step waits - bounded by timeout_ns since its last step - for the step's post in its layer's
//   mailbox, computes its units of h_t (and c_t) and reports them done in its state word. Idle
//   past the deadline, it marks itself gone and exits.
// * prnn_decoder_step: one CTA of the same block, enqueued per step on the caller's stream (one
//   launch: the post and the wait, for every layer of a stack in turn). It posts the step, then
//   waits until each slice c (the units of resident CTA c) is done; a slice whose resident CTA
//   is gone it computes itself - loads that CTA's rows and runs the same step code - so a
//   step's result never depends on who computed it. One CTA: it fits beside any resident grids
//   smaller together than the GPU. A stack's layers share the tile (one build) and the resident
//   launch, each with its own mailbox, state words and fault word.
//
// A step is the forward's step (persistent_forward.cu) on the layer's tile: h_{t-1} staged as the
// exchange delivers it (stage_exchanged), the tile's product (multiply_rows), the partial sums
// in the same order (row_sum), b_hh and gi_t added, the cell's pointwise math
// (cell_forward_masked). A cluster tile is built as a grid (no PRNN_CLUSTER) with
// PRNN_WORD_SPAN, so that its lanes take their columns word by word as the cluster kernel's
// direct read does (the same sums). h_{t-1} comes from the caller each step (any state, not only
// the last output). Its half of the step, W_hh h_{t-1} + b_hh (recurrent_sums), a resident CTA
// computes ahead, between steps, from the layer's own last h' (keep: written by every step),
// once every slice has done the step before (the CTAs read each other's state words, nothing
// else); at the post it checks, bit for bit, that the caller's h_{t-1} is that h, and computes
// the half in the step where it is not (await_step, decoder_step).
//
// gi_t comes one of two ways, the post's mode: which of StepIo's x and gi is non-null (the
// step kernel's `project` flag picks which its pointer x_or_gi is):
// * x (decoder.step): each CTA projects its own rows, gi = x W_ih^T + b_ih for the G gates x
//   kUnits units it owns (project_rows): x staged in shared memory beside h_{t-1}, W_ih's rows
//   held in the resident CTA's shared memory (loaded once per launch: hold_w_ih) where the plan
//   fits them, else - and in a takeover - read from global memory (L2) every step; one warp
//   per 4 rows, its lanes' partial sums in column order and a butterfly - one fixed order, the
//   same in a resident CTA and a takeover, held or not. The whole step is then one launch; its
//   sums are not the sequence path's GEMM's.
// * gi (decoder.step_projected): the caller's projection, b_ih added where posted: bitwise the
//   sequence kernel's step on the same gi_t, h_{t-1}, c_{t-1}.
//
// Words (uint32, zeroed by the host: step 0 posted, every CTA gone at step 0 - see kGone), each
// layer's own (a stack's: the layers' side by side):
//   box[0]     the step posted last (1, 2, ...); box[1] the step a step kernel issued last (the
//              count lives here, not in a launch argument: a captured graph replays its launches
//              with their arguments); box[2 + 2i], box[3 + 2i]: pointer i of the step
//              (x, gi, h_prev, c_prev, h_out, c_out, b_ih: StepIo) as low and high words,
//              stored before box[0] is released
//   state[c]   (step << 2) | mode: the last step whose slice c is done, and who holds the slice:
//              kLive its resident CTA (it alone writes the word then), kGone nobody (the
//              resident CTA exited; the step kernel may take the slice, and a relaunched
//              resident CTA may revive it), kBusy a step kernel's CTA computing it
//   fault[0]   0, or the first step whose wait ran past its deadline (a resident CTA neither
//              finished nor left: the step's outputs are not written; the host raises)
#include "persistent_common.cuh"

#ifdef PRNN_EMULATION
// The emulation's count of resident steps that found their recurrent half computed ahead and
// used it ([0]) or recomputed it (the caller's h_{t-1} was not the layer's last h': [1]), for
// tests (read through ctypes); the GPU build has no such count.
extern "C" {
unsigned long long prnn_emu_decoder_ahead[2];
}
#endif

#ifdef PRNN_DECODER_PROBE
// The probe (-D PRNN_DECODER_PROBE: decoder.py's PROBE_ENV, bench/decoder_probe.py): the
// %globaltimer stamps (ns) of a one-layer decoder's step, stage by stage, one writer each, in
// row step % kProbeSteps of prnn_decoder_probe (the host zeroes it before a loop and reads it
// after: decoder.probe_rows, whose PROBE_WORDS names the words). A stage is stamped before the
// store that releases it, so that whoever acquires that store stamps later. A row's words: the
// step kernel's thread 0 (the step, its start, the post about to be released, every slice's
// done word seen - past the block barrier -, its end, its failed polls of its own slices'
// words), resident CTA 0's thread 0 (its wait for the post begun - after the ahead part -, the
// post seen and its failed polls, x and h staged, its warp's rows of gi projected, the CTA's gi
// and sums past their barrier, the pointwise step past the last barrier, its done word about
// to be released, and 1 where the step used the ahead part, 2 where it computed its recurrent
// half); at kProbeChain + w, the SM's clock (clock64) where word w is a stamp (intervals within
// one CTA in cycles: %globaltimer may tick far coarser); then each resident CTA c's post seen
// (kProbeCtaWords + c) and done word about to be released (kProbeCtaWords + kProbeCtas + c).
namespace prnn {
enum ProbeWord : int {
  kProbeStep, kProbeStart, kProbePosting, kProbeDoneSeen, kProbeEnd, kProbeDonePolls,
  kProbeWaitStart, kProbePostSeen, kProbePostPolls, kProbeStaged, kProbeProjected,
  kProbeGathered, kProbePointwise, kProbePublishing, kProbeAhead, kProbeChain = 16
};
constexpr int kProbeSteps = 256, kProbeCtas = 160, kProbeCtaWords = 2 * kProbeChain,
              kProbeRow = kProbeCtaWords + 2 * kProbeCtas;
}  // namespace prnn
extern "C" {
__device__ unsigned long long prnn_decoder_probe[prnn::kProbeSteps * prnn::kProbeRow];
}
#define PRNN_PROBE_ONLY(...) __VA_ARGS__
#else
#define PRNN_PROBE_ONLY(...)
#endif
// PRNN_DECODER_FREE_POLLS (an experiment: bench/decoder_probe.py --free-polls): the failed polls
// of a hand-off's wait (the post, every slice done) that poll again at once, before its thread
// sleeps between polls as the shipped kernels do after every one. Whether the sleep's wake-up
// lengthens the hand-offs (docs/design.md, "The resident decoder") is for a GPU to say.
#ifdef PRNN_DECODER_FREE_POLLS
#define PRNN_HANDOFF_BACKOFF(polls) \
  do {                              \
    if (++(polls) > PRNN_DECODER_FREE_POLLS) prnn_backoff(); \
  } while (0)
#else
#define PRNN_HANDOFF_BACKOFF(polls) prnn_backoff()
#endif

namespace prnn {

#ifdef PRNN_DECODER_PROBE
PRNN_DEVICE void probe_set(unsigned step, int word, unsigned long long value) {
  prnn_decoder_probe[(size_t)(step % kProbeSteps) * kProbeRow + word] = value;
}
PRNN_DEVICE unsigned long long probe_cycles() {
#ifdef PRNN_EMULATION
  return prnn_globaltimer_ns();  // (no SM clock: the emulation's timer)
#else
  return clock64();
#endif
}
// Stamp `word` of `step`: the time (`now`) and the SM's clock.
PRNN_DEVICE void probe_stamp(unsigned step, int word,
                             unsigned long long now = prnn_globaltimer_ns()) {
  probe_set(step, kProbeChain + word, probe_cycles());
  probe_set(step, word, now);
}

// Resident CTA blockIdx.x's stamp `word` (kProbePostSeen or kProbePublishing) of `step` (thread
// 0): in its own column, and for CTA 0 in the row's word too.
PRNN_DEVICE void probe_resident(unsigned step, int word) {
  const unsigned long long now = prnn_globaltimer_ns();
  const int column = kProbeCtaWords + (word == kProbePostSeen ? 0 : kProbeCtas);
  if (blockIdx.x < kProbeCtas) probe_set(step, column + blockIdx.x, now);
  if (blockIdx.x == 0) probe_stamp(step, word, now);
}
#endif

constexpr unsigned kLive = 0u, kGone = 1u, kBusy = 2u;
PRNN_HD constexpr unsigned decoder_word(unsigned step, unsigned mode) { return step << 2 | mode; }

// What a step reads and writes: x_t (B, input) or gi_t = x_t W_ih^T (B, G*H) - exactly one
// non-null (the post's mode, above) -, h_{t-1} and c_{t-1} (B, H), h_t and c_t (B, H) (c
// pointers unused without a cell state), b_ih (G*H) or nullptr. b_ih is added to the sum as one
// fp32 addition, as the sequence path's `gi += b_ih` after its GEMM; nullptr where the caller's
// gi holds the bias already (or the layer has none).
struct StepIo {
  const float* x;
  const float* gi;
  const float* h_prev;
  const float* c_prev;
  float* h_out;
  float* c_out;
  const float* b_ih;
};
constexpr int kIoPointers = 7;
constexpr int kIoWords = 2 * kIoPointers;  // StepIo as pairs of words

PRNN_DEVICE void io_to_words(const StepIo& io, unsigned* out, bool relaxed) {
  const void* p[kIoPointers] = {io.x, io.gi, io.h_prev, io.c_prev, io.h_out, io.c_out, io.b_ih};
  for (int i = 0; i < kIoPointers; ++i) {
    const unsigned long long v = (unsigned long long)(size_t)p[i];
    if (relaxed) {
      prnn_store_relaxed(out + 2 * i, (unsigned)v);
      prnn_store_relaxed(out + 2 * i + 1, (unsigned)(v >> 32));
    } else {
      out[2 * i] = (unsigned)v;
      out[2 * i + 1] = (unsigned)(v >> 32);
    }
  }
}

PRNN_DEVICE StepIo io_of_words(const unsigned* in, bool relaxed) {
  void* p[kIoPointers];
  for (int i = 0; i < kIoPointers; ++i) {
    const unsigned lo = relaxed ? prnn_load_relaxed(in + 2 * i) : in[2 * i];
    const unsigned hi = relaxed ? prnn_load_relaxed(in + 2 * i + 1) : in[2 * i + 1];
    p[i] = (void*)(size_t)((unsigned long long)hi << 32 | lo);
  }
  return {static_cast<const float*>(p[0]), static_cast<const float*>(p[1]),
          static_cast<const float*>(p[2]), static_cast<const float*>(p[3]),
          static_cast<float*>(p[4]), static_cast<float*>(p[5]), static_cast<const float*>(p[6])};
}

// A staged row of x: input_size floats padded to whole quads (16-byte rows in shared memory).
PRNN_HD constexpr int padded_input(int input) { return (input + 3) / 4 * 4; }

// Shared memory, in this order (persistent_rnn/decoder.py's shared_layout sizes it, the one place
// that does: -D PRNN_SMEM_<REGION>, shared_layout.cuh; x's row and W_ih's rows take their width
// from a launch argument):
//   h_s     [batch][kPadded]                  h_{t-1} staged (STAGED)
//   x_s     [batch][padded_input(input)]      x_t staged (a step of mode x)
//   part_s  [batch][kKsplit][G*kUnits]        the product's partial sums (PARTIAL; then each
//                                             row's W_hh h + b_hh in its chunk-0 slot)
//   gi_s    [batch][G*kUnits]                 the CTA's rows of gi_t (mode x) (GI)
//   word_s  16 words: thread 0's decisions and the posted pointers (WORDS)
//   w_s     [G*kUnits][input]                 the resident CTA's rows of W_ih, where the plan
//                                             holds them (hold_w_ih; the step kernel's shared
//                                             memory ends before w_s)
struct DecoderShared {
  float* h_s;
  float* x_s;
  float* part_s;
  float* gi_s;
  unsigned* word_s;
  float* w_s;
  PRNN_PROBE_ONLY(bool probe;)  // resident CTA 0: decoder_step stamps its stages (false: a takeover)
};

PRNN_DEVICE DecoderShared decoder_shared(int batch, int input) {
  SharedCarver sh(batch);
  float* h_s = sh.rows(PRNN_SMEM_STAGED);
  float* x_s = sh.rows(padded_input(input));
  float* part_s = sh.rows(PRNN_SMEM_PARTIAL);
  float* gi_s = sh.rows(PRNN_SMEM_GI);
  unsigned* word_s = sh.fixed<unsigned>(PRNN_SMEM_WORDS);
  return {h_s, x_s, part_s, gi_s, word_s, sh.fixed(ThisCell::G * kUnits * input)};
}

// Starts staging x (B, input) into x_s, zero-padded: asynchronous copies where the rows are
// 16-byte aligned. The caller's stage_exchanged waits for them (cp.async.wait_all: every copy of
// the thread) and its block barrier makes them visible.
PRNN_DEVICE void stage_input(float* x_s, const float* x, int batch, int input) {
  const int padded = padded_input(input), quads = padded / 4;
  const bool async = input % 4 == 0 && ((size_t)x & 15) == 0;
  for (int idx = threadIdx.x; idx < batch * quads; idx += blockDim.x) {
    const int b = idx / quads, k = 4 * (idx % quads);
    float* dst = x_s + b * padded + k;
    const float* src = x + (size_t)b * input + k;
    if (async) {
      prnn_copy16_to_shared(dst, src);
    } else {
      for (int e = 0; e < 4; ++e) dst[e] = k + e < input ? prnn_load_cg(src + e) : 0.0f;
    }
  }
}

constexpr int kProjBatch = 4;  // batch rows one pass over a W_ih row serves (decoder.PROJ_BATCH;
                               // 1 where the batch is 1)
constexpr int kProjRows = 4;   // W_ih rows one pass over x serves (decoder.PROJ_ROWS)

// The CTA's row `local` (gate g, unit j) of W_ih: in global memory (W_ih itself, (G*H, input)),
// or, kHeld, in the resident CTA's copy in shared memory (w_s, [G*kUnits][input]).
template <bool kHeld>
PRNN_DEVICE const float* w_ih_row(const float* w, int local, int g, int j, int input, int hidden) {
  return kHeld ? w + (size_t)local * input : w + ((size_t)g * hidden + j) * input;
}

// gi_s[b][g*kUnits + u] = x_b . W_ih[g*H + j0 + u, :] (+ b_ih) for the slice's rows (every
// thread; the caller's barrier makes them visible), from W_ih (w: global memory) or its held rows
// (kHeld: w = w_s). One warp per (kProjRows rows, kBatch batch rows): a load of a row serves
// kBatch staged rows of x and a load of x kProjRows rows of W_ih; lane l sums columns l + 32 i
// in increasing i, then a butterfly: one fixed order for each (row, batch row), whoever computes
// the slice and wherever its rows are read from. A row past the slice's units (or past the CTA's
// rows) reads the slice's first row and a batch row past the batch reads the pass's first, so
// the sums need no predicate; their results are dropped.
template <bool kHeld, int kBatch>
PRNN_DEVICE void project_pass(const float* w, const float* b_ih, const float* x_s, float* gi_s,
                              int slice, int batch, int input, int hidden) {
  constexpr int R = ThisCell::G * kUnits, kGroups = (R + kProjRows - 1) / kProjRows;
  const int lane = threadIdx.x % kWarp, padded = padded_input(input);
  const int items = kGroups * ((batch + kBatch - 1) / kBatch);
  for (int item = threadIdx.x / kWarp; item < items; item += blockDim.x / kWarp) {
    const int l0 = item % kGroups * kProjRows, b0 = item / kGroups * kBatch;
    const float* row[kProjRows];
    const float* xr[kBatch];
    bool mine[kProjRows];
    float bias[kProjRows];  // (loaded first: its latency hides under the sums)
#pragma unroll
    for (int q = 0; q < kProjRows; ++q) {
      const int local = l0 + q, g = local / kUnits, j = slice * kUnits + local % kUnits;
      mine[q] = local < R && j < hidden;
      row[q] = mine[q] ? w_ih_row<kHeld>(w, local, g, j, input, hidden)
                       : w_ih_row<kHeld>(w, 0, 0, slice * kUnits, input, hidden);
      bias[q] = mine[q] && b_ih != nullptr ? b_ih[g * hidden + j] : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < kBatch; ++r) xr[r] = x_s + (b0 + r < batch ? b0 + r : b0) * padded;
    float acc[kProjRows][kBatch];
#pragma unroll
    for (int q = 0; q < kProjRows; ++q) {
#pragma unroll
      for (int r = 0; r < kBatch; ++r) acc[q][r] = 0.0f;
    }
#pragma unroll 2
    for (int k = lane; k < input; k += kWarp) {
      float xv[kBatch], wv[kProjRows];
#pragma unroll
      for (int r = 0; r < kBatch; ++r) xv[r] = xr[r][k];
#pragma unroll
      for (int q = 0; q < kProjRows; ++q) wv[q] = row[q][k];
#pragma unroll
      for (int q = 0; q < kProjRows; ++q) {
#pragma unroll
        for (int r = 0; r < kBatch; ++r) acc[q][r] += wv[q] * xv[r];
      }
    }
#pragma unroll
    for (int q = 0; q < kProjRows; ++q) {
#pragma unroll
      for (int r = 0; r < kBatch; ++r) {
        for (int mask = kWarp / 2; mask > 0; mask >>= 1) acc[q][r] += prnn_shfl_xor(acc[q][r], mask);
        if (lane == 0 && mine[q] && b0 + r < batch) {
          gi_s[(b0 + r) * R + l0 + q] = b_ih != nullptr ? acc[q][r] + bias[q] : acc[q][r];
        }
      }
    }
  }
}

// The slice's rows of gi (project_pass): passes of one batch row where the batch is 1 (no
// accumulator idle), of kProjBatch otherwise.
template <bool kHeld>
PRNN_DEVICE void project_rows(const float* w, const float* b_ih, const float* x_s, float* gi_s,
                              int slice, int batch, int input, int hidden) {
  if (batch == 1) {
    project_pass<kHeld, 1>(w, b_ih, x_s, gi_s, slice, batch, input, hidden);
  } else {
    project_pass<kHeld, kProjBatch>(w, b_ih, x_s, gi_s, slice, batch, input, hidden);
  }
}

// The resident CTA's rows of W_ih (slice `slice`) into w_s, once per launch (zeros past the
// layer's units: never read); the loop's block barrier makes them visible.
PRNN_DEVICE void hold_w_ih(float* w_s, const float* w_ih, int slice, int input, int hidden) {
  constexpr int R = ThisCell::G * kUnits;
  const int lane = threadIdx.x % kWarp;
  for (int local = threadIdx.x / kWarp; local < R; local += blockDim.x / kWarp) {
    const int g = local / kUnits, j = slice * kUnits + local % kUnits;
    const float* src = w_ih_row<false>(w_ih, local, g, j, input, hidden);
    float* dst = w_s + (size_t)local * input;
#pragma unroll 4
    for (int k = lane; k < input; k += kWarp) dst[k] = j < hidden ? src[k] : 0.0f;
  }
}

// The CTA's rows of W_hh in registers, as persistent_forward.cu loads them (the same rows in
// the same registers: the product sums in the same order).
PRNN_DEVICE void load_rows(RegisterTile& tile, const Team& team, const WeightWord* w_hh, int slice,
                           int hidden) {
  const int j0 = slice * kUnits;
  int rows[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int local = warp_row_group() * kRows + r, u = team.unit_of(local);
    rows[r] = j0 + u < hidden ? team.gate_of(local) * hidden + j0 + u : -1;
  }
  tile.load(w_hh, rows, warp_chunk() * kChunk, hidden, threadIdx.x % kWarp);
}

// A layer's constant operands of a step: W_hh (its rows also in registers: RegisterTile), b_hh,
// W_ih (G*H, input), whose rows a step of mode x reads from the CTA's shared w_s where w_ih_held
// (a resident CTA of a plan that holds them) or else from global memory, the layer's own copy
// of its last two steps' h (keep: [2][B][H], step t's h_t at (t & 1)) and the sizes.
struct DecoderWeights {
  const WeightWord* w_hh;
  const float* b_hh;
  const float* w_ih;
  bool w_ih_held;
  float* keep;
  int input;
  int hidden;
};

// Layer n's operands within the stacked ones that both kernels take (prnn_decoder_step's list):
// W_ih is layer 0's (G*H, input) then each further layer's (G*H, H); `held`: whether its rows
// are read from the CTA's w_s.
PRNN_DEVICE DecoderWeights layer_weights(const WeightWord* w_hh, const float* b_hh,
                                         const float* w_ih, float* keep, int n, int batch,
                                         int input, int hidden, bool held) {
  const size_t gh = (size_t)ThisCell::G * hidden, bh = (size_t)batch * hidden;
  const size_t w_ih_at = n == 0 ? 0 : gh * input + (n - 1) * gh * hidden;
  return {w_hh + n * gh * ((hidden + kPerWord - 1) / kPerWord), b_hh + n * gh, w_ih + w_ih_at,
          held, keep + 2 * n * bh, n == 0 ? input : hidden, hidden};
}

// The recurrent half of the slice's step, for the h staged in h_s (every thread; no trailing
// barrier): the tile's product (multiply_rows, partial sums in part_s), then W_hh h + b_hh of
// each row summed as the forward sums it (row_sum, then b_hh) into the row's chunk-0 slot of
// part_s, in place (a row's slots are read and written by one thread). It depends only on
// h_{t-1}, so a resident CTA computes it ahead, between steps (resident_step).
PRNN_DEVICE void recurrent_sums(const RegisterTile& tile, const Team& team, const DecoderShared& sm,
                                const DecoderWeights& wt, int slice, int batch) {
  constexpr int G = ThisCell::G, R = G * kUnits;
  const int j0 = slice * kUnits;
  multiply_batch(tile, sm.h_s, sm.part_s, batch, R);
#pragma unroll 1
  for (int idx = team.thread; idx < batch * team.units; idx += team.size) {
    const int b = idx / team.units, u = team.unit0 + idx % team.units, j = j0 + u;
    if (j >= wt.hidden) continue;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int row = team.row_of(g, u);
      sm.part_s[b * kKsplit * R + row] = row_sum(sm.part_s, b, row, R) + wt.b_hh[g * wt.hidden + j];
    }
  }
}

// Whether h (B, H: the caller's h_{t-1}) as the exchange delivers it differs, in any bit, from
// the h staged in h_s (every thread: waits for its copies - x's - and ends with a block barrier).
PRNN_DEVICE bool differs_from_staged(const float* h_s, const float* h, int batch, int hidden) {
  bool differs = false;
#pragma unroll 4
  for (int idx = threadIdx.x; idx < batch * hidden; idx += blockDim.x) {
    const float v = prnn_exchange_value(prnn_load_cg(h + idx));
    differs |= prnn_float_bits(v) != prnn_float_bits(h_s[idx / hidden * kPadded + idx % hidden]);
  }
  prnn_copy_wait();
  return prnn_sync_block_or(differs);
}

// The units of slice `slice` (the resident kernel's CTA of that index: its rows in `tile`) of
// step `step` (every thread; ends past a block barrier, the outputs written, h_t also to the
// layer's keep). `ahead`: h_s and part_s hold the recurrent half (recurrent_sums) for some
// h_{t-1} - the layer's own last h' -, used where the caller's h_{t-1} is that one, bit for bit
// (else, and without `ahead`, it is computed here from the caller's: the same sums either way).
PRNN_DEVICE void decoder_step(const RegisterTile& tile, const Team& team, const DecoderShared& sm,
                              const DecoderWeights& wt, const StepIo& io, int slice, int batch,
                              unsigned step, bool ahead) {
  constexpr int G = ThisCell::G, R = G * kUnits;
  const int j0 = slice * kUnits, hidden = wt.hidden;
  const bool project = io.x != nullptr;
  if (project) stage_input(sm.x_s, io.x, batch, wt.input);
  // (either way past a block barrier, x_s staged)
  const bool fresh = !ahead || differs_from_staged(sm.h_s, io.h_prev, batch, hidden);
#ifdef PRNN_EMULATION
  if (ahead && threadIdx.x == 0) {
    __atomic_add_fetch(&prnn_emu_decoder_ahead[fresh], 1, __ATOMIC_RELAXED);
  }
#endif
  if (fresh) stage_exchanged(sm.h_s, io.h_prev, batch, hidden);
  PRNN_PROBE_ONLY(const bool probe = sm.probe && threadIdx.x == 0;
                  if (probe) probe_stamp(step, kProbeStaged);
                  if (probe) probe_set(step, kProbeAhead, fresh ? 2u : 1u);)
  if (project && wt.w_ih_held) {
    project_rows<true>(sm.w_s, io.b_ih, sm.x_s, sm.gi_s, slice, batch, wt.input, hidden);
  } else if (project) {
    project_rows<false>(wt.w_ih, io.b_ih, sm.x_s, sm.gi_s, slice, batch, wt.input, hidden);
  }
  PRNN_PROBE_ONLY(if (probe) probe_stamp(step, kProbeProjected);)
  if (fresh) recurrent_sums(tile, team, sm, wt, slice, batch);
  prnn_sync_block();  // gi_s and the sums
  PRNN_PROBE_ONLY(if (probe) probe_stamp(step, kProbeGathered);)
  float* keep = wt.keep + (step & 1u) * (size_t)batch * hidden;
#pragma unroll 1
  for (int idx = team.thread; idx < batch * team.units; idx += team.size) {
    const int b = idx / team.units, u = team.unit0 + idx % team.units, j = j0 + u;
    if (j >= hidden) continue;
    const size_t at = (size_t)b * hidden + j;
    float giv[G], ghv[G], sv[kSavedSlots];
    // The step's inputs through L2 (prnn_load_cg): the caller's buffers come back at the same
    // addresses steps apart (a memory pool), and this SM's L1 may still hold older lines.
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (project) {
        giv[g] = sm.gi_s[b * R + g * kUnits + u];
      } else {
        giv[g] = prnn_load_cg(io.gi + (size_t)b * G * hidden + g * hidden + j);
        if (io.b_ih != nullptr) giv[g] += io.b_ih[g * hidden + j];
      }
      ghv[g] = sm.part_s[b * kKsplit * R + team.row_of(g, u)];  // (recurrent_sums)
    }
    float h, c;
    cell_forward_masked<PRNN_CELL>(true, giv, ghv, prnn_load_cg(io.h_prev + at),
                                   kHasC ? prnn_load_cg(io.c_prev + at) : 0.0f, h, c, sv);
    io.h_out[at] = keep[at] = round_state(h);
    if (kHasC) io.c_out[at] = c;
  }
  prnn_sync_block();
  PRNN_PROBE_ONLY(if (probe) probe_stamp(step, kProbePointwise);)
}

// Thread 0 of a resident CTA at its launch: takes slice c back from kGone (the step it was left
// at + 1), or 0 when it cannot - another resident CTA holds it (kLive), or a step kernel's
// takeover (kBusy) did not end within timeout_ns.
PRNN_DEVICE unsigned revive(unsigned* word, unsigned long long timeout_ns) {
  const unsigned long long deadline = prnn_globaltimer_ns() + timeout_ns;
  for (;;) {
    const unsigned v = prnn_load_acquire(word);
    if ((v & 3u) == kGone) {
      if (prnn_atomic_cas_acq_rel(word, v, decoder_word(v >> 2, kLive)) == v) return (v >> 2) + 1u;
      continue;
    }
    if ((v & 3u) == kLive || prnn_globaltimer_ns() > deadline) return 0u;
    prnn_backoff();
  }
}

// Thread 0 of a resident CTA: whether step `step` is posted by `deadline` (false: idle past
// it, or a later step posted - this CTA is stale).
PRNN_DEVICE bool wait_for_post(const unsigned* box, unsigned step, unsigned long long deadline) {
  PRNN_PROBE_ONLY(unsigned long long polls = 0;
                  if (blockIdx.x == 0) probe_stamp(step, kProbeWaitStart);)
  [[maybe_unused]] unsigned missed = 0u;
  for (;;) {
    const unsigned posted = prnn_load_acquire(box);
    if (posted == step) {
      PRNN_PROBE_ONLY(probe_resident(step, kProbePostSeen);
                      if (blockIdx.x == 0) probe_set(step, kProbePostPolls, polls);)
      return true;
    }
    if (posted > step || prnn_globaltimer_ns() > deadline) return false;
    PRNN_PROBE_ONLY(++polls;)
    PRNN_HANDOFF_BACKOFF(missed);
  }
}

// A resident CTA between steps, `last` done (every thread): whether every slice of its layer
// (`state`: the layer's `slices` words) has
// done step `last` - its h_last whole in the layer's keep - before step last + 1 is posted (then
// its recurrent half can be computed ahead) and by `deadline`. Each thread watches its own
// slices (a slice's step only grows: taken over, it says `last` until done); no barrier inside
// the wait (step_layer's reason).
PRNN_DEVICE bool wait_for_layer(const unsigned* box, const unsigned* state, int slices,
                                unsigned last, unsigned long long deadline) {
  bool done = true;
  [[maybe_unused]] unsigned missed = 0u;
  for (int s = threadIdx.x; s < slices; s += blockDim.x) {
    for (;;) {
      if ((prnn_load_acquire(state + s) >> 2) >= last) break;
      if (prnn_load_acquire(box) != last || prnn_globaltimer_ns() > deadline) {
        done = false;
        break;
      }
      PRNN_HANDOFF_BACKOFF(missed);
    }
    if (!done) break;
  }
  return !prnn_sync_block_or(!done);
}

// A resident CTA's wait (slice `slice` of its layer) for step last + 1 (every thread), with the
// recurrent half computed ahead
// where it can be: once every slice has done step `last` (wait_for_layer), the layer's own h_last
// (keep) is staged and recurrent_sums computes on it while the post is awaited - in a decode loop
// the caller's kernels run then - so that a step whose h_{t-1} is that h (decoder_step checks)
// is left the projection and the pointwise math. Whether the step was posted (false: idle past
// timeout_ns since the call, or stale), and in *ahead whether h_s and part_s hold the ahead part.
PRNN_DEVICE bool await_step(const RegisterTile& tile, const Team& team, const DecoderShared& sm,
                            const DecoderWeights& wt, const unsigned* box, const unsigned* state,
                            int slice, int slices, unsigned last, int batch,
                            unsigned long long timeout_ns, bool* ahead) {
  const unsigned long long deadline = prnn_globaltimer_ns() + timeout_ns;
  *ahead = last > 0u && wait_for_layer(box, state, slices, last, deadline);
  if (*ahead) {
    stage_exchanged(sm.h_s, wt.keep + (last & 1u) * (size_t)batch * wt.hidden, batch, wt.hidden);
    recurrent_sums(tile, team, sm, wt, slice, batch);
  }
  if (threadIdx.x == 0) {
    sm.word_s[0] = wait_for_post(box, last + 1u, deadline);
    if (sm.word_s[0]) {
      for (int i = 0; i < kIoWords; ++i) sm.word_s[1 + i] = prnn_load_relaxed(box + 2 + i);
    }
  }
  prnn_sync_block();  // (the ahead sums too)
  return sm.word_s[0] != 0u;
}

constexpr int kBoxWords = 16;  // a layer's mailbox (decoder.BOX_WORDS)

// One layer of a step kernel's step: posts step box[1] + 1 to the layer's mailbox, waits until
// each slice is done and computes the slices whose resident CTA is gone (every thread; `wt`,
// `io`: the layer's). Whether every slice was done within timeout_ns of the post; if not, the
// step is recorded in the layer's fault word (its outputs are not all written).
PRNN_DEVICE bool step_layer(const DecoderShared& sm, const DecoderWeights& wt, const StepIo& io,
                            unsigned* box, unsigned* state, unsigned* fault, int slices,
                            int batch, unsigned long long timeout_ns) {
  constexpr int kMaxOwned = 32;  // slices a thread watches: the bits of `pending`
  // The step's number comes from the device (box[1], the last one issued; the step kernels of
  // a decoder run in stream order), so a CUDA graph's replay continues the count.
  if (threadIdx.x == 0) {
    const unsigned issued = box[1] + 1u;
    box[1] = issued;
    sm.word_s[0] = issued;
    io_to_words(io, box + 2, true);
    PRNN_PROBE_ONLY(probe_stamp(issued, kProbePosting);)
    prnn_store_release(box, issued);
  }
  prnn_sync_block();
  const unsigned step = sm.word_s[0];
  prnn_sync_block();  // word_s[0] read by every thread before the takeover reuses it
  if (slices > kMaxOwned * (int)blockDim.x) {  // (the host plans grids below the SM count)
    if (threadIdx.x == 0) prnn_atomic_set_if_zero(fault, step);
    return false;
  }
  // Every thread watches its own slices (bit i: slice threadIdx.x + i * blockDim.x), so a step
  // waits about as long as its slowest CTA, not one load round trip per slice in turn. No block
  // barrier inside the wait: a thread polls until its slices are done or its deadline passed
  // (the emulation's virtual clock moves only while every CTA merely polls - a barrier is work).
  unsigned pending = 0u, taken = 0u;
  for (int i = 0, s = threadIdx.x; s < slices; ++i, s += blockDim.x) pending |= 1u << i;
  const unsigned long long deadline = prnn_globaltimer_ns() + timeout_ns;
  PRNN_PROBE_ONLY(unsigned long long polls = 0;)
  [[maybe_unused]] unsigned missed = 0u;
  while (pending != 0u) {
    for (int i = 0, s = threadIdx.x; s < slices; ++i, s += blockDim.x) {
      if (!(pending >> i & 1u)) continue;
      unsigned* word = state + s;
      const unsigned v = prnn_load_acquire(word);
      if ((v >> 2) >= step) {
        pending &= ~(1u << i);
      } else if ((v & 3u) == kGone &&
                 prnn_atomic_cas_acq_rel(word, v, decoder_word(step - 1u, kBusy)) == v) {
        pending &= ~(1u << i);
        taken |= 1u << i;
      }
    }
    if (pending == 0u || prnn_globaltimer_ns() > deadline) break;
    PRNN_PROBE_ONLY(++polls;)
    PRNN_HANDOFF_BACKOFF(missed);
  }
  const bool failed = prnn_sync_block_or(pending != 0u);
  PRNN_PROBE_ONLY(if (threadIdx.x == 0) probe_stamp(step, kProbeDoneSeen);
                  if (threadIdx.x == 0) probe_set(step, kProbeDonePolls, polls);)
  // The slices taken over, one at a time with the whole CTA (their words say kBusy until done,
  // even in a step that failed: a later step or relaunch may take them again).
  if (prnn_sync_block_or(taken != 0u)) {
    for (int s = 0; s < slices; ++s) {
      if (threadIdx.x == s % blockDim.x) sm.word_s[0] = taken >> (s / blockDim.x) & 1u;
      prnn_sync_block();
      const bool take = sm.word_s[0] != 0u;
      prnn_sync_block();  // word_s[0] read by every thread before the next slice's owner writes it
      if (!take) continue;
      const Team team = step_team<ThisCell::G>();
      RegisterTile tile;
      load_rows(tile, team, wt.w_hh, s, wt.hidden);
      decoder_step(tile, team, sm, wt, io, s, batch, step, false);
      if (threadIdx.x == 0) {
        prnn_fence();
        prnn_store_release(state + s, decoder_word(step, kGone));
      }
    }
  }
  if (failed && threadIdx.x == 0) prnn_atomic_set_if_zero(fault, step);
  return !failed;
}

}  // namespace prnn

// The resident kernel of a decoder's layers (a cell: 1), `slices` CTAs a layer (its grid: the
// layers' CTAs side by side): CTA n * slices + c computes slice c of layer n, on operands
// stacked as the step kernel's (below); each CTA carves its shared memory for its layer's input
// size (the launch's: the largest layer's). w_ih_held: bit 0, layer 0's CTAs hold their rows of
// W_ih in shared memory (w_s; the plan's); bit 1, the further layers' (whose input is hidden).
PRNN_KERNEL void prnn_resident_decoder(
    const prnn::WeightWord* w_hh, const float* b_hh, const float* w_ih, unsigned* box,
    unsigned* state, float* keep, int slices, int batch, int input, int hidden,
    int w_ih_held, unsigned long long timeout_ns, int stall_block, int stall_step,
    unsigned long long stall_ns) {
  using namespace prnn;
  // (n by subtraction, not a division: a division by a runtime value goes through the FP
  // reciprocal, off the uniform datapath, and the layer's pointers then took ~20 registers -
  // 255 at LSTM H=1024 B=1 - where the loop's integer steps leave them uniform: 234)
  int n = 0, slice = (int)blockIdx.x;
  for (; slice >= slices; slice -= slices) ++n;
  const DecoderWeights wt = layer_weights(w_hh, b_hh, w_ih, keep, n, batch, input, hidden,
                                          (w_ih_held >> (n == 0 ? 0 : 1) & 1) != 0);
  box += n * kBoxWords;
  state += n * slices;
  DecoderShared sm = decoder_shared(batch, wt.input);
  PRNN_PROBE_ONLY(sm.probe = blockIdx.x == 0;)
  unsigned* mine = state + slice;
  if (threadIdx.x == 0) sm.word_s[0] = revive(mine, timeout_ns);
  prnn_sync_block();
  unsigned last = sm.word_s[0];
  if (last == 0u) return;
  --last;
  const PrnnStall stall{stall_block, stall_step, stall_ns};  // (stall_block: a slice, any layer)
  const Team team = step_team<ThisCell::G>();
  RegisterTile tile;
  load_rows(tile, team, wt.w_hh, slice, hidden);
  if (wt.w_ih_held) hold_w_ih(sm.w_s, wt.w_ih, slice, wt.input, hidden);
  for (;;) {
    prnn_sync_block();  // every thread has read word_s of the step before
    bool ahead;
    if (!await_step(tile, team, sm, wt, box, state, slice, slices, last, batch, timeout_ns,
                    &ahead)) {
      break;
    }
    prnn_maybe_stall(stall, (int)last + 1, slice);
    decoder_step(tile, team, sm, wt, io_of_words(sm.word_s + 1, false), slice, batch, last + 1u,
                 ahead);
    ++last;
    if (threadIdx.x == 0) {
      prnn_fence();  // the CTA's outputs (ordered before by the block barrier) before the word
      PRNN_PROBE_ONLY(probe_resident(last, kProbePublishing);)
      prnn_store_release(mine, decoder_word(last, kLive));
    }
  }
  // Idle (or stale): nobody holds the slice now. Only this CTA writes the word while it is live.
  if (threadIdx.x == 0) prnn_atomic_cas_acq_rel(mine, decoder_word(last, kLive), decoder_word(last, kGone));
}

// The step kernel of a decoder of `layers` layers (a cell: 1), one CTA: each layer's step in
// turn (step_layer), layer n > 0 projecting the h' that layer n - 1 wrote. Every operand is the
// layers' stacked: W_hh (layers, G*H, H words), b_hh (layers, G*H), W_ih (G*H, input) then
// (layers - 1, G*H, H), b_ih (layers, G*H) or unread, the mailboxes (layers, kBoxWords), the
// state words (layers, slices), the fault words (layers), keep (layers, 2, B, H), h_{t-1},
// c_{t-1}, h_t, c_t (layers, B, H). A layer whose wait failed ends the step: the layers above
// it are not posted.
PRNN_KERNEL void prnn_decoder_step(
    const prnn::WeightWord* w_hh, const float* b_hh, const float* w_ih, unsigned* box,
    unsigned* state, unsigned* fault, float* keep,
    const float* x_or_gi, int project,  // project != 0: x_t (B, input), else gi_t (B, G*H)
    const float* h_prev, const float* c_prev, float* h_out, float* c_out,
    const float* b_ih, int with_bias,  // with_bias 0: no b_ih (unread); layer 0 adds it to its
                                       // projection of x only (a given gi holds it)
    int layers, int slices, int batch, int input, int hidden, unsigned long long timeout_ns) {
  using namespace prnn;
  constexpr int G = ThisCell::G;
  const size_t gh = (size_t)G * hidden, bh = (size_t)batch * hidden;
  // x_s holds the widest input of the layers (the regions after it follow; a layer's rows of
  // x_s are its own input wide)
  const DecoderShared sm = decoder_shared(batch, layers > 1 && hidden > input ? hidden : input);
  PRNN_PROBE_ONLY(if (threadIdx.x == 0) probe_set(box[1] + 1u, kProbeStep, box[1] + 1u);
                  if (threadIdx.x == 0) probe_stamp(box[1] + 1u, kProbeStart);)
  for (int n = 0; n < layers; ++n) {
    const DecoderWeights wt = layer_weights(w_hh, b_hh, w_ih, keep, n, batch, input, hidden,
                                            false);  // (W_ih's rows: global)
    const bool x_given = n > 0 || project != 0;
    const float* x = n == 0 ? x_or_gi : h_out + (n - 1) * bh;
    const StepIo io{x_given ? x : nullptr, x_given ? nullptr : x_or_gi, h_prev + n * bh,
                    c_prev + n * bh, h_out + n * bh, c_out + n * bh,
                    with_bias && x_given ? b_ih + n * gh : nullptr};
    // The layer below's h' (written by this CTA's threads before its barrier, or by resident
    // CTAs whose done words they acquired) before the post that lets this layer's CTAs read it
    if (n > 0 && threadIdx.x == 0) prnn_fence();
    if (!step_layer(sm, wt, io, box + n * kBoxWords, state + n * slices, fault + n, slices, batch,
                    timeout_ns)) {
      return;
    }
  }
  PRNN_PROBE_ONLY(if (threadIdx.x == 0) probe_stamp(box[1], kProbeEnd);)
}
