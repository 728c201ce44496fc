#pragma once
// PNG output through libpng: sample grids from pixel-space models.
#include <cstdint>
#include <string>
#include <vector>

#include "core/host_tensor.h"

namespace flux8 {

// Writes an 8-bit RGB image (rgb: height rows of width·3 bytes, top row first) to
// path + ".tmp.<pid>" and renames it over `path`, so a reader never sees a partial file.
// Errors name the path.
void write_png_rgb8(const std::string& path, int64_t width, int64_t height, const std::vector<uint8_t>& rgb);

// Gutter colour of image grids (mid grey, distinct from both black and white samples).
inline constexpr uint8_t kGridGutterValue = 128;

// Lays out `images` ([3, h, w] each, values in [-1, 1], all the same size) row-major on a
// rows × cols grid, image i at row i / cols, column i % cols; each pixel is repeated
// `scale` × `scale` times (nearest neighbour, so tiny images stay visible), cells are
// separated by `gutter` pixels of kGridGutterValue (none around the border), cells without an
// image are gutter coloured. Values map to round((v + 1) / 2 · 255), clamped to [0, 255].
// Returns the RGB8 bytes and sets *width, *height.
std::vector<uint8_t> image_grid_rgb8(const std::vector<HostTensor>& images, int64_t rows, int64_t cols, int64_t scale,
                                     int64_t gutter, int64_t* width, int64_t* height);

// image_grid_rgb8() written as a PNG to `path`.
void write_image_grid(const std::string& path, const std::vector<HostTensor>& images, int64_t rows, int64_t cols,
                      int64_t scale = 1, int64_t gutter = 2);

}  // namespace flux8
