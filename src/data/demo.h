#pragma once
// The embedded demo dataset: procedural RGB images of one coloured shape on a dark
// background, captioned "red circle top left". Every sample is a pure function of
// (seed, index), so shards can be regenerated bit for bit anywhere.
//
//   index -> attributes   mixed radix over (colour, shape, position): colour = i % 7,
//                         shape = i / 7 % 3, position = i / 21 % 5, so any 105 consecutive
//                         indices hold every combination exactly once
//   (seed, index) -> geometry   shape side about a third of the image side (+-10%), centre at
//                         the named position (quadrant centre or image centre) +- 5% of the
//                         side; the shape always stays inside its quadrant / the central half
//   pixels                "image" f32 [3, H, W] in [-1, 1], edges anti-aliased: a pixel
//                         blends shape and background colour by the area it has inside the shape
//   text                  "t5" / "clip" from DemoTextEncoder applied to the caption
//
// On disk (write_demo_dataset): WebDataset tar shards out_dir/train-000000.tar ... and
// out_dir/val-000000.tar ..., each sample as KEY.image.npy, KEY.t5.npy, KEY.clip.npy and
// KEY.txt with KEY the six-digit global index (val continues after train, so keys are unique),
// plus out_dir/empty_prompt.{t5,clip}.npy (the encoder applied to "") and out_dir/manifest.json.
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "data/sample.h"

namespace flux8 {

inline constexpr std::array<std::string_view, 7> kDemoColours = {"red",  "green",   "blue", "yellow",
                                                                 "cyan", "magenta", "white"};
inline constexpr std::array<std::string_view, 3> kDemoShapes = {"circle", "square", "triangle"};
inline constexpr std::array<std::string_view, 5> kDemoPositions = {"top left", "top right", "bottom left",
                                                                   "bottom right", "center"};
inline constexpr int64_t kDemoCombinations = 7 * 3 * 5;
inline constexpr int kDemoFormatVersion = 1;

// Colours in [0, 1] RGB (the image stores 2c - 1).
inline constexpr std::array<std::array<float, 3>, 7> kDemoColourRGB = {{
    {0.95f, 0.10f, 0.10f},  // red
    {0.10f, 0.85f, 0.15f},  // green
    {0.15f, 0.25f, 1.00f},  // blue
    {0.95f, 0.90f, 0.10f},  // yellow
    {0.10f, 0.90f, 0.95f},  // cyan
    {0.90f, 0.15f, 0.90f},  // magenta
    {0.95f, 0.95f, 0.95f},  // white
}};
inline constexpr std::array<float, 3> kDemoBackgroundRGB = {0.06f, 0.06f, 0.08f};

struct DemoAttributes {
  int colour = 0;               // index into kDemoColours
  int shape = 0;                // index into kDemoShapes
  int position = 0;             // index into kDemoPositions
  std::string caption() const;  // "red circle top left"
};

// Where the shape is drawn, in pixels (pixel (x, y) covers [x, x+1) x [y, y+1)).
struct DemoGeometry {
  float cx = 0, cy = 0;  // centre
  float half = 0;        // half the side of the shape's bounding square
};

struct DemoSpec {
  int64_t image_size = 32;
  int64_t text_seq_len = 8;
  int64_t context_dim = 32;
  int64_t vec_dim = 32;
  int64_t train_samples = 4000;
  int64_t val_samples = 200;
  int64_t samples_per_shard = 1000;
  uint64_t seed = 0;
};

DemoAttributes demo_attributes(int64_t index);
DemoGeometry demo_geometry(uint64_t seed, int64_t index, int64_t image_size);
// f32 [3, size, size] in [-1, 1].
HostTensor render_demo_image(const DemoAttributes& a, const DemoGeometry& g, int64_t image_size);
// Every word a demo caption uses, each once, in a fixed order.
std::vector<std::string> demo_vocabulary();

// Sample `index` complete: fields "image", "t5", "clip"; caption; key = six-digit index.
Sample demo_sample(const DemoSpec& spec, int64_t index);
std::string demo_key(int64_t index);  // "000042"

// A .npy v1.0 file (little-endian '<f4', C order) holding `t`.
std::string encode_npy_f32(const HostTensor& t);

// Writes shards, empty-prompt encodings and the manifest (last, atomically, so an interrupted
// run leaves no manifest and is regenerated). Removes train-*.tar / val-*.tar left in out_dir
// by an earlier run so a directory listing never mixes two datasets.
void write_demo_dataset(const std::string& out_dir, const DemoSpec& spec);
// True when out_dir holds a complete dataset written from exactly this spec by this format
// version; false (never an error) when the manifest is missing, unreadable or different, or a
// listed file is missing.
bool demo_dataset_matches(const std::string& out_dir, const DemoSpec& spec);
// Shard file names (no directory) for a spec: {"train-000000.tar", ...}.
std::vector<std::string> demo_shard_names(const DemoSpec& spec, std::string_view split);

}  // namespace flux8
