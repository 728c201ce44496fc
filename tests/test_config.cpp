// Config loading: defaults, include/--set precedence, provenance, and the error messages a user
// sees for every kind of mistake (each must name the file, line, key and what is allowed).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "backend/backend.h"
#include "config/config.h"
#include "core/error.h"
#include "model/flux_config.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace flux8;

namespace {

using ConfigFiles = flux8::testing::TempDir;
using flux8::testing::error_of;
using flux8::testing::expect_mentions;

}  // namespace

TEST(Config, DefaultsAreFlux12bSchnell) {
  Config cfg;
  EXPECT_EQ(cfg.get_string("model_name"), "flux_12b_schnell");
  EXPECT_EQ(cfg.get_int("hidden_size"), 3072);
  EXPECT_EQ(cfg.get_int("num_double_blocks"), 19);
  EXPECT_EQ(cfg.get_int("num_single_blocks"), 38);
  EXPECT_EQ(cfg.get_int_list("axes_dim"), (std::vector<int64_t>{16, 56, 56}));
  EXPECT_DOUBLE_EQ(cfg.get_float("qk_norm_eps"), 1e-6);
  EXPECT_FALSE(cfg.get_bool("guidance_embed"));
  EXPECT_EQ(cfg.get_int("image_size"), 256);
  EXPECT_EQ(cfg.get_int("seed"), 1234);
  EXPECT_EQ(cfg.get_int("micro_batch_size"), 1);
  EXPECT_EQ(cfg.get_string("backend"), "cpu");
  EXPECT_EQ(cfg.source("hidden_size"), "default");
}

TEST(Config, EmptyFileGivesDefaults) {
  ConfigFiles files;
  Config cfg = Config::load(files.write("empty.yaml", "# nothing\n"));
  EXPECT_EQ(cfg.get_int("hidden_size"), 3072);
}

TEST(Config, IncludingFileOverridesIncludedAndSetOverridesBoth) {
  ConfigFiles files;
  files.write("base.yaml", "hidden_size: 1024\nnum_attention_heads: 8\nseed: 7\n");
  const std::string exp = files.write("exp.yaml", "num_attention_heads: 16\ninclude: base.yaml\n");
  Config cfg = Config::load(exp, {"seed=99"});
  EXPECT_EQ(cfg.get_int("hidden_size"), 1024);
  EXPECT_EQ(cfg.source("hidden_size"), files.path("base.yaml") + ":1");
  // The include line comes after the key, but includes are always read first.
  EXPECT_EQ(cfg.get_int("num_attention_heads"), 16);
  EXPECT_EQ(cfg.source("num_attention_heads"), exp + ":1");
  EXPECT_EQ(cfg.get_int("seed"), 99);
  EXPECT_EQ(cfg.source("seed"), "--set");
  EXPECT_EQ(cfg.source("vec_dim"), "default");
  EXPECT_EQ(cfg.path(), exp);
}

TEST(Config, IncludeListAppliesInOrderAndBasesIsASynonym) {
  ConfigFiles files;
  files.write("a.yaml", "seed: 1\nvec_dim: 10\n");
  files.write("b.yaml", "seed: 2\n");
  Config cfg = Config::load(files.write("exp.yaml", "bases: [a.yaml, b.yaml]\n"));
  EXPECT_EQ(cfg.get_int("seed"), 2);
  EXPECT_EQ(cfg.get_int("vec_dim"), 10);
}

TEST(Config, NestedIncludesResolveRelativeToEachFile) {
  ConfigFiles files;
  files.write("models/base/arch.yaml", "hidden_size: 512\nseed: 3\n");
  files.write("models/small.yaml", "include: base/arch.yaml\nseed: 4\n");
  Config cfg = Config::load(files.write("exp/run.yaml", "include:\n  - ../models/small.yaml\n"));
  EXPECT_EQ(cfg.get_int("hidden_size"), 512);
  EXPECT_EQ(cfg.get_int("seed"), 4);
  EXPECT_EQ(cfg.source("seed"), files.path("models/small.yaml") + ":2");
}

