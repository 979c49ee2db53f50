// device_loop.cu - the completion of a persistent pass, decided on the device, and its record.
//
// A call enqueues a fixed chain per pass (persistent_rnn/launch.py) and reads nothing back:
//   memset -> pass launch (from the first step) -> resume launch -> ... (max_restarts of them)
//   -> completion.
// The last CTA to leave each launch settles it (prnn_settle, chain.cuh: each group's next step
// into the chain's `starts`, the exchanges zeroed and the control words reset where a group is
// unfinished), so a resume launch reads its start there (launch_start, persistent_common.cuh) and
// exits at once where the pass is done. The completion kernels (prnn_complete_forward /
// prnn_complete_backward / prnn_complete_projection_backward; one CTA: no co-residency needed,
// slow - they only run groups after the restart cap) first close the chain (prnn_close_chain: the
// groups left recorded as the completion's, the record published into a ring of slots in
// page-locked host memory that the host reads lazily without an API call: launch.RecordRing,
// DeviceRecord), then finish every group that is still unfinished, from where it stopped, on a
// plain per-step loop in global memory. The chain's words: chain.cuh.
//
// -D: PRNN_CELL, PRNN_WEIGHT_DTYPE (0 fp32, 1 fp16, 2 bf16: how W_hh / W_hr are given - a pass of
// an fp32 tile widening a 16-bit layer's words has the layer's -, and the type the completion
// rounds the recurrent state to where the persistent kernels do: cells.cuh).
#ifndef PRNN_WEIGHT_DTYPE
#define PRNN_WEIGHT_DTYPE 0
#endif
#include "cells.cuh"
#include "chain.cuh"

namespace prnn {

// A ring slot: the sequence number, the record (kChainHead + groups words), the sequence number
// again (launch.SLOT_EXTRA: the words beside the record).
constexpr int kSlotExtra = 2;
using StepCell = Cell<PRNN_CELL>;
constexpr int kLoopSaved = StepCell::S > 0 ? StepCell::S : 1;

// Element (row, col) of a matrix of `cols` columns held as the persistent kernels take it: fp32,
// or 32-bit words of two 16-bit values (rows padded to an even length).
PRNN_DEVICE float matrix_at(const void* m, size_t row, int col, int cols) {
#if PRNN_WEIGHT_DTYPE == 0
  return static_cast<const float*>(m)[row * cols + col];
#else
  return prnn_pair_element<PRNN_WEIGHT_DTYPE>(static_cast<const unsigned*>(m), row, col, cols);
#endif
}

// sum_k m[row, k] * v[k] over k < cols (m as matrix_at holds it; v fp32).
PRNN_DEVICE float row_dot(const void* m, size_t row, const float* v, int cols) {
  float acc = 0.0f;
  for (int k = 0; k < cols; ++k) acc += matrix_at(m, row, k, cols) * v[k];
  return acc;
}

// Matrix `index` of a stack of matrices of rows x cols held as matrix_at reads them (a stack's
// W_hh, W_ih and their transposes: one per layer, in the layer's weight type).
PRNN_DEVICE const void* matrix_of(const void* m, int index, int rows, int cols) {
  const size_t words = PRNN_WEIGHT_DTYPE == 0 ? (size_t)cols : (size_t)(cols + 1) / 2;
  return static_cast<const char*>(m) + (size_t)index * rows * words * 4;
}

// Publishes the chain's record as pass number ledger[0] + 1 into its slot of `ring` (host memory:
// a word, then `slots` slots of kChainHead + groups + kSlotExtra words) - a seqlock: the slot's
// first word takes the new number before anything else of it changes, its last word after
// everything else has, each step fenced at system scope, so a host read that finds the number it
// expects in the last word, then in the first, has read that pass's words only. A pass that ended
// on the completion with the grid not co-resident is counted in ledger[1], which the ring's first
// word follows (the residency cooldown reads it: launch.Cooldowns; no record is needed for it, so
// a record overwritten before the host read it loses no cooldown). One thread.
PRNN_DEVICE void prnn_publish_record(unsigned* chain, int groups, int grid, unsigned* ring,
                                     int slots) {
  unsigned* ledger = chain + kChainHead + groups + 2 + grid + groups;
  const unsigned seq = ledger[0] + 1u;
  ledger[0] = seq;
  if ((chain[1] & kChainNotResident) && chain[2] > 0u) {
    ledger[1] += 1u;
    prnn_store_system(ring, ledger[1]);
  }
  const int words = kChainHead + groups;
  unsigned* slot = ring + 1 + (size_t)(seq % (unsigned)slots) * (words + kSlotExtra);
  prnn_store_system(slot, seq);
  prnn_fence_system();
  for (int i = 0; i < words; ++i) prnn_store_system(slot + 1 + i, chain[i]);
  prnn_fence_system();
  prnn_store_system(slot + 1 + words, seq);
}

// Closes the chain before the completion runs (thread 0, then a block barrier): the groups the
// last launch left unfinished (starts[g] not `end`) are recorded as the completion's, and that
// launch, which its settle counted, taken back from the restarts (no resume followed it); then
// the record is published into `ring` where `slots` > 0 (0: a chain captured into a user's graph,
// which records nothing).
PRNN_DEVICE void prnn_close_chain(unsigned* chain, int groups, int grid, int end, unsigned* ring,
                                  int slots) {
  if (threadIdx.x == 0) {
    const int* starts = reinterpret_cast<const int*>(chain + kChainHead + groups + 2 + grid);
    int unfinished = 0;
    for (int g = 0; g < groups; ++g) unfinished |= starts[g] != end;
    if (unfinished) {
      chain[0] -= 1u;
      chain[2] = 1u;
      for (int g = 0; g < groups; ++g) chain[kChainHead + g] = (unsigned)starts[g];
    }
    if (slots > 0) prnn_publish_record(chain, groups, grid, ring, slots);
  }
  prnn_sync_block();
}

}  // namespace prnn

