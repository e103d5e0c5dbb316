// The weight-only linears of weight_only.cpp, for the fused blocks of blocks.cpp.
#pragma once
#include <ATen/ATen.h>

namespace igserve {
// x [R, K] float32 @ W^T for Q4_1 W (qs [N, K/2] nibbles, dm [N, K/32] fp16 d|m) -> [R, N];
// q8: x rounded to int8 per group of 32 first; wide: int4bf16's bf16 weight [N, K], used from wide_rows()
// rows; tiles: the same groups in 16-channel tiles (uint8 [N/16, K/32, 320]), used for one row of q8
// (AVX-512 VNNI) and up to tile_rows() rows of int4bf16 (AVX-512 VNNI too) (weight_only.cpp)
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm, bool q8 = false,
                     const std::optional<at::Tensor>& wide = std::nullopt,
                     const std::optional<at::Tensor>& tiles = std::nullopt);
// x [R, K] float32 @ (q * scales[:, None])^T, q int8 [N, K] -> [R, N]; wide: as for q4_linear; tiles: q + 128
// in 16-channel tiles (uint8 [N/16, K/32, 512]), used for up to tile_rows() rows on AVX-512 VNNI
at::Tensor i8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                     const std::optional<at::Tensor>& wide = std::nullopt,
                     const std::optional<at::Tensor>& tiles = std::nullopt);
// x [R, K] float32 @ W^T for a bfloat16 W [N, K] (each weight widened to float32); wide: as for q4_linear
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& wide = std::nullopt);
// x [R, K] float32 @ W^T for a float32 W [N, K]: the register tiles for up to 4 rows, at::linear above
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w);
}  // namespace igserve
