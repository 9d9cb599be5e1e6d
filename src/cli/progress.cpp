#include "cli/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdarg>

namespace kvstack::cli {

Progress::Progress(FILE* out, double pipe_interval_s)
    : Progress(out, pipe_interval_s, isatty(fileno(out)) != 0) {}

Progress::Progress(FILE* out, double pipe_interval_s, bool tty)
    : out_(out), interval_s_(pipe_interval_s), tty_(tty) {}

void Progress::update(const std::string& text, bool force) {
  const auto now = std::chrono::steady_clock::now();
  if (tty_) {
    // Pad over the tail of a longer previous line.
    const size_t pad = last_len_ > text.size() ? last_len_ - text.size() : 0;
    std::fprintf(out_, "\r%s%*s", text.c_str(), static_cast<int>(pad), "");
    std::fflush(out_);
    last_len_ = text.size();
    line_open_ = true;
    return;
  }
  if (printed_ && !force && std::chrono::duration<double>(now - last_).count() < interval_s_) {
    return;
  }
  std::fprintf(out_, "%s\n", text.c_str());
  std::fflush(out_);
  printed_ = true;
  last_ = now;
}

void Progress::finish() {
  if (line_open_) {
    std::fputc('\n', out_);
    std::fflush(out_);
  }
  line_open_ = false;
  last_len_ = 0;
}

std::string strprintf(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  const int n = std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  if (n < 0) return {};
  return std::string(buf, static_cast<size_t>(std::min(n, static_cast<int>(sizeof(buf)) - 1)));
}

}  // namespace kvstack::cli
