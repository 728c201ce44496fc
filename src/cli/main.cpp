// flux8: trains Flux diffusion transformers. See README.md and `flux8 --help`.
#include <cstdio>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "core/process_clock.h"

int main(int argc, char** argv) {
  (void)flux8::seconds_since_process_start();  // its fallback clock starts here where /proc is missing
  CLI::App app{"flux8: a C++/CUDA engine that trains Flux diffusion transformers in BF16 and FP8"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "flux8 0.1.0");
  const std::vector<flux8::cli::Command> commands = {
      flux8::cli::add_train_command(app),  flux8::cli::add_info_command(app),   flux8::cli::add_forward_command(app),
      flux8::cli::add_init_command(app),   flux8::cli::add_config_command(app), flux8::cli::add_data_command(app),
      flux8::cli::add_sample_command(app), flux8::cli::add_check_command(app),  flux8::cli::add_bench_command(app),
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (const auto& cmd : commands)
      if (cmd.app->parsed()) return cmd.run();
  } catch (const flux8::Error& e) {
    std::fprintf(stderr, "flux8: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flux8: unexpected error: %s\n", e.what());
    return 2;
  }
  return 0;
}
