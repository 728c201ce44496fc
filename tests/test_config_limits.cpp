// Config input that is hostile or absurd rather than mistyped: numbers beyond every key's range
// or beyond int64, YAML that is not an integer where one is due, deep nesting, includes of
// directories and devices, include chains, malformed --set. Each is a flux8::Error naming the
// file or --set and the key, in bounded time, and the sizes derived from the largest accepted
// values fit their types.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "config/config.h"
#include "config/schema.h"
#include "core/error.h"
#include "model/flops.h"
#include "model/flux_config.h"
#include "model/flux_model.h"
#include "model/params.h"
#include "test_util.h"

namespace flux8 {
namespace {

using ConfigFiles = testing::TempDir;
using testing::error_of;
using testing::expect_mentions;

// Loads `text` as a file and returns the error.
std::string load_error(const ConfigFiles& files, const std::string& text, const std::string& name = "x.yaml") {
  const std::string path = files.write(name, text);
  return error_of([&] { FluxConfig::from_config(Config::load(path)); });
}

TEST(ConfigLimits, EveryIntegerKeyHasAnUpperBoundADoubleComparesExactly) {
  for (const KeySpec& k : config_keys()) {
    if (k.type != KeyType::integer && k.type != KeyType::int_list) continue;
    SCOPED_TRACE(k.name);
    EXPECT_TRUE(std::isfinite(k.range.lo));
    EXPECT_TRUE(std::isfinite(k.range.hi));
    EXPECT_LT(k.range.hi, 9007199254740992.0);  // 2^53
    EXPECT_EQ(k.range.hi, std::trunc(k.range.hi));
    // The bound is what the key docs show.
    EXPECT_NE(describe_keys().find(k.range.describe()), std::string::npos);
  }
}

TEST(ConfigLimits, HugeModelValuesNameTheKeyTheValueAndTheRange) {
  ConfigFiles files;
  struct Case {
    std::string key, value, allowed;
  };
  for (const Case& c : std::vector<Case>{{"image_size", "99999999999999999999", "in [1, 16384]"},
                                         {"image_size", "9223372036854775807", "in [1, 16384]"},
                                         {"hidden_size", "4294967296", "in [1, 65536]"},
                                         {"patch_size", "-9223372036854775808", "in [1, 64]"},
                                         {"mlp_ratio", "1e300", "in (0, 64]"},
                                         {"mlp_ratio", "1e999", "in (0, 64]"},
                                         {"text_seq_len", "3000000000", "in [1, 65536]"},
                                         {"micro_batch_size", "2147483648", "in [1, 65536]"},
                                         {"train_iters", "1000000000000", "in [1, 1000000000]"},
                                         {"fp8_amax_history_len", "1099511627776", "in [1, 65536]"}}) {
    SCOPED_TRACE(c.key + "=" + c.value);
    const std::string p = files.write("x.yaml", c.key + ": " + c.value + "\n");
    expect_mentions(error_of([&] { Config::load(p); }), {c.key + " in " + p + ":1", c.allowed, "'" + c.value + "'"});
  }
}

TEST(ConfigLimits, IntegerKeysRefuseEveryOtherKindOfYamlValue) {
  ConfigFiles files;
  for (const std::string value : {"1e12", "1.5", "4.0", "-3", "abc", "true", "0x10", "[1]", "{a: 1}", "", "\"\"",
                                  "99999999999999999999999999999999999999"}) {
    SCOPED_TRACE(value);
    const std::string p = files.write("x.yaml", "num_double_blocks: " + value + "\n");
    expect_mentions(error_of([&] { Config::load(p); }),
                    {"num_double_blocks in " + p + ":1", "must be an integer in [0, 1024]"});
  }
}

// num_double_blocks drives loops (parameter layout, FLOPs, activation plans): far past its bound
// it is refused before any of them runs.
TEST(ConfigLimits, BlockCountsAreRefusedBeforeAnyLoop) {
  ConfigFiles files;
  expect_mentions(load_error(files, "num_double_blocks: 1000000000000\n"),
                  {"num_double_blocks", "'1000000000000'", "in [0, 1024]"});
  expect_mentions(load_error(files, "num_single_blocks: 1025\n"), {"num_single_blocks", "in [0, 1024]"});
  FluxConfig code_built;
  code_built.num_double_blocks = int64_t{1} << 40;
  expect_mentions(error_of([&] { code_built.validate("code"); }), {"num_double_blocks", "in [0, 1024]"});
}

// The largest accepted model: every width at its bound, 2 x 1024 blocks. The derived sizes
// (head dim, MLP width, parameter counts, FLOPs, the activation plan) fit their types; under
// UBSan an overflow in any of them fails this test.
TEST(ConfigLimits, DerivedSizesOfTheLargestAcceptedModelFit) {
  Config cfg;
  for (const char* s : {"hidden_size=65536", "num_attention_heads=2", "axes_dim=[2, 16382, 16384]", "mlp_ratio=64",
                        "num_double_blocks=1024", "num_single_blocks=1024", "in_channels=65536", "out_channels=65536",
                        "context_dim=65536", "vec_dim=65536", "latent_channels=65536", "text_seq_len=65536",
                        "patch_size=64", "vae_downsample=64", "image_size=16384"})
    cfg.apply_override(s);
  const FluxConfig m = FluxConfig::from_config(cfg);
  EXPECT_EQ(m.head_dim(), 32768);
  EXPECT_EQ(m.mlp_hidden(), int64_t{1} << 22);
  EXPECT_EQ(m.image_tokens(16384), 16);
  const int64_t params = ParamLayout::build(m).total();
  // Each block holds at least its MLP's two H x M weights.
  EXPECT_GT(params, 2048 * 2 * (int64_t{1} << 38));
  const StepShape shape{1, m.text_seq_len, m.image_tokens(16384)};
  EXPECT_TRUE(std::isfinite(model_flops(m, shape).training()));
  const ActivationEstimate act = FluxModel::estimate_activations(m, shape, Recompute::none);
  EXPECT_GT(act.gpu_bytes(false), 0.0);
  EXPECT_GT(act.workspace.bf16, 0.0);
}

TEST(ConfigLimits, AStepBeyondWhatFlux8PlansIsRefusedNamingItsKeys) {
  Config cfg;
  for (const char* s : {"vae_downsample=1", "patch_size=1", "image_size=16384", "micro_batch_size=65536"})
    cfg.apply_override(s);
  expect_mentions(error_of([&] { FluxConfig::from_config(cfg); }),
                  {"micro_batch_size 65536", "268435456 image tokens", "image_size 16384", "2^50"});
  // The same model at batch 1 is a step flux8 can plan.
  cfg.apply_override("micro_batch_size=1");
  EXPECT_EQ(FluxConfig::from_config(cfg).image_tokens(16384), 268435456);
}

TEST(ConfigLimits, AxesDimBeyondIntOrOfTheWrongLengthIsRefused) {
  ConfigFiles files;
  expect_mentions(load_error(files, "axes_dim: [16, 56, 4294967352]\n"),
                  {"axes_dim", "each in [1, 65536]", "[16, 56, 4294967352]"});
  expect_mentions(load_error(files, "axes_dim: [64, 64]\n"), {"axes_dim has 2 entries but must have 3", "128"});
  expect_mentions(load_error(files, "axes_dim: [32, 32, 32, 32]\n"), {"axes_dim has 4 entries but must have 3"});
  expect_mentions(load_error(files, "axes_dim: []\n"), {"axes_dim has 0 entries"});
  FluxConfig code_built;
  code_built.axes_dim = {128};
  expect_mentions(error_of([&] { code_built.validate("code"); }), {"code", "axes_dim has 1 entries"});
}

TEST(ConfigLimits, IncludeOfADirectoryOrADeviceIsRefusedNamingTheIncludingLine) {
  ConfigFiles files;
  files.write("sub/a.yaml", "seed: 1\n");
  const std::string dir = files.write("dir.yaml", "seed: 2\ninclude: sub\n");
  expect_mentions(error_of([&] { Config::load(dir); }), {dir + ":2: include 'sub'", "is a directory"});
  const std::string dev = files.write("dev.yaml", "bases: [/dev/zero]\n");
  expect_mentions(error_of([&] { Config::load(dev); }),
                  {dev + ":1: bases '/dev/zero'", "'/dev/zero' is a device, FIFO or socket, not a regular file"});
  const std::string empty = files.write("empty.yaml", "include: ''\n");
  expect_mentions(error_of([&] { Config::load(empty); }), {empty + ":1: include ''", "is a directory"});
  // The top-level file too.
  expect_mentions(error_of([&] { Config::load("/dev/zero"); }),
                  {"'/dev/zero' is a device, FIFO or socket, not a regular file"});
  expect_mentions(error_of([&] { Config::load(files.path("sub")); }), {files.path("sub"), "is a directory"});
}

TEST(ConfigLimits, AnOversizedConfigIsRefusedBeforeItIsParsed) {
  ConfigFiles files;
  files.write("big.yaml", "# " + std::string(kMaxConfigFileBytes, 'x') + "\n");
  const std::string p = files.write("x.yaml", "include: big.yaml\n");
  expect_mentions(error_of([&] { Config::load(p); }), {p + ":1: include 'big.yaml'", "big.yaml", "bytes"});
  expect_mentions(error_of([&] { Config::load_text(std::string(kMaxConfigFileBytes + 1, ' '), "state.yaml"); }),
                  {"state.yaml", "bytes of config"});
}

TEST(ConfigLimits, IncludeDepthAndTheNumberOfFilesReadAreBounded) {
  ConfigFiles files;
  // A chain deeper than the limit: f0 includes f1 includes ... f19.
  for (int i = 0; i < 20; ++i)
    files.write("chain/f" + std::to_string(i) + ".yaml", "include: f" + std::to_string(i + 1) + ".yaml\n");
  files.write("chain/f20.yaml", "seed: 1\n");
  expect_mentions(error_of([&] { Config::load(files.path("chain/f0.yaml")); }),
                  {"include 'f16.yaml'", "17 files deep", "more than the 16 allowed"});
  // Diamonds that double at every level: 2^12 reads of the last file if nothing stopped them.
  for (int i = 0; i < 12; ++i) {
    const std::string next = "d" + std::to_string(i + 1) + ".yaml";
    files.write("fan/d" + std::to_string(i) + ".yaml", "include: [" + next + ", " + next + "]\n");
  }
  files.write("fan/d12.yaml", "seed: 1\n");
  expect_mentions(error_of([&] { Config::load(files.path("fan/d0.yaml")); }),
                  {"reads more than 256 config files", "include 'd"});
}

TEST(ConfigLimits, DeeplyNestedYamlIsRefusedNamingTheFile) {
  ConfigFiles files;
  const std::string flow = files.write("flow.yaml", "axes_dim: " + std::string(100000, '[') + "\n");
  expect_mentions(error_of([&] { Config::load(flow); }), {flow + ":", "malformed YAML", "levels deep"});
  std::string block = "axes_dim:\n  ";
  for (int i = 0; i < 5000; ++i) block += "- ";
  const std::string dashes = files.write("block.yaml", block + "1\n");
  expect_mentions(error_of([&] { Config::load(dashes); }), {dashes, "malformed YAML"});
  // Shallow nesting parses, and is refused as a value.
  expect_mentions(load_error(files, "axes_dim: [[[1]]]\n"), {"axes_dim", "a list of integers", "[[...]]"});
  expect_mentions(error_of([&] { Config::load_text("seed: 1\n", "t.yaml", {"axes_dim=" + std::string(5000, '[')}); }),
                  {"axes_dim in --set", "malformed YAML"});
}

TEST(ConfigLimits, SetOverridesAreValidatedLikeFileValues) {
  ConfigFiles files;
  const std::string p = files.write("x.yaml", "seed: 1\n");
  auto set_error = [&](const std::string& s) {
    return error_of([&] { FluxConfig::from_config(Config::load(p, {s})); });
  };
  expect_mentions(set_error("num_double_blocks=1e12"), {"num_double_blocks in --set", "in [0, 1024]", "'1e12'"});
  expect_mentions(set_error("hidden_size=99999999999999999999"), {"hidden_size in --set", "in [1, 65536]"});
  expect_mentions(set_error("axes_dim=[16, 56, 4294967352]"), {"axes_dim in --set", "each in [1, 65536]"});
  expect_mentions(set_error("axes_dim=[64, 64]"), {"axes_dim has 2 entries"});
  expect_mentions(set_error("=4"), {"--set '=4'", "no key"});
  expect_mentions(set_error(" \t=4"), {"no key"});
  expect_mentions(set_error("seed"), {"--set 'seed'", "key=value"});
  expect_mentions(set_error("seed=[1, 2"), {"seed in --set", "malformed YAML"});
  expect_mentions(set_error("image_size={a: 1}"), {"image_size in --set", "got a mapping"});
}

TEST(ConfigLimits, MessagesQuoteLongOrBinaryTextShortly) {
  ConfigFiles files;
  const std::string huge(500000, '7');
  const std::string msg = load_error(files, "hidden_size: " + huge + "\n");
  expect_mentions(msg, {"hidden_size", "in [1, 65536]", "..."});
  EXPECT_LT(msg.size(), 400u) << msg;
  const std::string clean = files.write("clean.yaml", "seed: 1\n");
  const std::string key(100000, 'k');
  const std::string unknown = error_of([&] { Config::load(clean, {key + "=1"}); });
  expect_mentions(unknown, {"unknown config key", "..."});
  EXPECT_LT(unknown.size(), 600u);
  const std::string binary = error_of([&] { Config::load(clean, {std::string("\x01\x02=3", 4)}); });
  expect_mentions(binary, {"\\x01\\x02"});
}

// A string holding control characters survives dump() and loads back as the same string.
TEST(ConfigLimits, DumpEscapesControlCharacters) {
  Config cfg;
  cfg.set("model_name", "\"a\\tb\\x01c\"");
  ASSERT_EQ(cfg.get_string("model_name"), std::string("a\tb\x01"
                                                      "c"));
  const Config back = Config::load_text(cfg.dump(), "dump.yaml");
  EXPECT_EQ(back.get_string("model_name"), cfg.get_string("model_name"));
}

#ifdef FLUX8_BINARY
// `flux8 info` with absurd sizes: a clear error and a non-zero exit, never a hang.
TEST(ConfigLimits, InfoRefusesAbsurdSizesFromTheConfigAndItsOptions) {
  ConfigFiles files;
  const std::string model = std::string(FLUX8_SOURCE_DIR) + "/configs/models/flux_535m.yaml";
  std::string log;
  EXPECT_NE(testing::run_flux8("info -c " + model + " --set num_double_blocks=1e12", files.path("log.txt"), &log), 0);
  expect_mentions(log, {"num_double_blocks in --set", "in [0, 1024]"});
  EXPECT_NE(testing::run_flux8("info -c " + model + " --image-size 99999999999", files.path("log.txt"), &log), 0);
  expect_mentions(log, {"image_size in --image-size", "in [1, 16384]"});
  EXPECT_NE(testing::run_flux8("info -c " + model + " --batch=-1", files.path("log.txt"), &log), 0);
  expect_mentions(log, {"micro_batch_size in --batch", "in [1, 65536]"});
  EXPECT_EQ(testing::run_flux8("info -c " + model + " --image-size 512 --batch 2", files.path("log.txt"), &log), 0)
      << log;
  expect_mentions(log, {"batch 2", "512 px"});
}
#endif

}  // namespace
}  // namespace flux8
