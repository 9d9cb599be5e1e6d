// The UCX entry points the KV transfer uses, resolved at run time with
// dlopen (issue 21): only `kvstack serve --role prefill|decode` (and the
// transfer tests) load libucp/libucs, so every other command runs without
// UCX in the process and without its memory hooks (libucm patches
// mmap/madvise/brk when it is loaded; under TSan that crashed at thread
// exit). The UCX headers still give the types and the constants, so a
// build needs libucx-dev; a run of a P/D role needs the runtime libraries
// (Debian libucx0) and fails with a clear error naming them otherwise.
//
// Library names: libucp.so.0 and libucs.so.0 (UCX's sonames since 1.x),
// or KVSTACK_UCP_LIBRARY / KVSTACK_UCS_LIBRARY (paths, read once at the
// first load) to use another UCX build.
// Thread-safety: load_ucx() is safe from any thread (loads once); ucx()
// is only valid after a load_ucx() that succeeded. Lifetime: the libraries
// are never unloaded (UCX's hooks cannot be removed safely).
#pragma once

#include <ucp/api/ucp.h>

#include "core/result.h"

namespace kvstack::transfer {

// X-macro: every UCX function called through UcxApi.
#define KVSTACK_UCX_FUNCTIONS(X) \
  X(ucp_cleanup)                 \
  X(ucp_config_read)             \
  X(ucp_config_release)          \
  X(ucp_ep_close_nbx)            \
  X(ucp_ep_create)               \
  X(ucp_ep_flush_nbx)            \
  X(ucp_ep_rkey_unpack)          \
  X(ucp_get_nbx)                 \
  X(ucp_init_version)            \
  X(ucp_mem_map)                 \
  X(ucp_mem_unmap)               \
  X(ucp_request_cancel)          \
  X(ucp_request_check_status)    \
  X(ucp_request_free)            \
  X(ucp_rkey_buffer_release)     \
  X(ucp_rkey_destroy)            \
  X(ucp_rkey_pack)               \
  X(ucp_worker_arm)              \
  X(ucp_worker_create)           \
  X(ucp_worker_destroy)          \
  X(ucp_worker_get_address)      \
  X(ucp_worker_get_efd)          \
  X(ucp_worker_progress)         \
  X(ucp_worker_release_address)  \
  X(ucs_status_string)

struct UcxApi {
// NOLINTNEXTLINE(bugprone-macro-parentheses): a declarator, not an expression
#define KVSTACK_UCX_MEMBER(name) decltype(&::name) name = nullptr;
  KVSTACK_UCX_FUNCTIONS(KVSTACK_UCX_MEMBER)
#undef KVSTACK_UCX_MEMBER
  // ucp_init is an inline wrapper in ucp.h that passes the header's API
  // version; the same here.
  ucs_status_t init(const ucp_params_t* params, const ucp_config_t* config,
                    ucp_context_h* context) const {
    return ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, params, config, context);
  }
};

// Loads the libraries and resolves every entry point, once. Errors
// (kUnsupported): a library that cannot be opened (with dlerror's reason
// and the package to install) or a missing symbol (a UCX older than the
// headers this was built with).
Result<const UcxApi*> load_ucx();

// True once the libraries are loaded in this process (for tests and the
// start-up log: `--role both` must leave it false).
bool ucx_loaded();

// REQUIRES: load_ucx() succeeded.
const UcxApi& ucx_api();

}  // namespace kvstack::transfer