// One block: completes the forward of every group whose starts[g] is not `steps` (a stack's layers
// bottom-up, as the layer above reads the one below). Per group g (strides: its slice of each
// buffer): h_{t-1} from y (h0 at t = 0) and c from cs (c0); gi from `gi` (group 0 of a chained
// stack, every group otherwise) or W_ih y_{g-1}[t] + b_ih (a chained stack's groups above 0).
// With a projection (`proj` > 0, LSTM): y holds r_t = W_hr h_t (P wide), hs the cell's h_t.
PRNN_KERNEL void prnn_complete_forward(
    const void* w_hh, const void* w_hr, const float* b_hh, const float* gi, const void* w_ih,
    const float* b_ih, const float* h0, const float* c0, const int* lengths, float* y, float* hs,
    float* cs, float* saved, unsigned* chain, int groups, int grid, unsigned* ring, int slots,
    int chained, int steps, int batch, int hidden, int proj) {
  using namespace prnn;
  prnn_close_chain(chain, groups, grid, steps, ring, slots);
  constexpr int G = StepCell::G, S = StepCell::S;
  constexpr bool kHasC = StepCell::has_c;
  const int* starts = reinterpret_cast<const int*>(chain + kChainHead + groups + 2 + grid);
  const int gh_len = G * hidden, width = proj > 0 ? proj : hidden;  // width: the state's
  const size_t state = (size_t)steps * batch;
  for (int g = 0; g < groups; ++g) {
    const int start = starts[g];
    if (start >= steps) continue;
    const void* w_hh_g = matrix_of(w_hh, g, gh_len, width);
    const float* y_below = y + (g - 1) * state * width;
    float* y_g = y + g * state * width;
    float* cs_g = cs + g * state * hidden;
    float* saved_g = saved + g * state * S * hidden;
    const float* gi_g = gi + (chained ? 0 : g) * state * gh_len;
    for (int t = start; t < steps; ++t) {
      for (int idx = threadIdx.x; idx < batch * hidden; idx += blockDim.x) {
        const int b = idx / hidden, j = idx % hidden;
        const size_t at0 = ((size_t)g * batch + b) * width, row = (size_t)t * batch + b;
        const float* prev = t > 0 ? y_g + (row - batch) * width : h0 + at0;
        const size_t c_at = ((size_t)g * batch + b) * hidden + j;
        const float c_prev = kHasC ? (t > 0 ? cs_g[(row - batch) * hidden + j] : c0[c_at]) : 0.0f;
        // The cell's own h_{t-1}: the state itself, or (projection) the previous hs (LSTM does
        // not read it, and a frozen step takes r from y, not from hs).
        const float h_prev = proj > 0 ? (t > 0 ? hs[(row - batch) * hidden + j] : 0.0f) : prev[j];
        float giv[G], ghv[G], sv[kLoopSaved], h, c;
        for (int q = 0; q < G; ++q) {
          const size_t r = (size_t)q * hidden + j;
          ghv[q] = b_hh[g * gh_len + r] + row_dot(w_hh_g, r, prev, width);
          giv[q] = (g == 0 || !chained)
                       ? gi_g[row * gh_len + r]
                       : b_ih[g * gh_len + r] + row_dot(matrix_of(w_ih, g - 1, gh_len, hidden), r,
                                                        y_below + row * hidden, hidden);
        }
        cell_forward_masked<PRNN_CELL>(t < lengths[b], giv, ghv, h_prev, c_prev, h, c, sv);
        if (proj > 0) {
          hs[row * hidden + j] = h;
        } else {
          y_g[row * hidden + j] = prnn_stored_state(h);
        }
        if (kHasC) cs_g[row * hidden + j] = c;
        for (int s = 0; s < S; ++s) saved_g[row * S * hidden + s * hidden + j] = sv[s];
      }
      prnn_sync_block();
      if (proj > 0) {  // r_t = W_hr h_t (r_{t-1} past a length)
        for (int idx = threadIdx.x; idx < batch * proj; idx += blockDim.x) {
          const int b = idx / proj, p = idx % proj;
          const size_t row = (size_t)t * batch + b;
          const float r_prev = t > 0 ? y[(row - batch) * proj + p] : h0[(size_t)b * proj + p];
          y[row * proj + p] = t < lengths[b]
                                  ? prnn_stored_state(row_dot(w_hr, p, hs + row * hidden, hidden))
                                  : r_prev;
        }
        prnn_sync_block();
      }
    }
  }
}