TEST(Config, DiamondIncludeIsNotACycle) {
  ConfigFiles files;
  files.write("common.yaml", "seed: 5\n");
  files.write("left.yaml", "include: common.yaml\n");
  files.write("right.yaml", "include: common.yaml\n");
  Config cfg = Config::load(files.write("top.yaml", "include: [left.yaml, right.yaml]\n"));
  EXPECT_EQ(cfg.get_int("seed"), 5);
}

TEST(Config, SetParsesEachType) {
  ConfigFiles files;
  Config cfg = Config::load(files.write("x.yaml", "hidden_size: 64\n"),
                            {"hidden_size=128", "mlp_ratio=2.5", "guidance_embed=true", "model_name=my model",
                             "backend=cuda", "axes_dim=[8, 28,28]", "qkv_bias = false", "qk_norm_eps=1.1920929e-07"});
  EXPECT_EQ(cfg.get_int("hidden_size"), 128);
  EXPECT_DOUBLE_EQ(cfg.get_float("mlp_ratio"), 2.5);
  EXPECT_TRUE(cfg.get_bool("guidance_embed"));
  EXPECT_FALSE(cfg.get_bool("qkv_bias"));
  EXPECT_EQ(cfg.get_string("model_name"), "my model");
  EXPECT_EQ(cfg.get_string("backend"), "cuda");
  EXPECT_EQ(cfg.get_int_list("axes_dim"), (std::vector<int64_t>{8, 28, 28}));
  EXPECT_DOUBLE_EQ(cfg.get_float("qk_norm_eps"), 1.1920929e-07);
  EXPECT_EQ(cfg.source("axes_dim"), "--set");
}

// The storage-type keys reach BackendOptions; grad_precision (bf16 parameter gradients) is a
// CUDA option: the CPU backend keeps f32 gradients with it, so a CPU run is unchanged.
TEST(Config, PrecisionKeysReachTheBackendOptions) {
  ConfigFiles files;
  const BackendOptions defaults = BackendOptions::from_config(Config::load(files.write("d.yaml", "# defaults\n"), {}));
  EXPECT_TRUE(defaults.bf16_activations);
  EXPECT_TRUE(defaults.bf16_grads);
  EXPECT_EQ(make_backend("cpu", defaults)->gradient_dtype(DType::f32), DType::f32);  // the CPU keeps f32
  const BackendOptions o =
      BackendOptions::from_config(Config::load(files.write("g.yaml", "grad_precision: f32\n"), {}));
  EXPECT_FALSE(o.bf16_grads);
  flux8::testing::expect_refused("grad_precision",
                                 [&] { Config::load(files.write("b.yaml", "grad_precision: fp16\n"), {}); });
}

// deterministic_attention (cuDNN's deterministic attention backward, the default) reaches the
// backend; FLUX8_ATTENTION_DETERMINISTIC=0 or 1 overrides it, empty counts as unset, and any
// other value is refused with what to set instead.
TEST(Config, DeterministicAttentionKeyAndItsEnvironmentOverride) {
  ConfigFiles files;
  const char* was = std::getenv("FLUX8_ATTENTION_DETERMINISTIC");
  const std::string saved = was ? was : "";
  struct Restore {
    bool had;
    std::string value;
    ~Restore() {
      if (had)
        setenv("FLUX8_ATTENTION_DETERMINISTIC", value.c_str(), 1);
      else
        unsetenv("FLUX8_ATTENTION_DETERMINISTIC");
    }
  } restore{was != nullptr, saved};
  const Config defaults = Config::load(files.write("d.yaml", "# defaults\n"), {});
  const Config fast = Config::load(files.write("f.yaml", "deterministic_attention: false\n"), {});
  unsetenv("FLUX8_ATTENTION_DETERMINISTIC");
  EXPECT_TRUE(BackendOptions::from_config(defaults).deterministic_attention);
  EXPECT_FALSE(BackendOptions::from_config(fast).deterministic_attention);
  setenv("FLUX8_ATTENTION_DETERMINISTIC", "", 1);
  EXPECT_FALSE(BackendOptions::from_config(fast).deterministic_attention);
  setenv("FLUX8_ATTENTION_DETERMINISTIC", "0", 1);
  EXPECT_FALSE(BackendOptions::from_config(defaults).deterministic_attention);
  setenv("FLUX8_ATTENTION_DETERMINISTIC", "1", 1);
  EXPECT_TRUE(BackendOptions::from_config(fast).deterministic_attention);
  setenv("FLUX8_ATTENTION_DETERMINISTIC", "yes", 1);
  expect_mentions(error_of([&] { BackendOptions::from_config(defaults); }),
                  {"FLUX8_ATTENTION_DETERMINISTIC=yes", "expected 0", "deterministic_attention"});
  flux8::testing::expect_refused("deterministic_attention",
                                 [&] { Config::load(files.write("b.yaml", "deterministic_attention: 2\n"), {}); });
}

