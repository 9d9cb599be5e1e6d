#include "core/result.h"

namespace kvstack {

const char* errc_name(Errc code) {
  switch (code) {
    case Errc::kInvalidArgument:
      return "invalid_argument";
    case Errc::kIo:
      return "io_error";
    case Errc::kCorruptFile:
      return "corrupt_file";
    case Errc::kUnsupported:
      return "unsupported";
    case Errc::kOutOfBlocks:
      return "out_of_blocks";
    case Errc::kNotFound:
      return "not_found";
    case Errc::kCancelled:
      return "cancelled";
    case Errc::kBusy:
      return "busy";
    case Errc::kInternal:
      return "internal";
  }
  return "unknown";
}

}  // namespace kvstack