// One block: completes the backward of every group whose starts[g] is not -1 (a stack's layers
// top-down), as persistent_backward.cu / stack_backward.cu compute it: per step t (down to 0) dh =
// dy_t (the top group's, or W_ih,g+1^T dgi_{g+1}[t] in a chained stack) + the direct carry of step
// t+1 + W_hh^T dgh[t+1]; the carries are kept in dh_carry / dc_carry at slot t & 1 (`per_step` 0,
// one layer-direction: [2][B][H]) or slot t ([T+1][B][H] per group, a stack).
PRNN_KERNEL void prnn_complete_backward(
    const void* w_t, const void* w_ih_t, const float* dy, const float* y, const float* cs,
    const float* saved, const float* h0, const float* c0, const int* lengths, float* dgi,
    float* dgh, float* dh_carry, float* dc_carry, unsigned* chain, int groups, int grid,
    unsigned* ring, int slots, int chained, int per_step, int steps, int batch, int hidden) {
  using namespace prnn;
  prnn_close_chain(chain, groups, grid, -1, ring, slots);
  constexpr int G = StepCell::G, S = StepCell::S;
  constexpr bool kHasC = StepCell::has_c;
  const int* starts = reinterpret_cast<const int*>(chain + kChainHead + groups + 2 + grid);
  const int gh_len = G * hidden;
  const size_t plane = (size_t)batch * hidden, rows = (size_t)steps * batch;
  const size_t carry_len = (per_step ? steps + 1 : 2) * plane;
  for (int g = groups - 1; g >= 0; --g) {
    const int start = starts[g];
    if (start < 0) continue;
    const void* w_g = matrix_of(w_t, g, hidden, gh_len);
    const bool top = !chained || g + 1 == groups;
    const float* dy_g = dy + (chained ? 0 : g) * rows * hidden;
    const float* y_g = y + g * rows * hidden;
    const float* cs_g = cs + g * rows * hidden;
    const float* saved_g = saved + g * rows * S * hidden;
    float* dgi_g = dgi + g * rows * gh_len;
    float* dgh_g = dgh + g * rows * gh_len;
    float* dh_g = dh_carry + g * carry_len;
    float* dc_g = dc_carry + g * carry_len;
    for (int t = start; t >= 0; --t) {
      const size_t into = (size_t)(per_step ? t + 1 : (t + 1) & 1) * plane;
      const size_t out = (size_t)(per_step ? t : t & 1) * plane;
      for (int idx = threadIdx.x; idx < batch * hidden; idx += blockDim.x) {
        const int b = idx / hidden, j = idx % hidden;
        const size_t row = (size_t)t * batch + b, at = (size_t)b * hidden + j;
        float dh = dh_g[into + at];
        dh += top ? dy_g[row * hidden + j]
                  : row_dot(matrix_of(w_ih_t, g, hidden, gh_len), j,
                            dgi + ((g + 1) * rows + row) * gh_len, gh_len);
        if (t + 1 < steps) dh += row_dot(w_g, j, dgh_g + (row + batch) * gh_len, gh_len);
        const float dc = kHasC ? dc_g[into + at] : 0.0f;
        const size_t at0 = ((size_t)g * batch + b) * hidden + j;
        const float h_prev = t > 0 ? y_g[(row - batch) * hidden + j] : h0[at0];
        const float c = kHasC ? cs_g[row * hidden + j] : 0.0f;
        const float c_prev = kHasC ? (t > 0 ? cs_g[(row - batch) * hidden + j] : c0[at0]) : 0.0f;
        float sv[kLoopSaved], dgiv[G], dghv[G], dh_prev, dc_prev;
        for (int s = 0; s < S; ++s) sv[s] = saved_g[row * S * hidden + s * hidden + j];
        cell_backward_masked<PRNN_CELL>(t < lengths[b], dh, dc, sv, y_g[row * hidden + j], c,
                                        h_prev, c_prev, dgiv, dghv, dh_prev, dc_prev);
        for (int q = 0; q < G; ++q) {
          dgi_g[row * gh_len + q * hidden + j] = dgiv[q];
          dgh_g[row * gh_len + q * hidden + j] = dghv[q];
        }
        dh_g[out + at] = dh_prev;
        if (kHasC) dc_g[out + at] = dc_prev;
      }
      prnn_sync_block();
    }
  }
}

