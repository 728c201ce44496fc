#include "cli/commands.h"

namespace flux8::cli {

void ConfigOptions::add_to(CLI::App& cmd) {
  cmd.add_option("-c,--config", config, "model or experiment YAML (e.g. configs/models/flux_535m.yaml)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd.add_option("--set", overrides, "override a config key: --set key=value (repeatable)");
}

}  // namespace flux8::cli
