// half_convert.cu - the 16-bit conversions of hw.cuh alone, element by element, so that tests can
// hold them against ml_dtypes: on the host (emulation.h's software versions) and on a GPU (cvt).
#include "hw.cuh"

// f16[i], bf16[i]: in[i] rounded to fp16 / bf16 (to nearest, ties to even), back in fp32.
PRNN_KERNEL void round_to_16bit(const float* in, float* f16, float* bf16, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    f16[i] = prnn_round_f16(in[i]);
    bf16[i] = prnn_round_bf16(in[i]);
  }
}

// words[i] read as two fp16 / two bf16 values (low half first) into out[2i], out[2i+1].
PRNN_KERNEL void unpack_16bit_pairs(const unsigned* words, float* f16, float* bf16, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    prnn_f16x2_to_float(words[i], f16[2 * i], f16[2 * i + 1]);
    prnn_bf16x2_to_float(words[i], bf16[2 * i], bf16[2 * i + 1]);
  }
}