// One block: completes the backward of an LSTM with projection (one layer-direction) from
// starts[0] down to step 0, as persistent_projection_backward.cu computes it: per step t,
// dr_t = dy_t + the carry of step t+1 + W_hh^T dg_{t+1} (P wide); drs[t] = dr_t within the
// length (0 past it, where dr_t passes to step t-1 as the carry instead); then dh_t = W_hr^T drs_t
// and the cell's backward give dg_t (dgh[t]) and the dc carry. Carries by step parity.
PRNN_KERNEL void prnn_complete_projection_backward(
    const void* w_hh_t, const void* w_hr_t, const float* dy, const float* cs, const float* saved,
    const float* c0, const int* lengths, float* dgh, float* drs, float* dr_carry,
    float* dc_carry, unsigned* chain, int groups, int grid, unsigned* ring, int slots,
    int steps, int batch, int hidden, int proj) {
  using namespace prnn;
  prnn_close_chain(chain, groups, grid, -1, ring, slots);
  constexpr int G = StepCell::G, S = StepCell::S;
  const int start = reinterpret_cast<const int*>(chain + kChainHead + groups + 2 + grid)[0];
  const int gh_len = G * hidden;
  const size_t plane = (size_t)batch * hidden, rplane = (size_t)batch * proj;
  for (int t = start; t >= 0; --t) {
    const size_t into = (size_t)((t + 1) & 1), out = (size_t)(t & 1);
    for (int idx = threadIdx.x; idx < batch * proj; idx += blockDim.x) {
      const int b = idx / proj, q = idx % proj;
      const size_t row = (size_t)t * batch + b;
      float dr = dy[row * proj + q] + dr_carry[into * rplane + idx];
      if (t + 1 < steps) dr += row_dot(w_hh_t, q, dgh + (row + batch) * gh_len, gh_len);
      const bool active = t < lengths[b];
      drs[row * proj + q] = active ? dr : 0.0f;
      dr_carry[out * rplane + idx] = active ? 0.0f : dr;
    }
    prnn_sync_block();
    for (int idx = threadIdx.x; idx < batch * hidden; idx += blockDim.x) {
      const int b = idx / hidden, j = idx % hidden;
      const size_t row = (size_t)t * batch + b;
      const float dh = row_dot(w_hr_t, j, drs + row * proj, proj);
      const float c_prev = t > 0 ? cs[(row - batch) * hidden + j] : c0[idx];
      float sv[kLoopSaved], dgv[G], unused[G], dh_prev, dc_prev;
      for (int s = 0; s < S; ++s) sv[s] = saved[row * S * hidden + s * hidden + j];
      cell_backward_masked<PRNN_CELL>(t < lengths[b], dh, dc_carry[into * plane + idx], sv, 0.0f,
                                      cs[row * hidden + j], 0.0f, c_prev, dgv, unused, dh_prev,
                                      dc_prev);
      for (int q = 0; q < G; ++q) dgh[row * gh_len + q * hidden + j] = dgv[q];
      dc_carry[out * plane + idx] = dc_prev;
    }
    prnn_sync_block();
  }
}
