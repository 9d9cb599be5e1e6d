"""End-to-end tests of `kvstack serve` with the real openai Python client.

One server on the default model (loopback, a free port, stopped by SIGTERM
at the end). Greedy outputs are compared with `kvstack run`, usage with
`kvstack tokenize`; a table of malformed requests runs while a long
generation streams beside it; 20 clients drop mid-stream and their blocks
must be freed.
"""
import concurrent.futures as cf
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from conftest import KVSTACK_BIN, MODEL, SOURCE_DIR, THREADS, run_kvstack

openai = pytest.importorskip("openai")


class ServerProcess:
    """A `kvstack serve` child on 127.0.0.1 and a free port."""

    def __init__(self, *extra, api_key=None, admin_key=None, timeout=120):
        cmd = [KVSTACK_BIN, "serve", "-m", MODEL, "--port", "0", "--threads", str(THREADS), *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        if admin_key:
            cmd += ["--admin-api-key", admin_key]
        self.api_key = api_key
        self.admin_key = admin_key
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr_lines = []
        self.port = None
        ready = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.stderr_lines.append(line)
                m = re.search(r"ready on http://[\d.]+:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        self.pump = threading.Thread(target=pump, daemon=True)
        self.pump.start()
        if not ready.wait(timeout) or self.port is None:
            self.stop()
            raise RuntimeError("kvstack serve did not start:\n" + "".join(self.stderr_lines))
        self.curl_line = self.proc.stdout.readline()
        self.base = f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=self.api_key or "none",
                             max_retries=0, timeout=kw.pop("timeout", 120), **kw)

    def get(self, path, **kw):
        return requests.get(self.base + path, timeout=30, **kw)

    def kv_stats(self, admin=True, **params):
        """/v1/kv/stats; with the admin key (when the server has one) unless admin=False."""
        headers = self.auth()
        if admin and self.admin_key:
            headers = {"Authorization": f"Bearer {self.admin_key}"}
        return self.get("/v1/kv/stats", headers=headers, params=params).json()

    def auth(self):
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_idle(self, timeout=20):
        """Waits until no block is referenced; returns the last stats."""
        deadline = time.time() + timeout
        while True:
            st = self.kv_stats()
            if st["pool"]["blocks_used"] == 0 and st["scheduler"]["running"] == 0:
                return st
            if time.time() > deadline:
                return st
            time.sleep(0.05)

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--kv-cache-tokens", "4096", "--max-seqs", "16", admin_key="adm")
    yield s
    assert s.stop() == 0, "".join(s.stderr_lines[-20:])


def run_greedy(prompt, n):
    out = run_kvstack("run", "-m", MODEL, "--threads", THREADS, "--temp", "0", "-n", n, "-p",
                      prompt, "--json")
    return json.loads(out.stdout.strip().splitlines()[-1])


def n_prompt_tokens(text):
    out = run_kvstack("tokenize", "-m", MODEL, "-p", text)
    return len(json.loads(out.stdout))


PROMPTS = ["The capital of France is", "def quicksort(arr):\n   ",
           "A haiku about the sea:\n"]


def test_health_models_and_curl_line(server):
    assert server.get("/health").json() == {"status": "ok"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert server.curl_line.startswith(f"curl http://127.0.0.1:{server.port}/v1/chat/completions")


@pytest.fixture(scope="module")
def greedy_refs():
    return {p: run_greedy(p, 24) for p in PROMPTS}


def test_greedy_matches_kvstack_run_alone(server, greedy_refs):
    c = server.client()
    refs = greedy_refs
    for p in PROMPTS:
        r = c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=p, max_tokens=24,
                                 temperature=0)
        assert r.choices[0].text == refs[p]["text"], p
        assert r.usage.completion_tokens == refs[p]["completion_tokens"]
        assert r.usage.prompt_tokens == refs[p]["prompt_tokens"] == n_prompt_tokens(p)


# Batch-invariant kernels (a row's result does not depend on the other rows
# of its step) plus the shared chunking rule (Engine::prefill and the
# scheduler compute every prompt token inside a chunk of >= 2 tokens and
# every sampled token as a one-token entry): identical greedy tokens.
def test_greedy_matches_kvstack_run_under_load(server, greedy_refs):
    c = server.client()
    refs = greedy_refs
    # The same prompts while 8 other requests (sampled, long) share the batch.
    others = ["Write a long story about a dragon.", "Explain photosynthesis in detail.",
              "List the planets of the solar system and describe each."] * 3
    with cf.ThreadPoolExecutor(12) as ex:
        bg = [ex.submit(c.completions.create, model="SmolLM2-135M-Instruct.Q4_1", prompt=o,
                        max_tokens=40, temperature=0.8, seed=i) for i, o in enumerate(others[:8])]
        time.sleep(0.3)
        fg = {p: ex.submit(c.completions.create, model="SmolLM2-135M-Instruct.Q4_1", prompt=p,
                           max_tokens=24, temperature=0) for p in PROMPTS}
        for p, f in fg.items():
            assert f.result().choices[0].text == refs[p]["text"], p
        for f in bg:
            assert f.result().usage.completion_tokens > 0


def test_chat_stream_and_not(server):
    c = server.client()
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    r = c.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=msgs, max_tokens=20,
                                  temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason in ("stop", "length")
    stream = c.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=msgs,
                                       max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                pieces.append(ch.delta.content)
            finish = ch.finish_reason or finish
    assert "".join(pieces) == text
    assert usage.completion_tokens == r.usage.completion_tokens
    assert usage.prompt_tokens == r.usage.prompt_tokens
    assert finish == r.choices[0].finish_reason
    # Completions streaming gives the same text as the non-streamed call.
    ref = c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPTS[0],
                               max_tokens=16, temperature=0).choices[0].text
    got = "".join(ch.choices[0].text for ch in c.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPTS[0], max_tokens=16, temperature=0,
        stream=True) if ch.choices)
    assert got == ref