TEST(Config, FloatListValues) {
  // No float-list key is registered yet; the parser is exercised with a spec of that type.
  KeySpec spec{"betas", "test", KeyType::float_list, std::vector<double>{}, Range{0, 1}, {}, "t"};
  EXPECT_EQ(std::get<std::vector<double>>(parse_config_value(spec, "[0.9, 0.95, 1]", "--set")),
            (std::vector<double>{0.9, 0.95, 1.0}));
  expect_mentions(error_of([&] { parse_config_value(spec, "[0.9, 1.5]", "--set"); }),
                  {"betas", "--set", "in [0, 1]", "[0.9, 1.5]"});
  expect_mentions(error_of([&] { parse_config_value(spec, "0.9", "--set"); }), {"list of numbers"});
}

TEST(Config, ProgrammaticSetRecordsSource) {
  Config cfg;
  cfg.set("micro_batch_size", "8", "test harness");
  EXPECT_EQ(cfg.get_int("micro_batch_size"), 8);
  EXPECT_EQ(cfg.source("micro_batch_size"), "test harness");
  cfg.set("round_activations_to_bf16", "yes");
  EXPECT_TRUE(cfg.get_bool("round_activations_to_bf16"));
  EXPECT_EQ(cfg.source("round_activations_to_bf16"), "set()");
  expect_mentions(error_of([&] { cfg.set("micro_batch_size", "0"); }),
                  {"micro_batch_size", "set()", "in [1, 65536]", "'0'"});
}

TEST(Config, DumpLoadsBackToTheSameValues) {
  ConfigFiles files;
  Config cfg = Config::load(files.write("x.yaml", "model_name: 'a \"quoted\" # name'\nmlp_ratio: 3\n"),
                            {"axes_dim=[2,4,6]", "qk_norm_eps=1.1920929e-07", "backend=cuda"});
  const std::string text = cfg.dump();
  EXPECT_NE(text.find("# ---- model ----"), std::string::npos) << text;
  Config back = Config::load(files.write("dump.yaml", text));
  for (const KeySpec& k : config_keys())
    EXPECT_EQ(format_config_value(back.get(k.name)), format_config_value(cfg.get(k.name))) << k.name;
  EXPECT_EQ(back.get_string("model_name"), "a \"quoted\" # name");
}

TEST(Config, DescribeKeysListsEveryKey) {
  const std::string table = describe_keys();
  for (const KeySpec& k : config_keys()) EXPECT_NE(table.find(k.name), std::string::npos) << k.name;
  EXPECT_NE(table.find("cpu|cuda"), std::string::npos);
}

TEST(ConfigError, UnknownKeySuggestsTheClosest) {
  ConfigFiles files;
  const std::string p = files.write("x.yaml", "seed: 1\nhiden_size: 3\n");
  expect_mentions(error_of([&] { Config::load(p); }),
                  {"unknown config key 'hiden_size'", p + ":2", "did you mean 'hidden_size'?", "docs/CONFIG.md"});
  // Nothing close: no suggestion, still an error.
  const std::string q = files.write("y.yaml", "completely_different_thing: 1\n");
  const std::string msg = error_of([&] { Config::load(q); });
  expect_mentions(msg, {"completely_different_thing", "docs/CONFIG.md"});
  EXPECT_EQ(msg.find("did you mean"), std::string::npos) << msg;
}

TEST(ConfigError, UnknownKeyInSet) {
  ConfigFiles files;
  const std::string p = files.write("x.yaml", "");
  expect_mentions(error_of([&] { Config::load(p, {"micro_batch=2"}); }),
                  {"'micro_batch'", "--set", "did you mean 'micro_batch_size'?"});
}

