// emulation_launch.h - runs one emulated kernel launch on host threads.
//
// emulate.py compiles a kernel source followed by this header and one generated line per kernel,
//   PRNN_EMU_ENTRY(name)
// which defines extern "C" prnn_emu_launch_<name>(grid, block, shared_bytes, max_resident, args):
// `args` holds one pointer per kernel parameter (as cuLaunchKernel's kernelParams), unpacked by a
// template that deduces the parameter types from the kernel's own signature.
#pragma once
#include <memory>
#include <semaphore>
#include <type_traits>
#include <utility>
#include <vector>

namespace prnn_emu {

template <class... A, std::size_t... I>
void call_kernel(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

// One CTA: its shared state and blockDim.x threads, run to completion.
template <class... A>
void run_block(void (*kernel)(A...), int b, int threads, int shared_bytes, void** args) {
  const int warps = (threads + kWarp - 1) / kWarp;
  std::barrier<> sync(threads);
  std::vector<std::unique_ptr<std::barrier<>>> warp_sync;
  std::vector<std::barrier<>*> warp_ptrs;
  for (int w = 0; w < warps; ++w) {
    const int lanes = (w + 1) * kWarp <= threads ? kWarp : threads - w * kWarp;
    warp_sync.push_back(std::make_unique<std::barrier<>>(lanes));
    warp_ptrs.push_back(warp_sync.back().get());
  }
  std::vector<float> slots(threads);
  std::vector<unsigned char> shared(shared_bytes > 0 ? shared_bytes : 1);
  Block state{&sync, warp_ptrs.data(), slots.data(), {}, shared.data()};
  for (auto& f : state.or_flags) f = 0;
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([=, &state] {
      thread_idx.x = t;
      block_idx.x = b;
      block = &state;
      or_phase = 0;
      call_kernel(kernel, args, std::index_sequence_for<A...>{});
    });
  }
  for (auto& th : pool) th.join();
}

// The whole grid; at most `max_resident` CTAs run at once (the others start as running ones
// exit), playing a GPU too busy to hold the whole grid.
template <class... A>
void launch(void (*kernel)(A...), int grid, int threads, int shared_bytes, int max_resident,
            void** args) {
  block_dim.x = threads;
  grid_dim.x = grid;
  const int resident = max_resident > 0 && max_resident < grid ? max_resident : grid;
  std::counting_semaphore<> slots(resident);
  std::vector<std::thread> ctas;
  ctas.reserve(grid);
  for (int b = 0; b < grid; ++b) {
    slots.acquire();
    ctas.emplace_back([=, &slots] {
      run_block(kernel, b, threads, shared_bytes, args);
      slots.release();
    });
  }
  for (auto& c : ctas) c.join();
}

}  // namespace prnn_emu

#define PRNN_EMU_ENTRY(name)                                                                   \
  extern "C" void prnn_emu_launch_##name(int grid, int block, int shared_bytes, int max_resident, \
                                          void** args) {                                      \
    prnn_emu::launch(&name, grid, block, shared_bytes, max_resident, args);                    \
  }
