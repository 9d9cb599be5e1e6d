// `kvstack serve`: the OpenAI-compatible HTTP server (server/http_server.h)
// over the continuous-batching scheduler (engine/scheduler.h).
//
// Threads: the main thread serves HTTP (httplib workers handle requests),
// one engine thread runs the scheduler loop, one signal thread waits for
// SIGINT/SIGTERM. On a signal: new requests get 503, in-flight requests
// (streams included) finish for up to --shutdown-grace seconds, what is left
// is cancelled (a stream then ends with an error event and [DONE]), and the
// HTTP server stops once every handler wrote its last event; exit 0.
#include <arpa/inet.h>
#include <malloc.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "cli/args.h"
#include "cli/chat_input.h"
#include "cli/engine_options.h"
#include "kv/prefix_index.h"
#include "server/http_server.h"
#include "server/kv_events.h"

namespace kvstack::cli {
namespace {

// "--trusted-proxy 10.0.0.2,::1": numeric IPv4/IPv6 addresses in the form
// the server compares against (inet_ntop of the peer). Names are refused:
// resolving them here would trust whatever DNS says at start-up.
Result<std::vector<std::string>> parse_trusted_proxies(const std::string& text) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= text.size() && !text.empty()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    const std::string item = text.substr(pos, comma - pos);
    unsigned char buf[16];
    char canon[INET6_ADDRSTRLEN] = {0};
    if (::inet_pton(AF_INET, item.c_str(), buf) == 1) {
      ::inet_ntop(AF_INET, buf, canon, sizeof(canon));
    } else if (::inet_pton(AF_INET6, item.c_str(), buf) == 1) {
      ::inet_ntop(AF_INET6, buf, canon, sizeof(canon));
    } else {
      return make_error(Errc::kInvalidArgument,
                        "--trusted-proxy: '" + item +
                            "' is not a numeric IPv4 or IPv6 address (give addresses, "
                            "comma-separated, no host names)");
    }
    out.emplace_back(canon);
    pos = comma + 1;
  }
  return out;
}

std::string model_id_from_path(const std::string& path) {
  std::string name = path.substr(path.find_last_of('/') + 1);
  if (name.size() > 5 && name.substr(name.size() - 5) == ".gguf") name.resize(name.size() - 5);
  return name;
}

// --kv-events FILE: the prefix index's event stream (block stored / removed,
// kv/prefix_index.h) as JSON lines, one object per event:
//   {"event":"stored","hash":"<32 hex>","parent":"<32 hex>","n_tokens":16,"namespace":0}
// A writer thread drains the index every 100 ms through Scheduler::inspect
// (the index belongs to the engine thread) and appends to the file.
class KvEventWriter {
 public:
  ~KvEventWriter() {
    if (thread_.joinable()) {
      stop_.store(true);
      thread_.join();
    }
    if (file_ != nullptr) std::fclose(file_);
  }

  // Opens FILE for appending and turns the index's events on (before the
  // engine thread starts). Errors name the file or the missing cache.
  Status open(const std::string& path, Engine& engine) {
    if (engine.kv().index() == nullptr) {
      return make_error(Errc::kInvalidArgument, "--kv-events needs the prefix cache");
    }
    file_ = std::fopen(path.c_str(), "a");
    if (file_ == nullptr) {
      return make_error(Errc::kIo, "--kv-events " + path + ": cannot open for writing");
    }
    engine.kv().index()->set_event_capacity(kCapacity);
    return {};
  }

