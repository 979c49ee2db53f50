// register_tile.cu - the register tile's product alone (TileOf, persistent_common.cuh), for the
// emulation's tests: one warp multiplies a `rows` x 32*PRNN_KPT matrix by a vector through a
// TileOf<rows, PRNN_KPT>, for any rows in 1..32 (the shipped tiles have only a few row counts),
// and the lane that holds a row's sum (row_of) writes it.
//   tile_rows_product  out[r] = sum_k m[r][k] v[k] (m row-major); out[r] for r >= rows untouched
#include "persistent_common.cuh"

namespace {

template <int R>
PRNN_DEVICE void tile_rows_product_of(const float* m, const float* v, float* out, int rows) {
  if constexpr (R <= prnn::kWarp) {
    if (rows != R) {
      tile_rows_product_of<R + 1>(m, v, out, rows);
      return;
    }
    using Tile = prnn::TileOf<R, PRNN_KPT>;
    const int lane = threadIdx.x % prnn::kWarp;
    int index[R];
#pragma unroll
    for (int r = 0; r < R; ++r) index[r] = r;
    Tile tile;
    tile.load(m, index, 0, Tile::kChunk, lane);
    const float sum = tile.multiply(v, lane);
    const int row = Tile::row_of(lane);
    if (lane % Tile::kLanesPerRow == 0 && row >= 0) out[row] = sum;
  }
}

}  // namespace

PRNN_KERNEL void tile_rows_product(const float* m, const float* v, float* out, int rows) {
  tile_rows_product_of<1>(m, v, out, rows);
}
