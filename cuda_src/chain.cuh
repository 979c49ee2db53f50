// chain.cuh - the words of a pass's device-side chain (persistent_rnn/launch.py, device_loop.cu)
// and the settle: what the last CTA to leave each launch of the pass decides for the next one.
//
// A call enqueues per pass: a memset, the pass launch, max_restarts resume launches, the
// completion kernel. The CTA of a launch that leaves last (an exit counter in the chain's words:
// each CTA writes its progress, fences and counts itself out) settles the launch: per group (a
// layer of a stack, or the one layer-direction) the first step not completed by all of its CTAs
// goes into `starts`, where a resume launch reads its start (launch_start,
// persistent_common.cuh) and exits at once if the pass is done; where a group is unfinished the
// tagged exchanges are zeroed (a restart must not take a word an earlier launch wrote). Stream
// order makes all of it visible to the next launch. (A layer kernel's resume launch of a pass
// already done exits without counting itself: the settle that found it done reset everything,
// and such a launch writes nothing the next one reads.) The completion (device_loop.cu) records
// what is left, publishes the record and finishes it.
//
// The chain buffer (uint32 words): the tagged exchanges (each padded), then
//   [0] launches that left the pass unfinished (the completion takes back the one after the last
//       resume: the record's restarts)      [1] flags (kChainDone, kChainNotResident)
//   [2] completions (1 when the completion ran groups)   [3] CTAs of this launch that have left
//   [4 .. 4+groups) the step the completion started each group from (written only when it ran)
//   [4+groups ..): PrnnControl of the launches (arrivals, abort, progress[grid]), then
//   starts[groups] (int32), then the ledger, which the per-pass memset does not reset (the host
//   zeroes it with a new ring): [0] passes recorded, [1] passes that ended on the completion with
//   the grid not co-resident; then `zeroed` (set once, when the chain is made): the exchange words
//   before the chain a restart zeroes (0: none, a stack's per-step exchanges).
// The memset zeroes the exchanges and the words up to the control words' progress; every settle
// leaves the progress words "untouched" (-1) for the next launch and the next pass (launch.Chain
// fills them itself where a chain is new or an enqueueing failed part way).
#pragma once

#include "exchange.cuh"

namespace prnn {

constexpr unsigned kChainDone = 1u, kChainNotResident = 2u;
constexpr int kChainHead = 4;  // record words before the per-group completion starts
constexpr int kChainExits = 3;  // the exit counter's word
constexpr int kChainLedger = 2;

// The chain's words from a launch's control words (PrnnControl, after the head and the groups').
PRNN_DEVICE unsigned* chain_of(unsigned* control, int groups) {
  return control - kChainHead - groups;
}

// Settles the launch that just ended (one CTA, every thread: the last to leave it). Reads each
// group's progress (group g: CTAs g * grid / groups ..; a group started from `first`, or from
// from_starts[g] where given) and writes its next step into starts (`end`: one past the pass's
// last step in its direction); counts a launch that left the pass unfinished, zeroes the
// exchanges then, and resets the control words and the exit counter for the next launch (the
// arrival counter also numbers a stack's CTAs: prnn_start_order).
PRNN_DEVICE void prnn_settle(unsigned* chain, int groups, int grid, int end, int first,
                             const int* from_starts) {
  unsigned* ctl = chain + kChainHead + groups;
  int* progress = reinterpret_cast<int*>(ctl + 2);
  int* starts = reinterpret_cast<int*>(ctl + 2 + grid);
  const int direction = end < 0 ? -1 : 1;
  int unfinished = 0;
  if (threadIdx.x == 0 && !(chain[1] & kChainDone)) {
    if (ctl[1] == (unsigned)kPrnnNotResident) chain[1] |= kChainNotResident;
    const int per = grid / groups;
    for (int g = 0; g < groups; ++g) {
      const int from = from_starts != nullptr ? from_starts[g] : first;
      int next = end;
      if (from != end) {
        int done = direction > 0 ? 0x7fffffff : -0x7fffffff;
        for (int c = g * per; c < (g + 1) * per; ++c) {
          const int p = progress[c] == -1 ? from - direction : progress[c];
          done = direction > 0 ? (p < done ? p : done) : (p > done ? p : done);
        }
        next = done + direction;
      }
      starts[g] = next;
      unfinished |= next != end;
    }
    if (unfinished) {
      chain[0] += 1u;
    } else {
      chain[1] |= kChainDone;
    }
  }
  if (threadIdx.x == 0) {
    ctl[0] = 0u;
    ctl[1] = 0u;
    chain[kChainExits] = 0u;
  }
  // (every thread: after thread 0 has read the progress)
  const bool zero = prnn_sync_block_or(unfinished);
  for (int c = threadIdx.x; c < grid; c += blockDim.x) progress[c] = -1;
  if (!zero) return;
  const long long words = chain[kChainHead + groups + 2 + grid + groups + kChainLedger];
  for (long long i = threadIdx.x; i < words; i += blockDim.x) chain[i - words] = 0u;
}

// A CTA leaves its launch (every thread, where the kernel returns): `progress`, the last step it
// completed, into its word `cta` (thread 0), then counted out; the CTA that finds every other one
// gone settles the launch (prnn_settle; `first`, `from_starts`: how the launch started its
// groups). The fence before the count orders this CTA's writes before the last CTA's reads.
PRNN_DEVICE void prnn_leave(unsigned* control, int groups, int cta, int progress, int end,
                            int first, const int* from_starts) {
  unsigned* chain = chain_of(control, groups);
  int last = 0;
  prnn_sync_block();  // every thread's writes of the launch are issued
  if (threadIdx.x == 0) {
    reinterpret_cast<PrnnControl*>(control)->progress[cta] = progress;
    prnn_fence();
    last = prnn_atomic_add_release(chain + kChainExits, 1u) == gridDim.x - 1;
    if (last) prnn_fence();
  }
  if (prnn_sync_block_or(last)) prnn_settle(chain, groups, gridDim.x, end, first, from_starts);
}

// prnn_leave for a kernel of one layer-direction (one group, CTA blockIdx.x, started from
// `first`).
PRNN_DEVICE void prnn_leave_layer(unsigned* control, int progress, int end, int first) {
  prnn_leave(control, 1, blockIdx.x, progress, end, first, nullptr);
}

}  // namespace prnn
