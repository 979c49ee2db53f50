// chain_exit.cu - a layer kernel's exit alone (prnn_leave_layer, chain.cuh), for the emulation's
// tests of the device-side chain (tests/test_runtime.py's FakeKernel): CTA c leaves the launch
// that started from `first` with progress[c] as the last step it completed (-1: untouched), so
// the last CTA to leave settles the launch as the real kernels' does.
#include "chain.cuh"

PRNN_KERNEL void prnn_test_leave(unsigned* control, const int* progress, int end, int first) {
  prnn::prnn_leave_layer(control, progress[blockIdx.x], end, first);
}
