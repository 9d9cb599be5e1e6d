// Invariant checks. KV_CHECK is always on; KV_DCHECK only in debug builds
// (or when KVSTACK_DCHECK is defined, as the sanitizer builds do).
#pragma once

#include <cstdio>
#include <cstdlib>

namespace kvstack::detail {
[[noreturn]] inline void check_failed(const char* file, int line, const char* cond,
                                      const char* msg) {
  std::fprintf(stderr, "kvstack: invariant violated at %s:%d: %s (%s)\n", file, line, msg, cond);
  std::fflush(stderr);
  std::abort();
}
}  // namespace kvstack::detail

#define KV_CHECK(cond, msg)                                                       \
  do {                                                                            \
    if (!(cond)) ::kvstack::detail::check_failed(__FILE__, __LINE__, #cond, msg); \
  } while (0)

#if !defined(NDEBUG) || defined(KVSTACK_DCHECK)
#define KV_DCHECK(cond, msg) KV_CHECK(cond, msg)
#define KV_DCHECK_IS_ON 1
#else
#define KV_DCHECK(cond, msg) \
  do {                       \
  } while (0)
#define KV_DCHECK_IS_ON 0
#endif
