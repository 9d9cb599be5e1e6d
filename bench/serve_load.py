#!/usr/bin/env python3
"""Loopback load generator for OpenAI-compatible servers: kvstack serve and
llama.cpp's llama-server side by side.

For each concurrency level, N streaming clients each send `--requests`
completions (ignore_eos so every request generates exactly its token count)
and the script reports request throughput, aggregate output tokens/s, TTFT
and inter-token latency percentiles and the KV memory the server used.
The prompt mix: a shared system prompt on every other request, then a
request-specific part; with --mix sharegpt the part and the output length
are drawn (seeded) from a long-tailed ShareGPT-like distribution, otherwise
fixed (--max-tokens). With --rate R (requests/s) requests arrive as a Poisson
process (at most N in flight) instead of N closed-loop clients.

  bench/serve_load.py --kvstack-bin build/src/cli/kvstack \
      [--llama-server-bin build/llama-server/bin/llama-server | --llama-cpp-python-server] \
      [--concurrency 1,4,16] [--rounds 3]

A server is started on 127.0.0.1 and a free port, with the same model,
thread count and context, warmed up with one short unmeasured request (not
sharing the measured prompts' prefix) and stopped at the end. --url benchmarks an
already running server instead (repeatable: --url NAME=http://host:port).

bench/build_llama_server.sh builds the native llama-server from the
llama.cpp source vendored in the pinned llama-cpp-python sdist (about 20
CPU-minutes here).

--llama-cpp-python-server starts `python -m llama_cpp.server` (the
llama-cpp-python[server] extra) when no native llama-server is available. It
serves ONE request at a time (one llama_context, one sequence; concurrent
requests queue behind a lock), so its concurrency comes from queueing only.
It is started with the same model, threads and context (n_ctx), logits for
the last token only (logits_all False, as kvstack), its RAM prompt cache on
(--cache True: whole-state snapshots keyed by token prefix, plus llama.cpp's
own reuse of the common prefix with the previous request), and
interrupt_requests False (by default a new request aborts the running
stream). It has no ignore_eos: requests send min_tokens = max_tokens instead.

With --chat-turns T every client holds --requests conversations of T turns
over /v1/chat/completions (streaming, usage included): one long system
prompt shared by all conversations (longer than Gemma 3's 512-token window),
then per turn a new user message, with every earlier turn and the assistant's
streamed replies sent back as history. Rows are per turn: prompt tokens,
tokens served from the cache, tokens the server prefilled (kvstack: prompt -
cached_tokens; llama-server: timings.prompt_n) and TTFT; the "2+" row pools
every turn after the first (what a continued conversation costs).

With several servers, --rounds N runs the levels N times, alternating the
servers (A B A B ...), and prints per-round rows and then the median of each
column per server and level (the machine may be shared and noisy).
"""
import argparse
import concurrent.futures as cf
import json
import os
import random
import signal
import threading
import socket
import statistics
import subprocess
import sys
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = "You are a helpful assistant. Answer briefly and precisely. " * 4


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base, proc, timeout=300, path="/health"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if requests.get(base + path, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become ready")


def start(cmd, port, ready_path="/health"):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, path=ready_path)
    except RuntimeError:
        stop(proc)
        raise
    return proc, base


def stop(proc):
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


WORDS = ("river stone light tree garden market window music engine signal harbor winter "
         "paper bridge orbit silver forest candle theory")


def workload(i, max_tokens, mix):
    """(prompt, output tokens) of request i: a pure function of i and the mix."""
    if mix == "sharegpt":
        rng = random.Random(1000 + i)
        words = WORDS.split()
        n_words = min(400, max(4, int(rng.lognormvariate(3.6, 0.8))))  # median ~37 words
        part = " ".join(rng.choice(words) for _ in range(n_words))
        n_out = min(4 * max_tokens, max(8, int(rng.lognormvariate(4.0, 0.6))))  # median ~55
        return (SHARED if i % 2 == 0 else "") + f"Request {i}: {part}", n_out
    prompt = (SHARED if i % 2 == 0 else "") + f"Request {i}: describe item number {i} " * (1 + i % 5)
    return prompt, max_tokens


