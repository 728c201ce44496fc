#include "train/signals.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace flux8 {

namespace {

// The handler may only touch lock-free atomics and call async-signal-safe functions
// (write, signal, raise): no allocation, no locks, no stdio.
static_assert(std::atomic<int>::is_always_lock_free, "signal flag must be lock-free");
std::atomic<int> g_stop_signal{0};
bool g_installed = false;
struct sigaction g_previous_int, g_previous_term;

void write_stderr(const char* msg) {
  const int saved = errno;
  ssize_t rc = ::write(STDERR_FILENO, msg, std::strlen(msg));  // strlen is async-signal-safe
  (void)rc;
  errno = saved;
}

extern "C" void on_stop_signal(int sig) {
  int none = 0;
  if (g_stop_signal.compare_exchange_strong(none, sig)) {
    write_stderr(sig == SIGINT ? "\nflux8: SIGINT received: stopping after this step with a checkpoint "
                                 "(interrupt again to stop at once, without one)\n"
                               : "\nflux8: SIGTERM received: stopping after this step with a checkpoint "
                                 "(send it again to stop at once, without one)\n");
    return;
  }
  write_stderr("\nflux8: second stop signal: stopping now without a checkpoint\n");
  ::signal(sig, SIG_DFL);
  // Blocked until this handler returns, then the default action terminates the process.
  ::raise(sig);
}

}  // namespace

void install_stop_signals() {
  g_stop_signal.store(0);
  if (g_installed) return;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // interrupted reads/writes resume instead of failing with EINTR
  if (::sigaction(SIGINT, &sa, &g_previous_int) != 0 || ::sigaction(SIGTERM, &sa, &g_previous_term) != 0)
    fail("cannot install SIGINT/SIGTERM handlers: {}", std::strerror(errno));
  g_installed = true;
}

void restore_stop_signals() {
  if (!g_installed) return;
  ::sigaction(SIGINT, &g_previous_int, nullptr);
  ::sigaction(SIGTERM, &g_previous_term, nullptr);
  g_installed = false;
}

bool stop_requested() { return g_stop_signal.load() != 0; }

const char* stop_signal_name() {
  switch (g_stop_signal.load()) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case 0: return "";
    default: return "signal";
  }
}

void clear_stop_request() { g_stop_signal.store(0); }

}  // namespace flux8
