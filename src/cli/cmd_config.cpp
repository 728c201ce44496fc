// `flux8 config`: show the resolved configuration or the table of keys.
#include <fmt/core.h>

#include "cli/commands.h"
#include "config/config.h"
#include "config/schema.h"
#include "model/flux_config.h"

namespace flux8::cli {

Command add_config_command(CLI::App& app) {
  auto* cmd =
      app.add_subcommand("config", "print the resolved config (with where each value came from), or --list the keys");
  struct Opts {
    std::string config;
    std::vector<std::string> overrides;
    bool list = false;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("-c,--config", o->config, "YAML file to resolve")->check(CLI::ExistingFile);
  cmd->add_option("--set", o->overrides, "override a config key: --set key=value (repeatable)");
  cmd->add_flag("--list", o->list, "list every config key with type, default and allowed values");
  return {cmd, [o]() {
            if (o->list || o->config.empty()) {
              fmt::print("{}", describe_keys());
              return 0;
            }
            const Config cfg = Config::load(o->config, o->overrides);
            FluxConfig::from_config(cfg);  // cross-key checks
            fmt::print("{}", cfg.dump());
            return 0;
          }};
}

}  // namespace flux8::cli