TEST(ConfigError, WrongTypeNamesFileLineAndValue) {
  ConfigFiles files;
  const std::string p = files.write("x.yaml", "# header\nseed: 1\nhidden_size: abc\n");
  expect_mentions(error_of([&] { Config::load(p); }), {"hidden_size in " + p + ":3 must be an integer", "got 'abc'"});
  const std::string q = files.write("y.yaml", "hidden_size: 30.5\n");
  expect_mentions(error_of([&] { Config::load(q); }), {"must be an integer", "'30.5'"});
  const std::string r = files.write("z.yaml", "guidance_embed: maybe\n");
  expect_mentions(error_of([&] { Config::load(r); }), {"guidance_embed", "true or false", "'maybe'"});
  const std::string s = files.write("w.yaml", "axes_dim: 16\n");
  expect_mentions(error_of([&] { Config::load(s); }), {"axes_dim", "a list of integers"});
  const std::string t = files.write("v.yaml", "seed:\n");
  expect_mentions(error_of([&] { Config::load(t); }), {"seed", "got no value"});
}

TEST(ConfigError, OutOfRange) {
  ConfigFiles files;
  expect_mentions(error_of([&] { Config::load(files.write("a.yaml", "num_attention_heads: 0\n")); }),
                  {"num_attention_heads", ":1", "an integer in [1, 65536]", "got '0'"});
  expect_mentions(error_of([&] { Config::load(files.write("b.yaml", "mlp_ratio: 0\n")); }),
                  {"mlp_ratio", "in (0, 64]"});
  expect_mentions(error_of([&] { Config::load(files.write("c.yaml", "axes_dim: [16, -2]\n")); }),
                  {"axes_dim", "each in [1, 65536]", "[16, -2]"});
  expect_mentions(error_of([&] { Config::load(files.write("d.yaml", ""), {"seed=-1"}); }),
                  {"seed in --set", "in [0, 9007199254740991]"});
}

TEST(ConfigError, ValueNotInChoicesListsThem) {
  ConfigFiles files;
  const std::string p = files.write("x.yaml", "backend: tpu\n");
  expect_mentions(error_of([&] { Config::load(p); }), {"backend in " + p + ":1", "one of: cpu, cuda", "'tpu'"});
}

TEST(ConfigError, MissingIncludeNamesIncluderAndPathTried) {
  ConfigFiles files;
  const std::string p = files.write("exp.yaml", "seed: 1\ninclude: models/nope.yaml\n");
  expect_mentions(error_of([&] { Config::load(p); }),
                  {p + ":2", "'models/nope.yaml'", files.path("models/nope.yaml"), "does not exist"});
  expect_mentions(error_of([&] { Config::load(files.path("absent.yaml")); }),
                  {files.path("absent.yaml"), "does not exist"});
}

TEST(ConfigError, IncludeCycle) {
  ConfigFiles files;
  files.write("a.yaml", "include: b.yaml\n");
  files.write("b.yaml", "include: sub/../a.yaml\n");
  expect_mentions(error_of([&] { Config::load(files.path("a.yaml")); }), {"include cycle", "a.yaml -> ", "b.yaml -> "});
  files.write("self.yaml", "include: self.yaml\n");
  expect_mentions(error_of([&] { Config::load(files.path("self.yaml")); }), {"include cycle"});
}

TEST(ConfigError, MalformedYamlNamesFileAndLine) {
  ConfigFiles files;
  const std::string p = files.write("x.yaml", "seed: 1\naxes_dim: [16, 56\nhidden_size: 3\n");
  expect_mentions(error_of([&] { Config::load(p); }), {p + ":", "malformed YAML"});
  expect_mentions(error_of([&] { Config::load(files.write("y.yaml", ""), {"axes_dim=[1,2"}); }),
                  {"axes_dim in --set", "malformed YAML", "[1,2"});
}

TEST(ConfigError, TopLevelMustBeAMapping) {
  ConfigFiles files;
  const std::string p = files.write("x.yaml", "- seed: 1\n");
  expect_mentions(error_of([&] { Config::load(p); }), {p, "mapping"});
}

