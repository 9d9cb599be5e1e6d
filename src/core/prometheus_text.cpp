#include "core/prometheus_text.h"

#include <cinttypes>
#include <cstdio>

namespace kvstack {

void PromText::family(std::string_view name, std::string_view type, std::string_view help) {
  out_ += "# HELP ";
  out_ += name;
  out_ += ' ';
  out_ += help;
  out_ += "\n# TYPE ";
  out_ += name;
  out_ += ' ';
  out_ += type;
  out_ += '\n';
}

// `name` + suffix + `{base[,labels]` (the caller closes the brace).
void PromText::open(std::string_view name, std::string_view suffix, std::string_view labels) {
  out_ += name;
  out_ += suffix;
  out_ += '{';
  out_ += base_;
  if (!labels.empty()) {
    if (!base_.empty()) out_ += ',';
    out_ += labels;
  }
}

void PromText::sample(std::string_view name, int64_t value, std::string_view labels) {
  open(name, {}, labels);
  out_ += "} ";
  out_ += std::to_string(value);
  out_ += '\n';
}

void PromText::sample_f(std::string_view name, double value, std::string_view labels) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", value);
  open(name, {}, labels);
  out_ += "} ";
  out_ += buf;
  out_ += '\n';
}

void PromText::bucket(std::string_view name, double bound, bool inf, uint64_t cum,
                      std::string_view labels) {
  char buf[64];
  open(name, "_bucket", labels);
  if (inf) {
    std::snprintf(buf, sizeof(buf), ",le=\"+Inf\"} %" PRIu64 "\n", cum);
  } else {
    std::snprintf(buf, sizeof(buf), ",le=\"%g\"} %" PRIu64 "\n", bound, cum);
  }
  out_ += buf;
}

void PromText::sum_count(std::string_view name, double sum, uint64_t count,
                         std::string_view labels) {
  char buf[32];
  open(name, "_sum", labels);
  std::snprintf(buf, sizeof(buf), "} %.9g\n", sum);
  out_ += buf;
  open(name, "_count", labels);
  std::snprintf(buf, sizeof(buf), "} %" PRIu64 "\n", count);
  out_ += buf;
}

}  // namespace kvstack