def one_request(base, i, max_tokens, mix="fixed", extra=None):
    prompt, max_tokens = workload(i, max_tokens, mix)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, **(extra or {})}
    if body.pop("min_tokens_is_max", False):  # servers without ignore_eos
        body["min_tokens"] = max_tokens
    t0 = time.perf_counter()
    stamps = []
    with requests.post(base + "/v1/completions", json=body, stream=True, timeout=600) as r:
        if r.status_code >= 500:  # e.g. llama-server's KV full: counted as failed, not fatal
            return None
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if any(c.get("text") for c in obj.get("choices", [])):
                stamps.append(time.perf_counter())
    if not stamps:
        return None
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft": stamps[0] - t0, "itl": itl, "e2e": stamps[-1] - t0, "n_chunks": len(stamps),
            "n_tokens": max_tokens}


CHAT_SYSTEM = ("You are the support assistant of a hardware shop. Keep answers short, list steps "
               "when a task has steps, and never invent a product the shop does not sell. ") + \
    " ".join(f"Rule {k}: when asked about the {w} aisle, say it is open from {k % 9 + 8} to "
             f"{k % 5 + 17} and mention the {WORDS.split()[(k * 7) % 19]} offer."
             for k, w in enumerate(WORDS.split() * 2))


def chat_user_message(conv, turn):
    """The user's message of turn `turn` (1-based) of conversation `conv`."""
    rng = random.Random(5000 + 97 * conv + turn)
    words = WORDS.split()
    topic = " and the ".join(rng.choice(words) for _ in range(3))
    return f"Customer {conv}, question {turn}: what do you know about the {topic}? " + \
        " ".join(rng.choice(words) for _ in range(12 + rng.randrange(20)))


