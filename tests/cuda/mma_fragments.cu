// mma_fragments.cu - hw.cuh's tensor-core mma alone, for the tests (like register_tile.cu): each
// warp loads its own A (16 x 16), B (16 x 8) and C (16 x 8) into fragments in the PTX ISA's layout
// ("Matrix Fragments for mma.m16n8k16 with floating point type"), computes D = A B + C and
// then E = A B + D (a second collective right after the first), and writes D and E back.
//   a: per warp, A row-major as 16 x 8 words, A[r][2j] in the low half of word 8r + j
//   bt: per warp, B column-major (B^T row-major) as 8 x 8 words, B[2j][n] low in word 8n + j
//   c, d, e: per warp, 16 x 8 floats row-major
//   dtype: 1 fp16, 2 bf16 (PRNN_WEIGHT_DTYPE's codes), 3 TF32: mma.m16n8k8, A (16 x 8) and B
//   (8 x 8) as fp32 words in the same places (A[r][j] in word 8r + j, B[k][n] in word 8n + k),
//   which the kernel rounds (prnn_tf32_bits) before the mma; its fragments ("Matrix Fragments for
//   mma.m16n8k8", .tf32) take the same words as the 16-bit ones: a0 (g, t), a1 (g + 8, t),
//   a2 (g, t + 4), a3 (g + 8, t + 4), b0 (t, g), b1 (t + 4, g)
//   ldmatrix: 0 loads A's fragments from global memory, 1 stages A in shared memory (512 bytes
//   per warp) and loads them with prnn_ldmatrix_x4
//   swap (the tests' sabotage): lanes swap_x and swap_y load each other's fragment of operand
//   `swap` (1 A, 2 B, 3 C; 0 none); with ldmatrix, they pass each other's row of A
#include "hw.cuh"

// Lane l's fragment of A (rows l / 4 and l / 4 + 8, the column pair 2(l % 4) in each half of k).
PRNN_DEVICE void load_a(unsigned (&fa)[4], const unsigned* a, int l) {
  const int g = l / 4, t = l % 4;
  fa[0] = a[8 * g + t];
  fa[1] = a[8 * (g + 8) + t];
  fa[2] = a[8 * g + 4 + t];
  fa[3] = a[8 * (g + 8) + 4 + t];
}

// The same through shared memory: lane l passes row l % 8 of the l / 8-th 8 x 8 quarter of A
// (rows 0-7 / 8-15 of columns 0-7, then of columns 8-15).
PRNN_DEVICE void load_a_shared(unsigned (&fa)[4], const unsigned* a, int l) {
  unsigned* staged = prnn_shared_memory<unsigned>() + threadIdx.x / 32 * 16 * 8;
  const int lane = threadIdx.x % 32;
  for (int i = 0; i < 4; ++i) staged[4 * lane + i] = a[4 * lane + i];
  prnn_sync_block();
  prnn_ldmatrix_x4(fa, staged + 8 * (l % 8 + 8 * (l / 8 % 2)) + 4 * (l / 16));
}

PRNN_KERNEL void mma_m16n8k16(const unsigned* a, const unsigned* bt, const float* c, float* d,
                              float* e, int dtype, int ldmatrix, int swap, int swap_x, int swap_y) {
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  a += warp * 16 * 8;
  bt += warp * 8 * 8;
  c += warp * 16 * 8;
  d += warp * 16 * 8;
  e += warp * 16 * 8;
  const int other = lane == swap_x ? swap_y : lane == swap_y ? swap_x : lane;
  // Lane l is in group l / 4 (rows l / 4 and l / 4 + 8 of A, C, D; column l / 4 of B) at place
  // l % 4 in it (the word of columns 2(l % 4), +1 of A in each half of k, of k of B, of C and D).
  unsigned fa[4];
  if (ldmatrix) {
    load_a_shared(fa, a, swap == 1 ? other : lane);
  } else {
    load_a(fa, a, swap == 1 ? other : lane);
  }
  const int gb = (swap == 2 ? other : lane) / 4, tb = (swap == 2 ? other : lane) % 4;
  const unsigned fb[2] = {bt[8 * gb + tb], bt[8 * gb + 4 + tb]};
  const int gc = (swap == 3 ? other : lane) / 4, tc = (swap == 3 ? other : lane) % 4;
  const float fc[4] = {c[8 * gc + 2 * tc], c[8 * gc + 2 * tc + 1], c[8 * (gc + 8) + 2 * tc],
                       c[8 * (gc + 8) + 2 * tc + 1]};
  float fd[4], fe[4];
  if (dtype == 3) {
    unsigned ta[4], tb[2];
    for (int i = 0; i < 4; ++i) ta[i] = prnn_tf32_bits(prnn_bits_float(fa[i]));
    for (int i = 0; i < 2; ++i) tb[i] = prnn_tf32_bits(prnn_bits_float(fb[i]));
    prnn_mma_tf32(fd, ta, tb, fc);
    prnn_mma_tf32(fe, ta, tb, fd);
  } else if (dtype == 2) {
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
