// flux8: trains Flux diffusion transformers. See README.md and `flux8 --help`.
#include <cstdio>
#include <new>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/exit_codes.h"
#include "core/error.h"
#include "core/process_clock.h"
#include "dist/mpi_runtime.h"

namespace {
// Under a launcher one rank's error ends the whole job (the others would wait for it in their
// next collective): its message goes out prefixed with the rank and every rank exits. Alone, the
// process returns the code.
int error_exit(const char* kind, const char* what, int code) {
  if (flux8::job_placement().launched) flux8::abort_job(std::string("flux8: ") + kind + what, code);
  std::fprintf(stderr, "flux8: %s%s\n", kind, what);
  return code;
}
}  // namespace

int main(int argc, char** argv) {
  (void)flux8::seconds_since_process_start();  // its fallback clock starts here where /proc is missing
  CLI::App app{"flux8: a C++/CUDA engine that trains Flux diffusion transformers in BF16 and FP8"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "flux8 0.1.0");
  app.footer(flux8::cli::kExitCodesHelp);
  const std::vector<flux8::cli::Command> commands = {
      flux8::cli::add_train_command(app),  flux8::cli::add_info_command(app),   flux8::cli::add_forward_command(app),
      flux8::cli::add_init_command(app),   flux8::cli::add_config_command(app), flux8::cli::add_data_command(app),
      flux8::cli::add_sample_command(app), flux8::cli::add_check_command(app),  flux8::cli::add_bench_command(app),
      flux8::cli::add_export_command(app),
  };
  // A process started by mpirun or srun joins its job here; one started alone never touches MPI.
  flux8::start_job(&argc, &argv);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // --help, --version, or a usage error (a config error: nothing ran)
    flux8::finish_job();
    return rc == 0 ? 0 : flux8::cli::kExitConfigError;
  }
  int rc = 0;
  try {
    for (const auto& cmd : commands)
      if (cmd.app->parsed()) {
        rc = cmd.run();
        break;
      }
  } catch (const flux8::Error& e) {
    return error_exit("error: ", e.what(), flux8::cli::exit_code_of(e.kind()));
  } catch (const std::bad_alloc& e) {
    return error_exit("error: out of host memory: ", e.what(), flux8::cli::kExitOutOfMemory);
  } catch (const std::exception& e) {
    return error_exit("unexpected error: ", e.what(), flux8::cli::kExitUnexpected);
  }
  flux8::finish_job();
  return rc;
}
