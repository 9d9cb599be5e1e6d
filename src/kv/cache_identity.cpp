#include "kv/cache_identity.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

#include "core/mapped_file.h"

namespace kvstack {

namespace {

void put_field(std::string& out, const std::string& s) {
  const uint64_t n = s.size();
  out.append(reinterpret_cast<const char*>(&n), sizeof(n));
  out += s;
}

using FileKey = std::tuple<uint64_t, uint64_t, int64_t, int64_t>;  // dev, ino, size, mtime ns

std::mutex g_digest_mu;
std::map<FileKey, Hash128>& digest_memo() {
  static std::map<FileKey, Hash128> m;
  return m;
}

bool parse_hex128(const std::string& s, Hash128* h) {
  if (s.size() != 32) return false;
  unsigned long long hi = 0, lo = 0;
  if (std::sscanf(s.c_str(), "%16llx%16llx", &hi, &lo) != 2) return false;
  h->hi = hi;
  h->lo = lo;
  return true;
}

}  // namespace

Hash128 CacheIdentity::digest() const {
  std::string buf = "kvstack-cache-identity-v1";
  buf.append(reinterpret_cast<const char*>(&weights_digest), sizeof(weights_digest));
  put_field(buf, arch_revision);
  put_field(buf, std::to_string(adapters.size()));
  for (const auto& a : adapters) put_field(buf, a);
  put_field(buf, kv_format);
  put_field(buf, kv_transform);
  put_field(buf, position);
  put_field(buf, attention);
  put_field(buf, ns);
  return hash128(buf.data(), buf.size());
}

CacheIdentity CacheIdentity::with_namespace(std::string name) const {
  CacheIdentity c = *this;
  c.ns = std::move(name);
  return c;
}

std::string public_namespace_name() {
  return std::string("\0public", 7);
}

std::string kv_format_key(const KvLayout& layout) {
  std::ostringstream o;
  o << "P=" << layout.block_size() << ";bb=" << layout.block_bytes() << ";L=" << layout.n_layers()
    << ";kiviG=" << layout.kivi_group() << ";kiviR=" << layout.kivi_residual();
  for (int l = 0; l < layout.n_layers(); ++l) {
    const KvLayerSpec& s = layout.layer(l);
    const KvLayerPlacement& pl = layout.placement(l);
    o << ";[" << static_cast<int>(s.kind) << ',' << s.n_kv_heads << ',' << s.head_dim_k << ','
      << s.head_dim_v << ',' << s.latent_dim << ',' << s.rope_dim << ",dt"
      << static_cast<int>(s.dtype) << '/' << static_cast<int>(s.value_dtype()) << ",w" << s.window
      << ",@" << pl.k_offset << ',' << pl.v_offset << ',' << pl.head_stride << ',' << pl.slot_stride
      << ',' << pl.end_offset << ']';
  }
  return o.str();
}

Result<Hash128> weights_digest(const std::string& path, const std::string& cache_dir) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return make_error(Errc::kIo, path + ": cannot stat model file: " + std::strerror(errno));
  }
  const FileKey key{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino),
                    static_cast<int64_t>(st.st_size),
                    static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec};
  std::lock_guard<std::mutex> lock(g_digest_mu);
  auto& memo = digest_memo();
  if (auto it = memo.find(key); it != memo.end()) return it->second;
  const std::string key_text =
      std::to_string(std::get<0>(key)) + ' ' + std::to_string(std::get<1>(key)) + ' ' +
      std::to_string(std::get<2>(key)) + ' ' + std::to_string(std::get<3>(key));
  const std::string cache_file = cache_dir.empty() ? "" : cache_dir + "/weights-digests";
  if (!cache_file.empty()) {
    std::ifstream in(cache_file);
    std::string line;
    while (std::getline(in, line)) {
      const size_t sp = line.rfind(' ');
      Hash128 h;
      if (sp != std::string::npos && line.compare(0, sp, key_text) == 0 &&
          parse_hex128(line.substr(sp + 1), &h)) {
        memo[key] = h;
        return h;
      }
    }
  }
  auto file = MappedFile::open(path);
  if (!file) return file.error();
  const Hash128 h = hash128(file->data(), file->size());
  memo[key] = h;
  if (!cache_file.empty()) {
    ::mkdir(cache_dir.c_str(), 0755);  // best effort: the cache is an optimisation
    std::ofstream out(cache_file, std::ios::app);
    if (out) out << key_text << ' ' << h.hex() << '\n';
  }
  return h;
}

}  // namespace kvstack
