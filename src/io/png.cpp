#include "io/png.h"

#include <png.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace flux8 {

namespace {

// libpng reports errors through a callback that must not return; throwing through libpng's C
// frames is unsafe, so the message is kept and control returns with longjmp.
struct PngError {
  std::string message;
};

void on_png_error(png_structp png, png_const_charp msg) {
  static_cast<PngError*>(png_get_error_ptr(png))->message = msg;
  png_longjmp(png, 1);
}
void on_png_warning(png_structp, png_const_charp) {}

// Writes the PNG to an open file; returns "" or the libpng error.
std::string encode(FILE* f, int64_t width, int64_t height, const std::vector<uint8_t>& rgb) {
  PngError err;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &err, on_png_error, on_png_warning);
  if (!png) return "png_create_write_struct failed";
  png_infop info = png_create_info_struct(png);
  if (!info) {
    png_destroy_write_struct(&png, nullptr);
    return "png_create_info_struct failed";
  }
  std::vector<png_bytep> row_ptrs(static_cast<size_t>(height));
  for (int64_t y = 0; y < height; ++y)
    row_ptrs[static_cast<size_t>(y)] = const_cast<png_bytep>(rgb.data() + y * width * 3);
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    return err.message.empty() ? "libpng error" : err.message;
  }
  png_init_io(png, f);
  png_set_IHDR(png, info, static_cast<png_uint_32>(width), static_cast<png_uint_32>(height), 8, PNG_COLOR_TYPE_RGB,
               PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  png_write_image(png, row_ptrs.data());
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return "";
}

}  // namespace

void write_png_rgb8(const std::string& path, int64_t width, int64_t height, const std::vector<uint8_t>& rgb) {
  if (width < 1 || height < 1 || width > 0x7FFFFFFF || height > 0x7FFFFFFF)
    fail("PNG {}: invalid size {}x{}", path, width, height);
  if (static_cast<int64_t>(rgb.size()) != width * height * 3)
    fail("PNG {}: {} bytes given for a {}x{} RGB image ({} expected)", path, rgb.size(), width, height,
         width * height * 3);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail("cannot write PNG {}: {}", tmp, std::strerror(errno));
  std::string problem = encode(f, width, height, rgb);
  if (problem.empty() && (std::fflush(f) != 0 || ::fsync(::fileno(f)) != 0)) problem = std::strerror(errno);
  if (std::fclose(f) != 0 && problem.empty()) problem = std::strerror(errno);
  if (problem.empty()) {
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    if (!ec) return;
    problem = "renaming " + tmp + ": " + ec.message();
  }
  std::remove(tmp.c_str());
  fail("cannot write PNG {}: {}", path, problem);
}

std::vector<uint8_t> image_grid_rgb8(const std::vector<HostTensor>& images, int64_t rows, int64_t cols, int64_t scale,
                                     int64_t gutter, int64_t* width, int64_t* height) {
  if (images.empty()) fail("image grid: no images");
  if (rows < 1 || cols < 1 || scale < 1 || gutter < 0)
    fail("image grid: rows {}, cols {}, scale {} must be >= 1 and gutter {} >= 0", rows, cols, scale, gutter);
  if (static_cast<int64_t>(images.size()) > rows * cols)
    fail("image grid: {} images do not fit {} rows x {} columns", images.size(), rows, cols);
  const std::vector<int64_t> shape = images[0].shape;
  if (shape.size() != 3 || shape[0] != 3)
    fail("image grid: images must be [3, height, width] RGB, image 0 has rank {}{}", shape.size(),
         shape.empty() ? "" : fmt::format(" with {} channels", shape[0]));
  for (size_t i = 0; i < images.size(); ++i)
    if (images[i].shape != shape || images[i].numel() != static_cast<int64_t>(images[i].data.size()))
      fail("image grid: image {} is not shaped like image 0 [3, {}, {}]", i, shape[1], shape[2]);
  const int64_t h = shape[1], w = shape[2], cell_h = h * scale, cell_w = w * scale;
  const int64_t W = cols * cell_w + (cols - 1) * gutter, H = rows * cell_h + (rows - 1) * gutter;
  std::vector<uint8_t> rgb(static_cast<size_t>(W * H * 3), kGridGutterValue);
  for (size_t i = 0; i < images.size(); ++i) {
    const int64_t r = static_cast<int64_t>(i) / cols, c = static_cast<int64_t>(i) % cols;
    const int64_t y0 = r * (cell_h + gutter), x0 = c * (cell_w + gutter);
    for (int64_t ch = 0; ch < 3; ++ch)
      for (int64_t y = 0; y < cell_h; ++y)
        for (int64_t x = 0; x < cell_w; ++x) {
          double v = images[i].data[static_cast<size_t>((ch * h + y / scale) * w + x / scale)];
          if (std::isnan(v)) v = -1.0;  // black; the caller reports non-finite samples
          const double byte = std::round((std::clamp(v, -1.0, 1.0) + 1.0) * 127.5);
          rgb[static_cast<size_t>(((y0 + y) * W + x0 + x) * 3 + ch)] = static_cast<uint8_t>(byte);
        }
  }
  *width = W;
  *height = H;
  return rgb;
}

void write_image_grid(const std::string& path, const std::vector<HostTensor>& images, int64_t rows, int64_t cols,
                      int64_t scale, int64_t gutter) {
  int64_t W = 0, H = 0;
  std::vector<uint8_t> rgb;
  try {
    rgb = image_grid_rgb8(images, rows, cols, scale, gutter, &W, &H);
  } catch (const Error& e) {
    fail("{}: {}", path, e.what());
  }
  write_png_rgb8(path, W, H, rgb);
}

}  // namespace flux8
