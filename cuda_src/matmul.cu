// matmul.cu - the library's own GEMM, C = A B, for the products issued while a stream is being
// captured into a CUDA graph (CuPy refuses every cuBLAS call then; persistent_rnn/matmul.py).
//
// A (m x k), B (k x n) and C (m x n) are strided matrices: element (i, j) of A is
// a[i * a_row + j * a_col], strides in elements, 64-bit, any sign (zero for broadcast operands),
// so that transposed operands and views need no copy. Each CTA of MM_THREADS threads computes
// one MM_TILE x MM_TILE tile of C (1-D grid, tiles of a row of C side by side), staging
// MM_TILE-wide slices of K of A and B in shared memory; each thread owns MM_TILE / MM_ROW_STEP
// rows of one column of the tile. Sums are in T (fp32 for float, as cuBLAS's fp32 GEMM; fp64
// for double), in order of k. Kernels are extern "C" (prnn_matmul_f32, prnn_matmul_f64) so that
// the host emulation compiles this file unchanged; the dynamic shared memory is
// 2 * MM_TILE * (MM_TILE + 1) * sizeof(T).
#include "hw.cuh"

namespace prnn {

// The shape, from persistent_rnn/matmul.py (its DEFINES: the launch's grid, block and shared
// bytes are computed there from the same numbers)
constexpr int MM_TILE = PRNN_MM_TILE;                // rows and columns of C per CTA; K per slice
constexpr int MM_THREADS = PRNN_MM_THREADS;          // threads per CTA
constexpr int MM_ROW_STEP = MM_THREADS / MM_TILE;    // rows between one thread's outputs
constexpr int MM_PITCH = MM_TILE + 1;                // padded shared rows: no bank conflicts

// Stage the MM_TILE x MM_TILE block of the (rows x cols) matrix src whose corner is (r0, c0) as
// tile[r * dst_row + c * dst_col], zero outside the matrix. Consecutive threads walk the source's
// unit-stride axis where it has one (coalesced loads for row- and column-major operands alike).
template <class T>
PRNN_DEVICE void stage_tile(const T* src, long long s_row, long long s_col, int rows, int cols,
                            int r0, int c0, int dst_row, int dst_col, T* tile) {
  const bool cols_fast = s_col == 1 || s_row != 1;
  for (int e = threadIdx.x; e < MM_TILE * MM_TILE; e += MM_THREADS) {
    const int fast = e % MM_TILE, slow = e / MM_TILE;
    const int r = cols_fast ? slow : fast, c = cols_fast ? fast : slow;
    const int i = r0 + r, j = c0 + c;
    tile[r * dst_row + c * dst_col] =
        i < rows && j < cols ? src[(long long)i * s_row + (long long)j * s_col] : T(0);
  }
}

template <class T>
PRNN_DEVICE void matmul(const T* a, const T* b, T* c, int m, int n, int k, long long a_row,
                        long long a_col, long long b_row, long long b_col, long long c_row,
                        long long c_col) {
  T* a_tile = prnn_shared_memory<T>();     // [kk][i]: A's slice, transposed
  T* b_tile = a_tile + MM_TILE * MM_PITCH;  // [kk][j]: B's slice
  const int tiles_n = (n + MM_TILE - 1) / MM_TILE;
  const int m0 = (int)(blockIdx.x / tiles_n) * MM_TILE, n0 = (int)(blockIdx.x % tiles_n) * MM_TILE;
  const int col = threadIdx.x % MM_TILE, row = threadIdx.x / MM_TILE;
  T acc[MM_TILE / MM_ROW_STEP];
  for (int r = 0; r < MM_TILE / MM_ROW_STEP; ++r) acc[r] = T(0);
  for (int k0 = 0; k0 < k; k0 += MM_TILE) {
    stage_tile<T>(a, a_row, a_col, m, k, m0, k0, 1, MM_PITCH, a_tile);
    stage_tile<T>(b, b_row, b_col, k, n, k0, n0, MM_PITCH, 1, b_tile);
    prnn_sync_block();
    const int depth = k - k0 < MM_TILE ? k - k0 : MM_TILE;  // (the zero padding adds nothing)
    for (int kk = 0; kk < depth; ++kk) {
      const T bv = b_tile[kk * MM_PITCH + col];
      for (int r = 0; r < MM_TILE / MM_ROW_STEP; ++r)
        acc[r] += a_tile[kk * MM_PITCH + row + r * MM_ROW_STEP] * bv;
    }
    prnn_sync_block();  // the slice is read before the next one overwrites it
  }
  const int j = n0 + col;
  for (int r = 0; r < MM_TILE / MM_ROW_STEP; ++r) {
    const int i = m0 + row + r * MM_ROW_STEP;
    if (i < m && j < n) c[(long long)i * c_row + (long long)j * c_col] = acc[r];
  }
}

}  // namespace prnn

#define PRNN_MATMUL_KERNEL(T, SUFFIX)                                                             \
  PRNN_KERNEL void prnn_matmul_##SUFFIX(const T* a, const T* b, T* c, int m, int n, int k,         \
                                        long long a_row, long long a_col, long long b_row,         \
                                        long long b_col, long long c_row, long long c_col) {       \
    prnn::matmul<T>(a, b, c, m, n, k, a_row, a_col, b_row, b_col, c_row, c_col);                  \
  }

PRNN_MATMUL_KERNEL(float, f32)
PRNN_MATMUL_KERNEL(double, f64)