def test_n3_stop_seed_logprobs(server):
    c = server.client()
    r = c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="Once upon a time",
                             max_tokens=12, temperature=1.0, n=3, seed=42)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    again = c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="Once upon a time",
                                 max_tokens=12, temperature=1.0, n=3, seed=42)
    assert [ch.text for ch in r.choices] == [ch.text for ch in again.choices]
    assert len({ch.text for ch in r.choices}) > 1  # forks sample independently
    assert 3 <= r.usage.completion_tokens <= 36  # counted over all choices
    # Stop strings: the text ends before the first occurrence.
    full = c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="1, 2, 3, 4,",
                                max_tokens=16, temperature=0).choices[0].text
    assert "6" in full
    cut = c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="1, 2, 3, 4,",
                               max_tokens=16, temperature=0, stop=["6"])
    assert cut.choices[0].text == full[:full.index("6")]
    assert cut.choices[0].finish_reason == "stop"
    # Logprobs of the greedy choice are the largest of the alternatives.
    lp = c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPTS[0], max_tokens=4,
                              temperature=0, logprobs=3).choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(t) <= 3 for t in lp.top_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and abs(chosen - max(top.values())) < 1e-4
    ch = c.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1",
                                   messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                   temperature=0, logprobs=True, top_logprobs=2)
    assert len(ch.choices[0].logprobs.content) >= 1
    assert len(ch.choices[0].logprobs.content[0].top_logprobs) == 2


def test_cached_tokens_and_cache_salt(server):
    if not server.kv_stats()["prefix_cache"]["enabled"]:
        pytest.skip("prefix cache disabled in this build")
    c = server.client()
    prefix = ("You are a helpful assistant that answers questions about geography. " * 6)
    first = c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=prefix + "Q: Paris?",
                                 max_tokens=2, temperature=0)
    second = c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=prefix + "Q: Rome?",
                                  max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 64
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    salted = c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=prefix + "Q: Oslo?",
                                  max_tokens=2, temperature=0,
                                  extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    metrics = server.get("/metrics").text
    hits = float(re.search(r"^kvstack:prefix_cache_hits_total\{[^}]*\} (\S+)", metrics, re.M)[1])
    assert hits >= 64
    # /v1/kv/stats: the prefix index's own counters agree.
    pc = server.kv_stats()["prefix_cache"]
    assert pc["queries"] >= 3 and pc["hit_blocks"] >= 4 and pc["hit_tokens"] >= 64
    assert 0 < pc["hit_rate"] <= 1 and pc["published_blocks"] >= 4
    for key in ("cached_blocks", "evictions", "cow_copies", "partial_hits", "pinned_blocks",
                "nodes", "events_dropped"):
        assert isinstance(pc[key], int) and pc[key] >= 0, key
    by_ns = {n["namespace"]: n for n in pc["namespaces"]}
    assert len(by_ns) >= 2  # the default namespace and tenant-b's
    assert sum(n["hit_blocks"] for n in by_ns.values()) == pc["hit_blocks"]


