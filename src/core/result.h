// Recoverable failures: one error enum for the project and a small
// expected-like Result<T>. Exceptions are used only at start-up/configuration.
#pragma once

#include <string>
#include <utility>
#include <variant>

#include "core/check.h"

namespace kvstack {

enum class Errc {
  kInvalidArgument,  // bad user input (flag, request field, value out of range)
  kIo,               // file could not be opened/read/written
  kCorruptFile,      // file exists but its content is malformed or hostile
  kUnsupported,      // valid input that this build does not implement
  kOutOfBlocks,      // KV pool cannot satisfy an allocation
  kNotFound,         // named thing (key, tensor, template) does not exist
  kCancelled,        // request cancelled by its owner
  kBusy,             // temporarily over capacity (queue full): retry later
  kInternal,         // a bug; should never reach a user
};

const char* errc_name(Errc code);

struct Error {
  Errc code;
  std::string message;  // names the input at fault, e.g. "model.gguf: tensor 'x' ..."
};

template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}      // NOLINT(google-explicit-constructor)
  Result(Error error) : v_(std::move(error)) {}  // NOLINT(google-explicit-constructor)
  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & {
    KV_CHECK(ok(), "Result::value() on an error");
    return std::get<0>(v_);
  }
  const T& value() const& {
    KV_CHECK(ok(), "Result::value() on an error");
    return std::get<0>(v_);
  }
  T&& value() && {
    KV_CHECK(ok(), "Result::value() on an error");
    return std::get<0>(std::move(v_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  const Error& error() const {
    KV_CHECK(!ok(), "Result::error() on a value");
    return std::get<1>(v_);
  }

 private:
  std::variant<T, Error> v_;
};

// Result<void>: success or an error.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Error error)
      : err_(std::move(error)), ok_(false) {}  // NOLINT(google-explicit-constructor)
  bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const Error& error() const {
    KV_CHECK(!ok_, "Status::error() on success");
    return err_;
  }

 private:
  Error err_{Errc::kInternal, {}};
  bool ok_ = true;
};

inline Error make_error(Errc code, std::string message) {
  return Error{code, std::move(message)};
}

}  // namespace kvstack

// Propagate an error from an expression yielding Result<T>/Status.
#define KV_TRY_STATUS(expr)                        \
  do {                                             \
    auto kv_try_s_ = (expr);                       \
    if (!kv_try_s_.ok()) return kv_try_s_.error(); \
  } while (0)
