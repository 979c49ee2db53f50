// mma_fragments.cu - hw.cuh's tensor-core mma alone, for the tests (like register_tile.cu): each
// warp loads its own A (16 x 16), B (16 x 8) and C (16 x 8) into fragments in the PTX ISA's layout
// ("Matrix Fragments for mma.m16n8k16 with floating point type"), computes D = A B + C and
// then E = A B + D (a second collective right after the first), and writes D and E back.
//   a: per warp, A row-major as 16 x 8 words, A[r][2j] in the low half of word 8r + j
//   bt: per warp, B column-major (B^T row-major) as 8 x 8 words, B[2j][n] low in word 8n + j
//   c, d, e: per warp, 16 x 8 floats row-major
//   dtype: 1 fp16, 2 bf16 (PRNN_WEIGHT_DTYPE's codes)
//   swap (the tests' sabotage): lanes swap_x and swap_y load each other's fragment of operand
//   `swap` (1 A, 2 B, 3 C; 0 none)
#include "hw.cuh"

PRNN_KERNEL void mma_m16n8k16(const unsigned* a, const unsigned* bt, const float* c, float* d,
                              float* e, int dtype, int swap, int swap_x, int swap_y) {
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  a += warp * 16 * 8;
  bt += warp * 8 * 8;
  c += warp * 16 * 8;
  d += warp * 16 * 8;
  e += warp * 16 * 8;
  const int other = lane == swap_x ? swap_y : lane == swap_y ? swap_x : lane;
  // Lane l is in group l / 4 (rows l / 4 and l / 4 + 8 of A, C, D; column l / 4 of B) at place
  // l % 4 in it (the word of columns 2(l % 4), +1 of A in each half of k, of k of B, of C and D).
  const int ga = (swap == 1 ? other : lane) / 4, ta = (swap == 1 ? other : lane) % 4;
  const unsigned fa[4] = {a[8 * ga + ta], a[8 * (ga + 8) + ta], a[8 * ga + 4 + ta],
                          a[8 * (ga + 8) + 4 + ta]};
  const int gb = (swap == 2 ? other : lane) / 4, tb = (swap == 2 ? other : lane) % 4;
  const unsigned fb[2] = {bt[8 * gb + tb], bt[8 * gb + 4 + tb]};
  const int gc = (swap == 3 ? other : lane) / 4, tc = (swap == 3 ? other : lane) % 4;
  const float fc[4] = {c[8 * gc + 2 * tc], c[8 * gc + 2 * tc + 1], c[8 * (gc + 8) + 2 * tc],
                       c[8 * (gc + 8) + 2 * tc + 1]};
  float fd[4], fe[4];
  if (dtype == 2) {
    prnn_mma_bf16(fd, fa, fb, fc);
    prnn_mma_bf16(fe, fa, fb, fd);
  } else {
    prnn_mma_f16(fd, fa, fb, fc);
    prnn_mma_f16(fe, fa, fb, fd);
  }
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int at = 8 * (g + 8 * (i / 2)) + 2 * t + i % 2;
    d[at] = fd[i];
    e[at] = fe[i];
  }
}
