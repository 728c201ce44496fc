// `flux8 config`: show the resolved configuration or the table of keys, or convert a Primus
// experiment file.
#include <fmt/core.h>

#include "cli/commands.h"
#include "config/config.h"
#include "config/schema.h"
#include "core/error.h"
#include "fp8/fp8_config.h"
#include "model/flux_config.h"

namespace flux8::cli {

Command add_config_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "config",
      "print the resolved config (with where each value came from), --list the keys, or convert a Primus "
      "experiment (--from-primus)");
  struct Opts {
    std::string config, primus;
    std::vector<std::string> overrides;
    bool list = false;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("-c,--config", o->config, "YAML file to resolve")->check(CLI::ExistingFile);
  cmd->add_option("--set", o->overrides, "override a config key: --set key=value (repeatable)");
  cmd->add_flag("--list", o->list, "list every config key with type, default and allowed values");
  cmd->add_option("--from-primus", o->primus,
                  "print a Primus experiment file (modules: ... overrides:) as a flux8 config: its includes and the "
                  "keys flux8 knows, the others listed in a comment")
      ->check(CLI::ExistingFile);
  return {
      cmd, [o]() {
        if (!o->primus.empty()) {
          fmt::print("{}", with_error_kind(ErrorKind::config, [&] { return convert_primus_experiment(o->primus); }));
          return 0;
        }
        if (o->list || o->config.empty()) {
          fmt::print("{}", describe_keys());
          return 0;
        }
        const Config cfg = with_error_kind(ErrorKind::config, [&] { return Config::load(o->config, o->overrides); });
        // The cross-key checks of the model and FP8 keys, with what they warn about.
        with_error_kind(ErrorKind::config, [&] { FluxConfig::from_config(cfg); });
        const Fp8Config fp8 = with_error_kind(ErrorKind::config, [&] { return Fp8Config::from_config(cfg); });
        for (const std::string& w : cfg.warnings()) fmt::print(stderr, "flux8: warning: {}\n", w);
        for (const std::string& w : fp8.warnings) fmt::print(stderr, "flux8: warning: {}\n", w);
        fmt::print("{}", cfg.dump());
        return 0;
      }};
}

}  // namespace flux8::cli
