#pragma once
// The `flux8` subcommands. Each registers its options on the CLI11 app and runs when chosen.
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace flux8::cli {

// Options every model-reading command shares.
struct ConfigOptions {
  std::string config;
  std::vector<std::string> overrides;  // --set key=value
  void add_to(CLI::App& cmd);
};

using Runner = std::function<int()>;
struct Command {
  CLI::App* app;
  Runner run;
};

Command add_info_command(CLI::App& app);
Command add_forward_command(CLI::App& app);
Command add_init_command(CLI::App& app);
Command add_config_command(CLI::App& app);
Command add_sample_command(CLI::App& app);
Command add_check_command(CLI::App& app);
Command add_bench_command(CLI::App& app);
Command add_train_command(CLI::App& app);
Command add_data_command(CLI::App& app);
Command add_export_command(CLI::App& app);

}  // namespace flux8::cli