def chat_turn(base, messages, max_tokens, extra):
    """One streamed chat completion; returns (reply text, per-turn figures)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    body.pop("min_tokens_is_max", None)  # replies end where the model ends them
    t0 = time.perf_counter()
    stamps, text, usage, timings = [], [], {}, {}
    with requests.post(base + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            obj = json.loads(line[6:])
            usage = obj.get("usage") or usage
            timings = obj.get("timings") or timings
            for c in obj.get("choices", []):
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    text.append(piece)
                    stamps.append(time.perf_counter())
    prompt = usage.get("prompt_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    if "prompt_n" in timings:  # llama-server: what it really processed
        prefill, cached = timings["prompt_n"], timings.get("cache_n", cached)
    else:
        prefill = prompt - cached
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return "".join(text), {"ttft": (stamps[0] - t0) if stamps else float("nan"), "itl": itl,
                           "prompt": prompt, "cached": cached, "prefill": prefill,
                           "n_tokens": usage.get("completion_tokens", len(stamps))}


def chat_conversation(base, conv, turns, max_tokens, extra):
    """Runs one conversation; returns its per-turn figures (turn 1 first)."""
    messages = [{"role": "system", "content": CHAT_SYSTEM}]
    out = []
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": chat_user_message(conv, turn)})
        reply, fig = chat_turn(base, messages, max_tokens, extra)
        messages.append({"role": "assistant", "content": reply})
        out.append({"turn": turn, **fig})
    return out


def bench_chat(name, base, levels, n_conv, turns, max_tokens, extra=None, first_conv=0):
    """Closed-loop chat load: c clients, each running n_conv conversations
    (ids from first_conv on: a later round must not replay a conversation
    the server has cached already)."""
    rows = []
    for c in levels:
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(c) as ex:
            convs = list(ex.map(lambda i: chat_conversation(base, i, turns, max_tokens, extra),
                                range(first_conv, first_conv + c * n_conv)))
        first_conv += c * n_conv
        wall = time.perf_counter() - t0
        figs = [f for conv in convs for f in conv]
        groups = [(str(t), [f for f in figs if f["turn"] == t]) for t in range(1, turns + 1)]
        if turns > 1:
            groups.append(("2+", [f for f in figs if f["turn"] >= 2]))
        for label, fs in groups:
            itl = [x for f in fs for x in f["itl"]]
            row = {"server": name, "concurrency": c, "turn": label, "requests": len(fs),
                   "prompt_tokens_mean": statistics.mean(f["prompt"] for f in fs),
                   "cached_tokens_mean": statistics.mean(f["cached"] for f in fs),
                   "prefill_tokens_mean": statistics.mean(f["prefill"] for f in fs),
                   "ttft_p50_ms": 1e3 * pct([f["ttft"] for f in fs], 0.5),
                   "ttft_p99_ms": 1e3 * pct([f["ttft"] for f in fs], 0.99),
                   "itl_p50_ms": 1e3 * pct(itl, 0.5), "itl_p99_ms": 1e3 * pct(itl, 0.99),
                   "output_tok_s": sum(f["n_tokens"] for f in figs) / wall}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def slot_tokens(slot):
    """KV cells a llama-server /slots entry holds for its running request."""
    if "n_past" in slot:
        return slot.get("n_past") or 0
    if not slot.get("is_processing"):
        return 0
    nt = slot.get("next_token")
    nt = nt[0] if isinstance(nt, list) and nt else nt if isinstance(nt, dict) else {}
    return max(slot.get("n_prompt_tokens") or 0,
               (slot.get("n_prompt_tokens_processed") or 0) + (nt.get("n_decoded") or 0))


class KvSampler:
    """Polls the server's KV usage while a level runs; keeps the peak (bytes)."""

    def __init__(self, name, base, kv_bytes_per_token):
        self.name, self.base, self.per_token = name, base, kv_bytes_per_token
        self.peak = 0
        self.allocated = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def sample(self):
        try:
            if self.name.startswith("kvstack"):
                p = requests.get(self.base + "/v1/kv/stats", timeout=5).json()["pool"]
                self.allocated = p["pool_bytes"]
                return p["blocks_used"] * p["block_bytes"]
            if self.name == "llama-cpp-python":
                return 0  # no usage endpoint: bench() derives it from the requests
            # llama-server: cells in use x bytes per cell, from /slots: n_past
            # in older versions; in newer ones a busy slot's n_prompt_tokens
            # (which counts the tokens decoded so far too) or its processed
            # prompt + n_decoded, whichever is larger.
            slots = requests.get(self.base + "/slots", timeout=5).json()
            return sum(slot_tokens(s) for s in slots) * self.per_token
        except (requests.RequestException, ValueError, KeyError, TypeError):
            return 0

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.sample())
            time.sleep(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench(name, base, levels, n_requests, max_tokens, mix="fixed", rate=0.0, extra=None,
          kv_bytes_per_token=0, kv_allocated=0):
    rows = []
    for c in levels:
        n_total = c * n_requests
        t0 = time.perf_counter()
        with KvSampler(name, base, kv_bytes_per_token) as kv, cf.ThreadPoolExecutor(c) as ex:
            if rate > 0:  # Poisson arrivals, at most c in flight
                rng = random.Random(7)
                futs, t_next = [], time.perf_counter()
                for i in range(n_total):
                    t_next += rng.expovariate(rate)
                    time.sleep(max(0.0, t_next - time.perf_counter()))
                    futs.append(ex.submit(one_request, base, i, max_tokens, mix, extra))
                res = [f.result() for f in futs]
            else:
                res = list(ex.map(lambda i: one_request(base, i, max_tokens, mix, extra),
                                  range(n_total)))
            res = [r for r in res if r]
        wall = time.perf_counter() - t0
        kv_peak = kv.peak
        if name == "llama-cpp-python" and kv_bytes_per_token:
            # One sequence at a time: the cells in use peak at the longest
            # request (prompt + output), all n_ctx cells allocated up front.
            kv_peak = kv_bytes_per_token * max(
                n_prompt_tokens(base, workload(i, max_tokens, mix)[0]) +
                workload(i, max_tokens, mix)[1] for i in range(n_total))
        toks = sum(r["n_tokens"] for r in res)
        itl = [x for r in res for x in r["itl"]]
        row = {"server": name, "concurrency": c, "requests": len(res),
               "failed": n_total - len(res),
               "req_s": len(res) / wall,
               "output_tok_s": toks / wall,
               "ttft_p50_ms": 1e3 * pct([r["ttft"] for r in res], 0.5),
               "ttft_p99_ms": 1e3 * pct([r["ttft"] for r in res], 0.99),
               "itl_p50_ms": 1e3 * pct(itl, 0.5), "itl_p99_ms": 1e3 * pct(itl, 0.99),
               "e2e_mean_s": statistics.mean(r["e2e"] for r in res) if res else float("nan"),
               "kv_peak_used_mib": kv_peak / 2**20,
               "kv_allocated_mib": (kv.allocated or kv_allocated) / 2**20}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def n_prompt_tokens(base, text):
    """Prompt tokens as llama-cpp-python's server counts them (BOS included)."""
    r = requests.post(base + "/extras/tokenize", json={"input": text}, timeout=30)
    r.raise_for_status()
    return len(r.json()["tokens"])


def medians(rows):
    """Median of every numeric column per (server, concurrency), in first-seen order."""
    groups = {}
    for row in rows:
        groups.setdefault((row["server"], row["concurrency"], row.get("turn")), []).append(row)
    out = []
    for (server, c, turn), rs in groups.items():
        med = {"server": server, "concurrency": c, "rounds": len(rs)}
        if turn is not None:
            med["turn"] = turn
        for k, v in rs[0].items():
            if k not in med and isinstance(v, (int, float)):
                med[k] = statistics.median(r[k] for r in rs)
        out.append(med)
    return out


def kv_bytes_per_token(model):
    """f16 K+V bytes per token of every layer (llama-server's default cache)."""
    try:
        import gguf
        r = gguf.GGUFReader(model)
        arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

        def val(key):
            return int(r.fields[f"{arch}.{key}"].parts[-1][0])
        n_layer, n_embd = val("block_count"), val("embedding_length")
        n_head, n_kv = val("attention.head_count"), val("attention.head_count_kv")
        return n_layer * 2 * n_kv * (n_embd // n_head) * 2
    except Exception:  # noqa: BLE001 - the memory column is informative only
        return 0


def llama_template_args(model):
    """llama-server flags that make it render the chat template kvstack uses.

    A GGUF without tokenizer.chat_template (the Gemma 3 270M file has none)
    gets ChatML from llama-server but Gemma's template from kvstack, which
    picks the architecture's own; both servers must see the same prompt."""
    try:
        import gguf
        r = gguf.GGUFReader(model)
        arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
        if "tokenizer.chat_template" not in r.fields and arch.startswith("gemma"):
            return ["--no-jinja", "--chat-template", "gemma"]
    except Exception:  # noqa: BLE001 - then llama-server's own default applies
        pass
    return []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models",
                                                    "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--kvstack-bin", default=os.path.join(ROOT, "build", "src", "cli", "kvstack"))
    ap.add_argument("--llama-server-bin", default="", help="native llama-server executable")
    ap.add_argument("--llama-cpp-python-server", action="store_true",
                    help="also start `python -m llama_cpp.server` (one request at a time)")
    ap.add_argument("--python", default=sys.executable,
                    help="Python with llama-cpp-python[server] (default: this one)")
    ap.add_argument("--llama-cache-size", default=str(256 << 20),
                    help="llama-cpp-python RAM prompt cache, bytes (default 256 MiB)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat every level, alternating the servers; report medians")
    ap.add_argument("--url", action="append", default=[], help="NAME=URL of a running server")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--ctx", type=int, default=8192, help="KV tokens (both servers)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mix", choices=["fixed", "sharegpt"], default="fixed")
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals (requests/s)")
    ap.add_argument("--chat-turns", type=int, default=0,
                    help="multi-turn chat load: T turns per conversation, --requests "
                         "conversations per client (0 = completions load)")
    ap.add_argument("--llama-extra", default="", help="extra llama-server arguments")
    ap.add_argument("--kvstack-extra", default="", help="extra kvstack serve arguments")
    a = ap.parse_args()
    levels = [int(x) for x in a.concurrency.split(",")]
    max_c = max(levels)
    targets = [(*u.split("=", 1), {}) for u in a.url]
    procs = []
    try:
        if not a.url and os.path.exists(a.kvstack_bin):
            port = free_port()
            cmd = [a.kvstack_bin, "serve", "-m", a.model, "--port", str(port),
                   "--threads", str(a.threads), "--kv-cache-tokens", str(a.ctx),
                   "--max-seqs", str(max_c), *a.kvstack_extra.split()]
            print("#", " ".join(cmd), flush=True)
            procs.append(start(cmd, port))
            targets.append(("kvstack", procs[-1][1], {}))
        if not a.url and a.llama_server_bin:
            port = free_port()
            # Continuous batching, one slot per client, the same KV tokens in
            # total (-kvu: one cache shared by the slots, as kvstack's pool;
            # without it each slot gets ctx / np tokens), prompt cache on
            # (cache_prompt per request).
            cmd = [a.llama_server_bin, "-m", a.model, "--host", "127.0.0.1", "--port", str(port),
                   "-t", str(a.threads), "-tb", str(a.threads), "-c", str(a.ctx),
                   "-np", str(max_c), "-kvu", "-cb", "--slots", *llama_template_args(a.model),
                   *a.llama_extra.split()]
            print("#", " ".join(cmd), flush=True)
            procs.append(start(cmd, port))
            targets.append(("llama-server", procs[-1][1], {"cache_prompt": True}))
        if not a.url and a.llama_cpp_python_server:
            port = free_port()
            cmd = [a.python, "-m", "llama_cpp.server", "--model", a.model, "--host", "127.0.0.1",
                   "--port", str(port), "--n_threads", str(a.threads), "--n_threads_batch",
                   str(a.threads), "--n_ctx", str(a.ctx), "--n_batch", "512",
                   "--logits_all", "False", "--cache", "True", "--cache_type", "ram",
                   "--cache_size", a.llama_cache_size, "--interrupt_requests", "False",
                   *a.llama_extra.split()]
            print("#", " ".join(cmd), flush=True)
            procs.append(start(cmd, port, ready_path="/v1/models"))
            targets.append(("llama-cpp-python", procs[-1][1], {"min_tokens_is_max": True}))
        if not targets:
            sys.exit("nothing to benchmark: build kvstack or pass --url / --llama-server-bin / "
                     "--llama-cpp-python-server")
        # One short unmeasured request per server first: the first requests
        # of a fresh process pay for page faults and lazy set-up.
        for name, base, extra in targets:
            one_request(base, -1, 8, "fixed", extra)
        per_token = kv_bytes_per_token(a.model)
        rows = []
        for r in range(a.rounds):
            # Alternate the order too (A B, B A, ...): neither server always
            # runs right after the other's load.
            for name, base, extra in (targets if r % 2 == 0 else targets[::-1]):
                if a.chat_turns > 0:
                    rows += bench_chat(name, base, levels, a.requests, a.chat_turns,
                                       a.max_tokens, extra, first_conv=10000 * r)
                    continue
                rows += bench(name, base, levels, a.requests, a.max_tokens, a.mix, a.rate, extra,
                              kv_bytes_per_token=per_token, kv_allocated=per_token * a.ctx)
        if a.rounds > 1:
            print("# medians over", a.rounds, "rounds", flush=True)
            for row in medians(rows):
                print(json.dumps(row), flush=True)
    finally:
        for p, _ in procs:
            stop(p)


if __name__ == "__main__":
    main()