TEST(ConfigError, SetWithoutEquals) {
  ConfigFiles files;
  const std::string p = files.write("x.yaml", "");
  expect_mentions(error_of([&] { Config::load(p, {"seed"}); }), {"--set 'seed'", "key=value"});
}

TEST(ConfigError, DuplicateKeyInOneFile) {
  ConfigFiles files;
  const std::string p = files.write("x.yaml", "seed: 1\nseed: 2\n");
  expect_mentions(error_of([&] { Config::load(p); }), {p + ":2", "'seed'", "twice"});
}

TEST(ConfigError, IncludeValueMustBePaths) {
  ConfigFiles files;
  const std::string p = files.write("x.yaml", "include: {a: b}\n");
  expect_mentions(error_of([&] { Config::load(p); }), {"include in " + p + ":1", "file path"});
}

// ---- FluxConfig: model configs and cross-key rules ----

namespace {
std::string model_file(const std::string& name) {
  return std::string(FLUX8_SOURCE_DIR) + "/configs/models/" + name + ".yaml";
}
}  // namespace

TEST(ConfigModel, ShippedModelFilesLoadAndValidate) {
  for (const char* name : {"flux_535m", "flux_12b_schnell", "flux_12b_dev", "flux_tiny_demo"}) {
    SCOPED_TRACE(name);
    Config cfg = Config::load(model_file(name));
    FluxConfig m = FluxConfig::from_config(cfg);
    EXPECT_EQ(m.name, name);
    EXPECT_EQ(m.out_channels, m.in_channels);  // out_channels: 0 resolves to in_channels
    // Every model key is spelled out in the file, so no model silently inherits a default.
    for (const KeySpec& k : config_keys())
      if (k.section == "model") {
        EXPECT_NE(cfg.source(k.name), "default") << k.name;
      }
  }
  FluxConfig m535 = FluxConfig::from_config(Config::load(model_file("flux_535m")));
  EXPECT_EQ(m535.num_blocks(), 2);
  EXPECT_FALSE(m535.guidance_embed);
  FluxConfig dev = FluxConfig::from_config(Config::load(model_file("flux_12b_dev")));
  EXPECT_TRUE(dev.guidance_embed);
  EXPECT_EQ(dev.text_seq_len, 512);
  EXPECT_EQ(dev.num_blocks(), 57);
  FluxConfig tiny = FluxConfig::from_config(Config::load(model_file("flux_tiny_demo")));
  EXPECT_EQ(tiny.head_dim(), 24);
  EXPECT_EQ(tiny.in_channels, tiny.latent_channels * tiny.patch_size * tiny.patch_size);
  EXPECT_EQ(tiny.image_tokens(32), 256);
}

TEST(ConfigModel, ImageTokens) {
  FluxConfig m;  // schnell: 8x VAE, 2x2 patches
  EXPECT_EQ(m.image_tokens(256), 256);
  EXPECT_EQ(m.image_tokens(1024), 4096);
  expect_mentions(error_of([&] { m.image_tokens(100); }), {"100 pixels", "vae_downsample (8)", "patch_size (2)", "16"});
}

TEST(ConfigModel, CrossKeyRulesNameTheKeys) {
  auto check = [](std::vector<std::string> sets, std::initializer_list<std::string> parts) {
    Config cfg;
    for (const std::string& s : sets) cfg.apply_override(s);
    expect_mentions(error_of([&] { FluxConfig::from_config(cfg); }), parts);
  };
  check({"num_attention_heads=25"}, {"hidden_size (3072)", "divisible by num_attention_heads (25)"});
  check({"hidden_size=60", "num_attention_heads=4"}, {"head dim", "15", "even"});
  check({"axes_dim=[16,56,54]"}, {"axes_dim [16, 56, 54]", "sums to 126", "128"});
  check({"axes_dim=[15,57,56]"}, {"axes_dim[0] = 15", "even"});
  Config ok;
  ok.apply_override("in_channels=12");
  EXPECT_EQ(FluxConfig::from_config(ok).out_channels, 12);
  ok.apply_override("out_channels=7");
  EXPECT_EQ(FluxConfig::from_config(ok).out_channels, 7);
}
