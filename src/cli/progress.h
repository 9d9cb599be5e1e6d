// Progress lines on stderr for long-running commands (perplexity, kv-eval,
// bench, kv-bench). On a terminal one line is rewritten in place with '\r';
// on a pipe or file (CI logs, `2>log`) every update that is at least
// `pipe_interval_s` after the last one printed goes out as its own line, so
// logs get a few readable lines instead of one line of '\r'-joined updates.
// Not thread-safe: one Progress per command, used from the main thread.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

namespace kvstack::cli {

class Progress {
 public:
  // `out` is usually stderr; `tty` defaults to isatty(fileno(out)).
  explicit Progress(FILE* out = stderr, double pipe_interval_s = 10.0);
  Progress(FILE* out, double pipe_interval_s, bool tty);
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  ~Progress() { finish(); }

  // Shows `text` (no newline in it). On a pipe, `force` prints it even when
  // the interval has not passed (e.g. the last window).
  void update(const std::string& text, bool force = false);
  // Ends the in-place line on a terminal (a newline); nothing on a pipe.
  // Idempotent; called by the destructor.
  void finish();

  bool tty() const { return tty_; }

 private:
  FILE* out_;
  double interval_s_;
  bool tty_;
  bool line_open_ = false;  // tty: a '\r' line is on screen without its newline
  size_t last_len_ = 0;
  bool printed_ = false;
  std::chrono::steady_clock::time_point last_{};
};

// printf-style formatting into a std::string (for Progress::update).
std::string strprintf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace kvstack::cli
