#pragma once
// Graceful stop on SIGINT / SIGTERM (Ctrl-C, `kill`, a cluster scheduler's preemption
// notice): the first signal only sets a flag, so the trainer finishes the current step, saves a
// checkpoint and exits; a second signal kills the process at once with the default action, so
// a run stuck in I/O or a collective can still be stopped.
namespace flux8 {

// The exit status of `flux8 train` stopped by the first SIGINT/SIGTERM (or --stop-after) once
// its checkpoint is saved: 75 (sysexits' EX_TEMPFAIL, "try again"), not 0, so that a scheduler
// tells a preempted run from a finished one and requeues it with --resume. A second signal ends
// the process by that signal (a shell reports 128 + its number), without a checkpoint.
inline constexpr int kStoppedExitCode = 75;

// Installs the handlers (idempotent) and clears any earlier request.
void install_stop_signals();
// Puts back the handlers that were in place before install_stop_signals() (tests, tools).
void restore_stop_signals();

bool stop_requested();
// "SIGINT" or "SIGTERM" once a stop was requested, else "".
const char* stop_signal_name();
// Forgets a request (tests; a trainer that handled one and keeps running).
void clear_stop_request();

}  // namespace flux8