  void start(Scheduler& s) {
    if (file_ == nullptr) return;
    thread_ = std::thread([this, &s] {
      while (!stop_.load()) {
        std::vector<KvEvent> evs;
        if (!s.inspect([&](Engine& e) { evs = e.kv().index()->drain_events(); }).ok()) break;
        write(evs);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
  }

  // REQUIRES: the engine thread has returned (or never ran).
  void finish(Engine& engine) {
    if (file_ == nullptr) return;
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
    write(engine.kv().index()->drain_events());
    const int64_t dropped = engine.kv().index()->stats().n_events_dropped;
    if (dropped > 0) {
      std::fprintf(stderr, "kvstack serve: --kv-events: %lld events dropped (writer too slow)\n",
                   static_cast<long long>(dropped));
    }
  }

 private:
  static constexpr int64_t kCapacity = 1 << 16;  // pending events kept between drains

  void write(const std::vector<KvEvent>& evs) {
    for (const KvEvent& ev : evs) {
      std::fprintf(file_,
                   "{\"event\":\"%s\",\"hash\":\"%s\",\"parent\":\"%s\",\"n_tokens\":%d,"
                   "\"namespace\":%d}\n",
                   kv_event_name(ev.kind), ev.hash.hex().c_str(), ev.parent_hash.hex().c_str(),
                   ev.n_tokens, ev.ns);
    }
    if (!evs.empty()) std::fflush(file_);
  }

  std::FILE* file_ = nullptr;
  std::thread thread_;
  std::atomic<bool> stop_{false};
};

int run_serve(const std::vector<std::string>& argv) {
  auto specs = engine_options();
  specs.push_back({"host", 0, "ADDR", "address to listen on (default 127.0.0.1)"});
  specs.push_back({"port", 0, "N", "TCP port, 0 = any free port (default 8080)"});
  specs.push_back({"api-key", 0, "KEY", "require 'Authorization: Bearer KEY' on /v1/*"});
  specs.push_back({"admin-api-key", 0, "KEY",
                   "a key that also sees every tenant's prefix-cache statistics in /v1/kv/stats"});
  specs.push_back({"request-timeout", 0, "S",
                   "seconds a client has to send its request head and body (default 30; the "
                   "head alone 10 at most)"});
  specs.push_back({"max-conns-per-client", 0, "N",
                   "requests served at once per client address (default: half the HTTP threads)"});
  specs.push_back({"trusted-proxy", 0, "ADDR[,ADDR]",
                   "client IP addresses exempt from the per-client limits, e.g. the router in "
                   "front of this server (its connections carry many users' requests)"});
  specs.push_back({"max-seqs", 0, "N", "sequences decoded together per step (default 16)"});
  specs.push_back({"max-batch-tokens", 0, "N",
                   "tokens per step, decodes + prefill chunks (default max-seqs + 63: 64 prefill "
                   "tokens beside a full step of decodes, see docs/architecture.md)"});
  specs.push_back({"max-queue", 0, "N", "waiting requests before 429 (default 256)"});
  specs.push_back({"reserve-output", 0, "N",
                   "output tokens reserved per sequence at admission, -1 = all of max_tokens "
                   "(default 32)"});
  specs.push_back({"model-id", 0, "NAME", "model name in the API (default: the file name)"});
  specs.push_back(
      {"chat-template", 0, "NAME", "override the template: chatml, llama3, mistral, gemma"});
  specs.push_back({"kv-events", 0, "FILE|tcp://*:PORT",
                   "prefix-cache events (block stored/removed): appended to FILE as JSON lines, "
                   "or published on a ZeroMQ PUB socket in vLLM's KV-events format (msgpack) "
                   "when the value is a tcp://, ipc:// or inproc:// endpoint"});
  specs.push_back({"kv-events-replay", 0, "tcp://*:PORT",
                   "ZeroMQ ROUTER endpoint answering replay requests from the last "
                   "--kv-events-buffer batches (vLLM's replay protocol)"});
  specs.push_back({"kv-events-topic", 0, "TOPIC",
                   "first frame of every event message (default "
                   "empty)"});
  specs.push_back({"kv-events-buffer", 0, "N", "event batches kept for replay (default 10000)"});
  specs.push_back({"kv-events-encoding", 0, "array|map",
                   "events as positional arrays (vLLM's array_like msgspec structs, default) or as "
                   "maps tagged by \"type\" (what vllm-router 0.1.17's kv_aware decoder reads)"});
  specs.push_back({"shutdown-grace", 0, "S",
                   "seconds in-flight requests may finish after a signal (default 10)"});
  specs.push_back({"role", 0, "ROLE",
                   "prefill, decode or both (default both): a disaggregated worker behind "
                   "vllm-router --vllm-pd-disaggregation (see README, 'Prefill/decode "
                   "disaggregation')"});
  specs.push_back({"kv-lease-timeout", 0, "S",
                   "prefill: seconds a finished prefill keeps its blocks pinned for the decode "
                   "worker's pull (default 30)"});
  specs.push_back({"kv-transfer-host", 0, "ADDR",
                   "prefill: numeric address decode workers reach the transfer port at "
                   "(default: --host)"});
  specs.push_back({"kv-transfer-port", 0, "N",
                   "prefill: TCP port of the transfer control channel (default 0: any free)"});
  specs.push_back({"kv-transfer-timeout", 0, "S",
                   "bound on one transfer: connect, offer and every UCX read (default 10)"});
  specs.push_back({"kv-max-pulls", 0, "N",
                   "decode: KV pulls that run at once, each on its own UCX worker; more wait "
                   "for one within --kv-transfer-timeout (default 4)"});
  specs.push_back({"kv-pull-by-layer", 0, "",
                   "decode: read each pulled block layer by layer (one get per block and "
                   "layer, each layer completed before the next) and time every layer"});
  specs.push_back(help_option());
  auto args = Args::parse(argv, specs);
  if (!args) return fail("serve", args.error().message);
  if (args->flag("help")) {
    std::fputs(format_help("kvstack serve [-m MODEL] [--host 127.0.0.1] [--port 8080] "
                           "[--kv-cache-mem SIZE] [--max-seqs N] [--max-queue N] [--api-key KEY]",
                           "Serve the model over an OpenAI-compatible HTTP API with continuous "
                           "batching: /v1/completions, /v1/chat/completions, /v1/models, "
                           "/health, /metrics, /v1/kv/stats.",
                           specs)
                   .c_str(),
               stdout);
    return 0;
  }
  auto port = args->get_int("port", 8080, 0, 65535);
  auto max_seqs = args->get_int("max-seqs", 16, 1, 4096);
  // Step budget policy (docs/architecture.md, "Step budget"): by default
  // room for every sequence's decode row plus a 64-token prefill chunk
  // (L = max_batch - max_seqs + 1 = 64), which keeps a step, and so every
  // stream's inter-token gap, within a few decode steps while new prompts
  // prefill; measured in docs/benchmarks.md.
  constexpr int64_t kPrefillTokensPerStep = 64;
  const int64_t default_max_batch = (max_seqs.ok() ? *max_seqs : 16) + kPrefillTokensPerStep - 1;
  auto max_batch = args->get_int("max-batch-tokens", default_max_batch, 1, 1 << 20);
  auto max_queue = args->get_int("max-queue", 256, 1, 1 << 20);
  auto reserve = args->get_int("reserve-output", 32, -1, 1 << 24);
  auto grace = args->get_double("shutdown-grace", 10, 0, 3600);
  auto request_timeout = args->get_double("request-timeout", 30, 0.1, 3600);
  auto per_client = args->get_int("max-conns-per-client", 0, 0, 1 << 20);
  auto trusted = parse_trusted_proxies(args->get_or("trusted-proxy", ""));
  if (!trusted) return fail("serve", trusted.error().message);
  auto role = server::parse_pd_role(args->get_or("role", "both"));
  if (!role) return fail("serve", role.error().message);
  auto lease_timeout = args->get_double("kv-lease-timeout", 30, 0.01, 86400);
  auto transfer_timeout = args->get_double("kv-transfer-timeout", 10, 0.01, 3600);
  auto transfer_port = args->get_int("kv-transfer-port", 0, 0, 65535);
  auto max_pulls = args->get_int("kv-max-pulls", 4, 1, 256);
  for (const Status& st : {lease_timeout.ok() ? Status() : Status(lease_timeout.error()),
                           max_pulls.ok() ? Status() : Status(max_pulls.error()),
                           transfer_timeout.ok() ? Status() : Status(transfer_timeout.error()),
                           transfer_port.ok() ? Status() : Status(transfer_port.error())}) {
    if (!st.ok()) return fail("serve", st.error().message);
  }
  for (const Status& st : {port.ok() ? Status() : Status(port.error()),
                           max_seqs.ok() ? Status() : Status(max_seqs.error()),
                           max_batch.ok() ? Status() : Status(max_batch.error()),
                           max_queue.ok() ? Status() : Status(max_queue.error()),
                           reserve.ok() ? Status() : Status(reserve.error()),
                           grace.ok() ? Status() : Status(grace.error()),
                           request_timeout.ok() ? Status() : Status(request_timeout.error()),
                           per_client.ok() ? Status() : Status(per_client.error())}) {
    if (!st.ok()) return fail("serve", st.error().message);
  }
  SchedulerConfig sc;
  sc.max_seqs = static_cast<int>(*max_seqs);
  sc.max_batch_tokens = std::max(*max_batch, *max_seqs);
  sc.max_queue = *max_queue;
  sc.reserve_output_tokens = *reserve;
  auto cfg = engine_config_from(*args);
  if (!cfg) return fail("serve", cfg.error().message);

  // Request bodies and their JSON (up to the 8 MiB limit) are transient: a
  // fixed mmap threshold returns such buffers to the system when freed
  // (glibc's threshold otherwise grows to the largest freed block and the
  // memory stays in the heap, RSS never returning to its baseline).
  mallopt(M_MMAP_THRESHOLD, 256 << 10);

  // Signals go to the signal thread only (blocked before any thread starts).
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGUSR1);  // internal wake-up of the signal thread at exit
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  std::signal(SIGPIPE, SIG_IGN);  // a client that went away is a failed write, not a crash

  server::ServerConfig hc;
  hc.host = args->get_or("host", "127.0.0.1");
  hc.port = static_cast<int>(*port);
  hc.api_key = args->get_or("api-key", "");
  hc.admin_api_key = args->get_or("admin-api-key", "");
  hc.model_id = args->get_or("model-id", model_id_from_path(cfg->model_path));
  // "kvstack" (the README's examples) and the file name always name it too.
  hc.model_aliases = {"kvstack", model_id_from_path(cfg->model_path)};
  hc.n_http_threads = static_cast<int>(std::min<int64_t>(1024, *max_seqs + *max_queue + 16));
  hc.request_timeout_s = *request_timeout;
  hc.head_timeout_s = std::min(10.0, *request_timeout);
  hc.max_conns_per_client = static_cast<int>(*per_client);
  hc.trusted_proxies = *trusted;
  server::HttpServer http(hc);
  if (auto st = http.bind(); !st.ok()) return fail("serve", st.error().message);
  // HTTP answers /health (503 "loading") while the model loads.
  std::thread http_thread([&] { http.listen(); });

  auto engine = load_engine(*args);
  if (!engine) {
    http.stop();
    http_thread.join();
    return fail("serve", engine.error().message);
  }
  auto tmpl = chat_template_for(*args, **engine);
  if (!tmpl) {
    std::fprintf(stderr, "kvstack serve: no chat template (%s); /v1/chat/completions disabled\n",
                 tmpl.error().message.c_str());
  }
  auto sched = Scheduler::create(**engine, sc);
  if (!sched) {
    http.stop();
    http_thread.join();
    return fail("serve", sched.error().message);
  }
  Scheduler& s = **sched;
  // --role prefill/decode: the transfer agent registers the pool with UCX
  // before the engine thread starts (server/pd_agent.h).
  std::unique_ptr<server::PdAgent> pd;
  if (*role != server::PdRole::kBoth) {
    server::PdConfig pc;
    pc.role = *role;
    pc.transfer_host = args->get_or("kv-transfer-host", hc.host);
    pc.transfer_port = static_cast<int>(*transfer_port);
    pc.max_pulls = static_cast<int>(*max_pulls);
    pc.pull_by_layer = args->flag("kv-pull-by-layer");
    pc.lease_timeout = std::chrono::milliseconds(static_cast<int64_t>(*lease_timeout * 1000));
    pc.transfer_timeout = std::chrono::milliseconds(static_cast<int64_t>(*transfer_timeout * 1000));
    if (const char* stall = std::getenv("KVSTACK_TEST_PULL_STALL_MS")) {
      pc.test_pull_stall = std::chrono::milliseconds(std::atoll(stall));
    }
    auto agent = server::PdAgent::create(**engine, pc);
    if (!agent) {
      http.stop();
      http_thread.join();
      return fail("serve", agent.error().message);
    }
    pd = std::move(*agent);
    http.set_pd(pd.get());
  }
  KvEventWriter events;
  std::unique_ptr<server::KvEventPublisher> publisher;
  const std::string events_arg = args->get_or("kv-events", "");
  const bool zmq_events = events_arg.rfind("tcp://", 0) == 0 ||
                          events_arg.rfind("ipc://", 0) == 0 ||
                          events_arg.rfind("inproc://", 0) == 0;
  auto fail_events = [&](const std::string& message) {
    http.stop();
    http_thread.join();
    return fail("serve", message);
  };
  if (!zmq_events && (args->has("kv-events-replay") || args->has("kv-events-topic") ||
                      args->has("kv-events-buffer") || args->has("kv-events-encoding"))) {
    return fail_events(
        "--kv-events-replay/-topic/-buffer/-encoding need --kv-events tcp://HOST:PORT");
  }
  if (zmq_events) {
    auto buffer = args->get_int("kv-events-buffer", 10000, 1, 1 << 24);
    if (!buffer.ok()) return fail_events(buffer.error().message);
    PrefixIndex* index = (*engine)->kv().index();
    if (index == nullptr) return fail_events("--kv-events needs the prefix cache");
    server::KvEventPublisherConfig pc;
    pc.endpoint = events_arg;
    pc.replay_endpoint = args->get_or("kv-events-replay", "");
    pc.topic = args->get_or("kv-events-topic", "");
    pc.replay_batches = *buffer;
    const std::string enc = args->get_or("kv-events-encoding", "array");
    if (enc != "array" && enc != "map") {
      return fail_events("--kv-events-encoding: '" + enc + "' is not array or map");
    }
    pc.map_events = enc == "map";
    pc.block_size = index->block_size();
    auto p = server::KvEventPublisher::create(pc);
    if (!p) return fail_events(p.error().message);
    publisher = std::move(*p);
    // Runs on the engine thread inside the index operation: push only queues.
    auto st = (*engine)->kv().set_event_sink([pub = publisher.get(), index](const KvEvent& e) {
      pub->push(e,
                e.kind == KvEvent::Kind::kAllCleared ? Hash128{} : index->namespace_digest(e.ns));
    });
    if (!st.ok()) return fail_events(st.error().message);
    http.set_kv_events(publisher.get());
  } else if (!events_arg.empty()) {
    if (auto st = events.open(events_arg, **engine); !st.ok())
      return fail_events(st.error().message);
  }
  std::thread engine_thread([&] { s.run(); });
  events.start(s);
  if (pd) {
    pd->start(s);
    std::fprintf(stderr, "kvstack serve: role %s, engine id %s%s (UCX transports: %s)\n",
                 server::pd_role_name(pd->role()), pd->engine_id().c_str(),
                 pd->role() == server::PdRole::kPrefill
                     ? (", KV transfer on " + pd->stats_endpoint()).c_str()
                     : "",
                 pd->stats().transports.c_str());
  }
  http.attach(&s, tmpl ? &*tmpl : nullptr);
  std::fprintf(stderr,
               "kvstack serve: ready on http://%s:%d (model '%s', max %d sequences, %lld "
               "tokens/step)\n",
               hc.host.c_str(), http.port(), hc.model_id.c_str(), sc.max_seqs,
               static_cast<long long>(sc.max_batch_tokens));
  std::printf(
      "curl http://%s:%d/v1/chat/completions -H 'Content-Type: application/json'%s -d "
      "'{\"messages\": [{\"role\": \"user\", \"content\": \"Hello! Who are you?\"}], "
      "\"max_tokens\": 64}'\n",
      hc.host.c_str(), http.port(),
      hc.api_key.empty() ? "" : (" -H 'Authorization: Bearer " + hc.api_key + "'").c_str());
  std::fflush(stdout);

  std::thread signal_thread([&] {
    int sig = 0;
    sigwait(&sigs, &sig);
    if (sig == SIGUSR1) return;  // internal wake-up: the server ended by itself
    std::fprintf(stderr, "kvstack serve: %s: draining in-flight requests\n",
                 sig == SIGINT ? "SIGINT" : "SIGTERM");
    // New submissions fail (503) from here; the HTTP server keeps serving
    // so that running streams can write their last events: httplib's
    // stop() would cut every chunked response at once.
    s.shutdown(/*drain=*/true);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(*grace);
    while (std::chrono::steady_clock::now() < deadline &&
           s.metrics().n_running + s.metrics().n_waiting > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    s.shutdown(/*drain=*/false);  // past the grace period: cancel the rest
    // Every handler writes its request's last event (finish or error, then
    // [DONE]) within a poll interval; a client that stopped reading is
    // given up on after a few seconds.
    if (!http.wait_handlers(std::chrono::seconds(5))) {
      std::fprintf(stderr, "kvstack serve: some responses did not finish writing\n");
    }
    http.stop();
  });

  http_thread.join();
  s.shutdown(/*drain=*/false);
  engine_thread.join();
  if (pd) pd->stop();       // ends every lease; the engine thread is gone
  events.finish(**engine);  // the engine thread is gone: drain the rest here
  if (publisher) {
    (void)(*engine)->kv().set_event_sink({});
    publisher.reset();  // publishes what is queued, closes the sockets
  }
  pthread_kill(signal_thread.native_handle(), SIGUSR1);
  signal_thread.join();
  std::fprintf(stderr, "kvstack serve: stopped\n");
  return 0;
}

}  // namespace

KVSTACK_COMMAND(g_serve, "serve", "OpenAI-compatible HTTP server with continuous batching",
                run_serve);

}  // namespace kvstack::cli
