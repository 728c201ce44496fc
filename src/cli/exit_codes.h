#pragma once
// The exit status of every `flux8` command: what a scheduler or a job script reads to tell a
// finished run from one to requeue, and a user's mistake from a failure. Where a sysexits.h code
// means the same thing it is that code (a Slurm site lists kExitStopped in RequeueExit=75, or a
// job script tests it and runs `scontrol requeue`); README.md and `flux8 --help` show the table.
#include "core/error.h"
#include "train/signals.h"

namespace flux8::cli {

inline constexpr int kExitFinished = 0;
inline constexpr int kExitError = 1;                   // any other error (I/O, a checkpoint, a collective, ...)
inline constexpr int kExitUnexpected = 2;              // an error flux8 did not expect: a bug or a library failure
inline constexpr int kExitDataError = 65;              // EX_DATAERR: shards, validation set or empty prompt
inline constexpr int kExitStopped = kStoppedExitCode;  // EX_TEMPFAIL: stopped with a checkpoint; --resume
inline constexpr int kExitConfigError = 78;            // EX_CONFIG: the config or the command line
inline constexpr int kExitOutOfMemory = 79;            // device (or host) memory exhausted
inline constexpr int kExitNonFinite = 80;              // stopped on non-finite steps (nan_policy)

inline int exit_code_of(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::config: return kExitConfigError;
    case ErrorKind::data: return kExitDataError;
    case ErrorKind::out_of_memory: return kExitOutOfMemory;
    case ErrorKind::nonfinite: return kExitNonFinite;
    case ErrorKind::general: break;
  }
  return kExitError;
}

// The table for `flux8 --help` and `flux8 train --help`.
inline constexpr const char* kExitCodesHelp =
    "Exit status:\n"
    "   0  finished (train: every step of train_iters done, the last checkpoint written)\n"
    "  75  stopped after saving a checkpoint: SIGTERM/SIGINT (a scheduler's preemption) or\n"
    "      --stop-after; requeue the job with --resume\n"
    "  78  config error: a key, a value or a command-line option (nothing was trained)\n"
    "  65  data error: shards, validation set or empty prompt missing, unreadable or malformed\n"
    "  79  out of memory: the message lists the settings that would fit and what each saves\n"
    "  80  stopped on non-finite losses or gradients (nan_policy); the last checkpoint is intact\n"
    "   1  any other error (I/O, a damaged checkpoint, another rank's failure, ...)\n"
    "   2  an unexpected error (please report it)\n"
    "  A second SIGTERM/SIGINT ends the process at once, by that signal (128 + its number).";

}  // namespace flux8::cli