def _bad_table():
    M = "SmolLM2-135M-Instruct.Q4_1"
    msg = [{"role": "user", "content": "hi"}]
    C, H = "/v1/completions", "/v1/chat/completions"
    long_prompt = "hello " * 9000
    # (path, body (dict, or raw bytes), status, error type)
    return [
        (C, b"{not json", 400, "invalid_request_error"),
        (C, b"", 400, "invalid_request_error"),
        (C, b"[1, 2]", 400, "invalid_request_error"),
        (C, b'{"prompt": "a\xff\xfe"}', 400, "invalid_request_error"),
        (C, b'{"prompt": "\\ud800"}', 400, "invalid_request_error"),
        (C, {"model": M}, 400, "invalid_request_error"),
        (C, {"prompt": 5}, 400, "invalid_request_error"),
        (C, {"prompt": ""}, 400, "invalid_request_error"),
        (C, {"prompt": []}, 400, "invalid_request_error"),
        (C, {"prompt": [1, -3]}, 400, "invalid_request_error"),
        (C, {"prompt": [1, 10**9]}, 400, "invalid_request_error"),
        (C, {"prompt": ["a", ""]}, 400, "invalid_request_error"),
        (C, {"prompt": ["a"] * 65}, 400, "invalid_request_error"),
        (C, b'{"prompt": "x", "temperature": 1e400}', 400, "invalid_request_error"),
        (C, {"prompt": "x", "cache_salt": "s" * 1025}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "model": "gpt-4"}, 404, "invalid_request_error"),
        (C, {"prompt": "x", "max_tokens": "ten"}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "max_tokens": 0}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "max_tokens": 1.5}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "max_tokens": 5000000}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "max_tokens": 6000}, 400, "invalid_request_error"),  # > pool
        (C, {"prompt": "x", "max_tokens": 8192}, 400, "invalid_request_error"),  # > context
        (C, {"prompt": long_prompt}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "temperature": 3}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "temperature": "hot"}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "top_p": 0}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "top_p": 1.5}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "min_p": -0.1}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "frequency_penalty": 5}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "presence_penalty": -3}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "n": 0}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "n": 500}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "stop": 7}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "stop": [""]}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "stream": "yes"}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
         "invalid_request_error"),
        (C, {"prompt": "x", "logprobs": 50}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "seed": "abc"}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "frobnicate": 1}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "logit_bias": {"1": 5}}, 400, "invalid_request_error"),
        (C, {"prompt": "x", "model": "gpt-5"}, 404, "invalid_request_error"),
        (H, {"messages": []}, 400, "invalid_request_error"),
        (H, {"messages": "hi"}, 400, "invalid_request_error"),
        (H, {}, 400, "invalid_request_error"),
        (H, {"messages": [{"content": "no role"}]}, 400, "invalid_request_error"),
        (H, {"messages": [{"role": "user"}]}, 400, "invalid_request_error"),
        (H, {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_request_error"),
        (H, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request_error"),
        (H, {"messages": msg, "top_logprobs": 2}, 400, "invalid_request_error"),
        (H, {"messages": msg, "max_completion_tokens": -1}, 400, "invalid_request_error"),
        (H, {"messages": msg, "prompt": "x"}, 400, "invalid_request_error"),
        (H, {"messages": msg, "tools": [{"type": "function"}]}, 400, "invalid_request_error"),
        ("/v1/nope", {"prompt": "x"}, 404, "invalid_request_error"),
    ]


def test_bad_inputs_do_not_disturb_a_running_generation(server):
    c = server.client()
    result = {}

    def long_gen():
        s = c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPTS[1],
                                 max_tokens=48, temperature=0, stream=True,
                                 extra_body={"ignore_eos": True})
        result["text"] = "".join(ch.choices[0].text for ch in s if ch.choices)
        result["done"] = True

    t = threading.Thread(target=long_gen)
    t.start()
    table = _bad_table()
    assert len(table) >= 30
    for path, body, status, etype in table:
        if isinstance(body, bytes):
            r = requests.post(server.base + path, data=body, timeout=30,
                              headers={"Content-Type": "application/json"})
        else:
            r = requests.post(server.base + path, json=body, timeout=30)
        assert r.status_code == status, (path, body if not isinstance(body, dict) or
                                         len(str(body)) < 200 else "...", r.text[:300])
        err = r.json()["error"]
        assert err["type"] == etype and err["message"], r.text[:300]
    t.join(120)
    assert result.get("done")
    alone = c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPTS[1],
                                 max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
    assert result["text"] == alone.choices[0].text


def test_disconnects_free_blocks(server):
    def drop_mid_stream(i):
        body = {"prompt": f"Tell me a very long story number {i}.", "max_tokens": 400,
                "stream": True, "temperature": 0.7, "ignore_eos": True}
        with requests.post(server.base + "/v1/completions", json=body, stream=True,
                           timeout=60) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    n += 1
                if n >= 3:
                    break  # closing the response drops the connection
        return n

    with cf.ThreadPoolExecutor(20) as ex:
        assert all(n >= 3 for n in ex.map(drop_mid_stream, range(20)))
    st = server.wait_idle(timeout=20)
    assert st["pool"]["blocks_used"] == 0, st
    assert st["pool"]["references"] == 0
    assert st["pool"]["blocks_free"] + st["pool"]["blocks_cached"] == st["pool"]["blocks_total"]
    assert st["scheduler"]["running"] == 0
    assert st["scheduler"]["requests_failed"] >= 20  # cancelled, not run to 400 tokens


def test_metrics_page(server):
    text = server.get("/metrics").text
    for name in ["kvstack:kv_cache_usage_perc", "kvstack:prefix_cache_queries_total",
                 "kvstack:prefix_cache_hits_total", "kvstack:num_requests_running",
                 "kvstack:num_requests_waiting", "kvstack:num_preemptions_total",
                 "kvstack:time_to_first_token_seconds_bucket",
                 "kvstack:inter_token_latency_seconds_count",
                 "kvstack:e2e_request_latency_seconds_sum", "kvstack:prompt_tokens_total",
                 "kvstack:generation_tokens_total"]:
        assert re.search("^" + re.escape(name) + r"\{", text, re.M), name
    gen = float(re.search(r"^kvstack:generation_tokens_total\{[^}]*\} (\S+)", text, re.M)[1])
    assert gen > 0
    # Per KV group: one sample per group of /v1/kv/stats (the default model
    # has one full-attention group), each labelled with its window.
    groups = server.get("/v1/kv/stats").json()["pool"]["groups"]
    for name, key in [("kv_group_blocks_used", "blocks_used"),
                      ("kv_group_blocks_cached", "blocks_cached"),
                      ("kv_group_tokens_resident", "tokens_resident"),
                      ("kv_group_payload_bytes", "payload_bytes"),
                      ("kv_group_allocated_bytes", "allocated_bytes")]:
        assert text.count("# TYPE kvstack:" + name + " gauge") == 1, name
        samples = re.findall(r"^kvstack:" + name + r'\{[^}]*group="(\d+)",window="(\d+)"\} (\S+)',
                             text, re.M)
        want = [(i, grp["window"]) for i, grp in enumerate(groups)]
        assert [(int(g), int(w)) for g, w, _ in samples] == want, name
        assert all(float(v) >= 0 for _, _, v in samples), name


def test_api_key_and_queue_full():
    s = ServerProcess("--kv-cache-tokens", "2048", "--max-seqs", "1", "--max-queue", "1",
                      api_key="sekret")
    try:
        r = requests.post(s.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = requests.post(s.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                          headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert requests.get(s.base + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.base + "/v1", api_key="bad", max_retries=0).models.list()
        c = s.client()
        # One running, one waiting: the next ones are refused with 429.
        body = {"prompt": "Count to one hundred:", "max_tokens": 40, "ignore_eos": True}
        with cf.ThreadPoolExecutor(6) as ex:
            futs = [ex.submit(requests.post, s.base + "/v1/completions", json=body,
                              headers=s.auth(), timeout=300) for _ in range(6)]
            codes = sorted(f.result().status_code for f in futs)
        assert codes.count(200) >= 2 and 429 in codes, codes
        for f in futs:
            if f.result().status_code == 429:
                assert f.result().json()["error"]["type"] == "rate_limit_error"
                assert f.result().json()["error"]["code"] == "queue_full"
                assert f.result().headers["Retry-After"] == "1"
        assert c.models.list().data
    finally:
        assert s.stop() == 0


def test_kv_events_file(tmp_path):
    path = tmp_path / "events.jsonl"
    s = ServerProcess("--kv-cache-tokens", "2048", "--max-seqs", "4", "--kv-events", str(path))
    try:
        c = s.client()
        prefix = "Shared system prompt for every tenant of this deployment. " * 4
        for q in ("one?", "two?"):
            c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=prefix + q,
                                 max_tokens=2, temperature=0)
    finally:
        assert s.stop() == 0, "".join(s.stderr_lines[-20:])
    events = [json.loads(line) for line in path.read_text().splitlines()]
    stored = [e for e in events if e["event"] == "stored"]
    assert len(stored) >= 2, events  # the prefix's full blocks
    for e in events:
        assert e["event"] in ("stored", "removed")
        assert re.fullmatch(r"[0-9a-f]{32}", e["hash"]) and re.fullmatch(r"[0-9a-f]{32}",
                                                                          e["parent"])
        assert e["n_tokens"] > 0 and isinstance(e["namespace"], int)
    # A chain: every stored block's parent is zero or a block stored before it.
    seen = {"0" * 32}
    for e in stored:
        assert e["parent"] in seen, e
        seen.add(e["hash"])
    proc = subprocess.run([KVSTACK_BIN, "serve", "-m", MODEL, "--port", "0", "--kv-events",
                           str(tmp_path / "no" / "such" / "dir.jsonl")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "--kv-events" in proc.stderr


def _readme_block(lang, needle):
    text = (SOURCE_DIR / "README.md").read_text()
    for m in re.finditer(r"```" + lang + r"\n(.*?)```", text, re.S):
        if needle in m[1]:
            return m[1]
    raise AssertionError(f"README.md has no ```{lang} block with {needle!r}")


def test_readme_quick_start_runs_as_written(server):
    """The README's curl line and openai snippet, with only the port changed."""
    port = f"127.0.0.1:{server.port}"
    curl = _readme_block("sh", "curl http://127.0.0.1:8080").replace("127.0.0.1:8080", port)
    out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["model"] == "kvstack" and reply["choices"][0]["message"]["content"]
    snippet = _readme_block("python", "from openai import OpenAI").replace("127.0.0.1:8080", port)
    out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "completion_tokens" in out.stdout


def test_developer_role_and_echo_logprobs(server):
    c = server.client()
    r = c.chat.completions.create(model="kvstack", max_tokens=4, temperature=0, messages=[
        {"role": "developer", "content": "You answer briefly."},
        {"role": "user", "content": "Hi"}])
    assert r.choices[0].message.content is not None
    # echo + logprobs: the prompt's tokens first (the very first without a logprob).
    prompt = "The capital of France is"
    r = requests.post(server.base + "/v1/completions", timeout=60, json={
        "model": "kvstack", "prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True,
        "logprobs": 2}).json()
    lp = r["choices"][0]["logprobs"]
    n_prompt = r["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == n_prompt + 2 == len(lp["token_logprobs"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x < 0 for x in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"][:n_prompt]) == prompt
    assert r["choices"][0]["text"].startswith(prompt)
    # The prompt logprobs agree with what the model gives when it samples that
    # token: " Paris" after the prompt (greedy) vs the echo of prompt + " Paris".
    greedy = requests.post(server.base + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1}).json()
    tok = greedy["choices"][0]["logprobs"]["tokens"][0]
    first = greedy["choices"][0]["logprobs"]["token_logprobs"][0]
    again = requests.post(server.base + "/v1/completions", timeout=60, json={
        "prompt": prompt + tok, "max_tokens": 1, "echo": True, "logprobs": 0}).json()
    echoed = again["choices"][0]["logprobs"]
    assert echoed["tokens"][n_prompt] == tok
    assert abs(echoed["token_logprobs"][n_prompt] - first) < 0.05


def test_prompt_list(server):
    prompts = ["The capital of France is", "def quicksort(arr):\n   "]
    c = server.client()
    r = c.completions.create(model="kvstack", prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    singles = [c.completions.create(model="kvstack", prompt=p, max_tokens=6, temperature=0)
               for p in prompts]
    # Choice prompt * n + j answers prompt `prompt` (greedy: every choice the same text).
    for i, ch in enumerate(r.choices):
        assert ch.text == singles[i // 2].choices[0].text
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == 4 * 6
    # Streaming: every choice index, one [DONE] at the end.
    seen, done = set(), 0
    with requests.post(server.base + "/v1/completions", stream=True, timeout=60, json={
            "prompt": prompts, "max_tokens": 4, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line == b"data: [DONE]":
                done += 1
            elif line.startswith(b"data: "):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
    assert seen == {0, 1} and done == 1
    bad = requests.post(server.base + "/v1/completions", timeout=30,
                        json={"prompt": ["ok", 5], "max_tokens": 1})
    assert bad.status_code == 400 and "prompt[1]" in bad.json()["error"]["message"]
