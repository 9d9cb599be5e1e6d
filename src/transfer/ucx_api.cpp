#include "transfer/ucx_api.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

namespace kvstack::transfer {

namespace {

struct Loaded {
  UcxApi api;
  bool ok = false;
  Error error{Errc::kInternal, ""};
};

std::string library_name(const char* env, const char* fallback) {
  const char* e = std::getenv(env);
  return e != nullptr && *e != '\0' ? e : fallback;
}

Loaded load_once() {
  Loaded out;
  const std::string ucs = library_name("KVSTACK_UCS_LIBRARY", "libucs.so.0");
  const std::string ucp = library_name("KVSTACK_UCP_LIBRARY", "libucp.so.0");
  auto fail = [&](const std::string& lib) {
    const char* why = dlerror();
    out.error = make_error(Errc::kUnsupported,
                           "the KV transfer needs UCX at run time but " + lib +
                               " could not be loaded (" + (why != nullptr ? why : "unknown") +
                               "); install UCX (Debian: apt-get install libucx0) or set "
                               "KVSTACK_UCP_LIBRARY/KVSTACK_UCS_LIBRARY");
    return out;
  };
  // RTLD_GLOBAL: UCX loads its transport modules (libuct_*.so) itself and
  // they resolve symbols of libucs/libuct from the global scope.
  void* hs = dlopen(ucs.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (hs == nullptr) return fail(ucs);
  void* hp = dlopen(ucp.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (hp == nullptr) return fail(ucp);
    // Never dlclose'd: see the lifetime note in the header.
#define KVSTACK_UCX_RESOLVE(name)                                                           \
  {                                                                                         \
    void* sym = dlsym(hp, #name);                                                           \
    if (sym == nullptr) sym = dlsym(hs, #name);                                             \
    if (sym == nullptr) {                                                                   \
      out.error = make_error(Errc::kUnsupported, "UCX library " + ucp +                     \
                                                     " lacks " #name                        \
                                                     " (a UCX older than the headers this " \
                                                     "build used?)");                       \
      return out;                                                                           \
    }                                                                                       \
    out.api.name = reinterpret_cast<decltype(out.api.name)>(sym);                           \
  }
  KVSTACK_UCX_FUNCTIONS(KVSTACK_UCX_RESOLVE)
#undef KVSTACK_UCX_RESOLVE
  out.ok = true;
  return out;
}

std::mutex g_mu;
std::atomic<const Loaded*> g_loaded{nullptr};  // written once, under g_mu

}  // namespace

Result<const UcxApi*> load_ucx() {
  const Loaded* l = g_loaded.load(std::memory_order_acquire);
  if (l == nullptr) {
    std::lock_guard<std::mutex> lock(g_mu);
    l = g_loaded.load(std::memory_order_acquire);
    if (l == nullptr) {
      l = new Loaded(load_once());  // NOLINT(cppcoreguidelines-owning-memory): kept for the process
      g_loaded.store(l, std::memory_order_release);
    }
  }
  if (!l->ok) return l->error;
  return &l->api;
}

bool ucx_loaded() {
  const Loaded* l = g_loaded.load(std::memory_order_acquire);
  return l != nullptr && l->ok;
}

const UcxApi& ucx_api() {
  return g_loaded.load(std::memory_order_acquire)->api;
}

}  // namespace kvstack::transfer
