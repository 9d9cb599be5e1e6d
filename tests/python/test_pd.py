"""Prefill/decode disaggregation behind vllm-router (issue 21 items 1 and 3).

One `kvstack serve --role prefill` and one `--role decode` worker on two test
hosts (network namespaces of bench/netns.py, UCX over TCP between them),
vllm-router 0.1.17 in PD mode in the root namespace, and a `--role both`
server as the reference: greedy output, usage and streaming through the
router equal the reference's; the decode worker's cached_tokens are the
pulled blocks. Failure injection: a lease that expires, a prefill worker
killed mid-transfer, a frozen prefill worker, a client that disconnects, a
layout mismatch, a retried decode request, a client retry through the router:
each ends in a clear error or a
correct answer within the timeouts, and afterwards neither side holds a
block or a lease (pool and lease counters from /v1/kv/stats). Decode
workers with another block size or f32 KV convert the blocks and give the
same greedy output; f16 -> bf16 stays a 400. UCX is loaded only by the
P/D roles (not linked; a missing runtime is a clear start-up error).
"""
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from conftest import KVSTACK_BIN, MODEL, SOURCE_DIR

sys.path.insert(0, str(SOURCE_DIR / "bench"))
from netns import Hosts  # noqa: E402

ROUTER = SOURCE_DIR / ".venv" / "bin" / "vllm-router"
LEASE_S = 3.0
TRANSFER_S = 2.0
P = 16  # the default block size

PROMPTS = [
    "The history of the Roman Empire began when Augustus became the first emperor, and over "
    "the following centuries the empire grew to",
    "List three facts about the planet Mars, its two moons and why its surface looks red. "
    "Answer in short sentences: first,",
    "Hi",  # shorter than a block: nothing to transfer, the decode worker computes it
    " ".join(f"word{i}" for i in range(90)) + " and the next word is",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """`kvstack serve` on a test host (or the root namespace when host is None)."""

    def __init__(self, host, role, port=8000, extra=(), env=None, model=MODEL):
        self.addr = host.addr if host else "127.0.0.1"
        self.port = port if host else free_port()
        cmd = [KVSTACK_BIN, "serve", "-m", model, "--host", self.addr, "--port", str(self.port),
               "--threads", "1", "--kv-cache-mem", "48M", "--role", role,
               "--kv-lease-timeout", str(LEASE_S), "--kv-transfer-timeout", str(TRANSFER_S),
               *extra]
        e = dict(os.environ, UCX_TLS="tcp", **(env or {}))
        self.proc = (host.popen(cmd, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True) if host else
                     subprocess.Popen(cmd, env=e, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
        self.log = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        self.base = f"http://{self.addr}:{self.port}"
        deadline = time.time() + 60
        while True:
            try:
                if requests.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{role} worker did not start:\n" + "".join(self.log))
            time.sleep(0.1)

    def stats(self, **params):
        return requests.get(self.base + "/v1/kv/stats", params=params, timeout=10).json()

    def post(self, path, body, timeout=60, **kw):
        return requests.post(self.base + path, json=body, timeout=timeout, **kw)

    def assert_clean(self, timeout=10):
        """No block held, no reference, no open lease (after the reaper ran)."""
        deadline = time.time() + timeout
        while True:
            st = self.stats()
            pool, tr = st["pool"], st.get("transfer", {})
            clean = (pool["blocks_used"] == 0 and pool["references"] == 0
                     and pool["blocks_free"] + pool["blocks_cached"] == pool["blocks_total"]
                     and tr.get("leases_open", 0) == 0 and tr.get("leases_pinned_blocks", 0) == 0
                     and tr.get("leases_pending_release", 0) == 0
                     and st["scheduler"]["running"] == 0)
            if clean:
                return st
            if time.time() > deadline:
                raise AssertionError(f"{self.base} not clean: {json.dumps(st)}")
            time.sleep(0.05)

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Router:
    def __init__(self, prefill, decode, extra=()):
        self.port = free_port()
        cmd = [str(ROUTER), "--vllm-pd-disaggregation", "--prefill", prefill.base,
               "--decode", decode.base, "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-port", str(free_port()), *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 60
        while True:
            try:
                if requests.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("vllm-router did not start")
            time.sleep(0.2)

    def post(self, path, body, timeout=60, **kw):
        return requests.post(self.base + path, json=body, timeout=timeout, **kw)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def hosts():
    if not ROUTER.exists():
        pytest.skip("vllm-router is not installed in .venv (scripts/setup.sh)")
    with Hosts(3) as hs:
        yield hs


@pytest.fixture(scope="module")
def cluster(hosts):
    prefill = Worker(hosts[0], "prefill", extra=["--kv-transfer-host", hosts[0].addr,
                                                 "--kv-transfer-port", "8100"])
    decode = Worker(hosts[1], "decode")
    both = Worker(None, "both")
    router = Router(prefill, decode)
    yield prefill, decode, both, router
    router.stop()
    for w in (prefill, decode, both):
        w.stop()


def completion(prompt, max_tokens=12, **kw):
    return {"model": "kvstack", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}


def read_sse_completion(r):
    """The text and the last usage object of a streamed /v1/completions response."""
    text, usage = "", None
    for line in r.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        for c in ev.get("choices", []):
            text += c.get("text", "")
        usage = ev.get("usage") or usage
    return text, usage


def prefill_request(worker, prompt, max_tokens=12):
    """What vllm-router sends a prefill worker (its defaulted fields included)."""
    body = completion(prompt, 1, stream=False, echo=False, no_stop_trim=False, ignore_eos=False,
                      skip_special_tokens=True, return_hidden_states=False, min_tokens=1,
                      kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                          "remote_engine_id": None, "remote_block_ids": None,
                                          "remote_host": None, "remote_port": None})
    r = worker.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def test_pd_output_usage_and_streaming_match_a_single_server(hosts, cluster):
    prefill, decode, both, router = cluster
    if hosts.fallback_reason:
        print("note:", hosts.fallback_reason)
    for prompt in PROMPTS:
        ref = both.post("/v1/completions", completion(prompt)).json()
        hits = decode.stats()["prefix_cache"]["namespace"]["hit_tokens"]
        got = router.post("/v1/completions", completion(prompt))
        assert got.status_code == 200, got.text
        got = got.json()
        assert got["choices"][0]["text"] == ref["choices"][0]["text"], prompt
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert got["usage"][k] == ref["usage"][k], (k, prompt)
        n = ref["usage"]["prompt_tokens"]
        # The pulled blocks are the decode worker's prefix hit (the router
        # reports the prefill's cached_tokens in usage, so ask the worker).
        hit = decode.stats()["prefix_cache"]["namespace"]["hit_tokens"] - hits
        assert hit == (n - 1) // P * P, prompt
    # A tenant's cache_salt names the same namespace on both workers.
    salted = completion(PROMPTS[0], cache_salt="tenant-a")
    hits = decode.stats(cache_salt="tenant-a")["prefix_cache"]["namespace"]["hit_tokens"]
    got = router.post("/v1/completions", salted).json()
    assert got["choices"][0]["text"] == both.post("/v1/completions", salted).json()["choices"][0]["text"]
    assert decode.stats(cache_salt="tenant-a")["prefix_cache"]["namespace"]["hit_tokens"] - hits == P
    # Chat, and streaming through the router.
    chat = {"model": "kvstack", "messages": [{"role": "user", "content": PROMPTS[1]}],
            "max_tokens": 10, "temperature": 0}
    ref = both.post("/v1/chat/completions", chat).json()
    got = router.post("/v1/chat/completions", chat).json()
    assert got["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    assert got["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
    r = router.post("/v1/completions", completion(PROMPTS[0], stream=True,
                                                  stream_options={"include_usage": True}),
                    stream=True)
    assert r.status_code == 200
    text, usage = read_sse_completion(r)
    ref = both.post("/v1/completions", completion(PROMPTS[0])).json()
    assert text == ref["choices"][0]["text"]
    assert usage["completion_tokens"] == ref["usage"]["completion_tokens"]
    # Every offer was pulled and completed; bytes and times are reported.
    pst, dst = prefill.assert_clean(), decode.assert_clean()
    ptr, dtr = pst["transfer"], dst["transfer"]
    assert ptr["leases_completed"] == ptr["leases_created"] > 0
    assert ptr["leases_expired"] == ptr["leases_cancelled"] == 0
    assert dtr["pulls_failed"] == 0 and dtr["layout_conversions"] == 0
    assert dtr["bytes_pulled"] == dtr["blocks_pulled"] * pst["pool"]["block_bytes"] > 0
    assert dtr["read_seconds"] > 0 and dtr["blocks_local"] > 0  # the streamed prompt was cached
    assert ptr["bytes_offered"] == (dtr["blocks_pulled"] + dtr["blocks_local"]) * pst["pool"]["block_bytes"]
    metrics = requests.get(decode.base + "/metrics", timeout=10).text
    assert re.search(r"kvstack_kv_transfer_bytes_pulled_total\{[^}]*\} [1-9]", metrics)


def ucx_libraries(pid):
    """UCX libraries mapped into process `pid` (libucp, libucs, libuct, libucm)."""
    maps = pathlib.Path(f"/proc/{pid}/maps").read_text()
    return set(re.findall(r"/(libuc[pstm])\.so", maps))


def test_ucx_is_loaded_only_by_the_pd_roles(cluster):
    prefill, decode, both, _ = cluster
    # Not linked: the binary does not pull UCX (or libucm's memory hooks) in.
    ldd = subprocess.run(["ldd", str(KVSTACK_BIN)], capture_output=True, text=True).stdout
    assert "libucp" not in ldd and "libucm" not in ldd and "libucs" not in ldd, ldd
    # Loaded on demand by the P/D roles only.
    assert ucx_libraries(both.proc.pid) == set()
    for w in (prefill, decode):
        assert {"libucp", "libucs", "libucm"} <= ucx_libraries(w.proc.pid)
    # Without a UCX runtime a P/D role fails at start-up with an error
    # naming the library and the package, not a crash.
    cmd = [KVSTACK_BIN, "serve", "-m", MODEL, "--host", "127.0.0.1", "--port", str(free_port()),
           "--threads", "1", "--kv-cache-mem", "48M", "--role", "decode"]
    r = subprocess.run(cmd, env=dict(os.environ, KVSTACK_UCP_LIBRARY="/nonexistent/libucp.so.0"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "/nonexistent/libucp.so.0" in r.stderr and "libucx0" in r.stderr, r.stderr


def test_lease_expires_and_a_late_pull_is_a_clear_error(cluster):
    prefill, decode, _, _ = cluster
    before = prefill.stats()["transfer"]
    params = prefill_request(prefill, PROMPTS[3])
    assert params["do_remote_prefill"] is True and params["n_tokens"] > 0
    st = prefill.stats()
    assert st["transfer"]["leases_open"] == 1
    assert st["pool"]["blocks_used"] == len(params["remote_block_ids"])  # pinned
    t0 = time.time()
    prefill.assert_clean(timeout=LEASE_S + 3)
    assert time.time() - t0 >= LEASE_S - 1.0
    assert prefill.stats()["transfer"]["leases_expired"] == before["leases_expired"] + 1
    r = decode.post("/v1/completions", completion(PROMPTS[3], kv_transfer_params=params))
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_transfer_failed" and "ended" in err["message"], err
    decode.assert_clean()


def test_layout_mismatch_is_refused_and_ends_the_lease(cluster):
    prefill, decode, _, _ = cluster
    params = prefill_request(prefill, PROMPTS[0])
    bad = dict(params, format_digest="0" * 32, kv_format="int8")
    r = decode.post("/v1/completions", completion(PROMPTS[0], kv_transfer_params=bad))
    assert r.status_code == 400, r.text
    assert "KV format differs" in r.json()["error"]["message"]
    t0 = time.time()
    prefill.assert_clean(timeout=LEASE_S)
    assert time.time() - t0 < LEASE_S - 1, "the mismatch did not end the lease before its timeout"
    assert decode.stats()["transfer"]["layout_mismatches"] >= 1
    decode.assert_clean()


@pytest.mark.parametrize("block_size,kv_dtype", [(32, "f16"), (8, "f16"), (16, "f32"), (32, "f32")])
def test_decode_worker_with_another_layout_converts_the_blocks(hosts, cluster, block_size, kv_dtype):
    """A decode worker with another block size and/or f32 KV converts the
    prefill worker's f16 blocks (transfer/kv_convert.h): the pulled prefix
    is what its request's lookup hits, and greedy output equals one server's.
    f32 decode rows run the AVX2 float kernel, so their reference is an f16
    server with attention capped at AVX2 (the same float order; the AVX-512
    f16 kernel sums in another and may flip a near-tie token)."""
    prefill, _, both, _ = cluster
    dec = Worker(hosts[2], "decode", port=8010,
                 extra=["--block-size", str(block_size), "--kv-dtype", kv_dtype])
    ref_server = both if kv_dtype == "f16" else Worker(None, "both",
                                                       env={"KVSTACK_ATTN_ISA": "avx2"})
    try:
        for prompt in (PROMPTS[3], PROMPTS[0] + " " + PROMPTS[1]):
            ref = ref_server.post("/v1/completions", completion(prompt)).json()
            params = prefill_request(prefill, prompt)
            hits = dec.stats()["prefix_cache"]["namespace"]["hit_tokens"]
            r = dec.post("/v1/completions", completion(prompt, kv_transfer_params=params))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"], prompt[:40]
            usage, want = r.json()["usage"], params["n_tokens"] // block_size * block_size
            for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
                assert usage[k] == ref["usage"][k]
            assert usage["prompt_tokens_details"]["cached_tokens"] == want > 0
            assert dec.stats()["prefix_cache"]["namespace"]["hit_tokens"] - hits == want
        tr = dec.assert_clean()["transfer"]
        assert tr["layout_conversions"] == 2 and tr["pulls_failed"] == 0
        assert tr["blocks_converted"] >= 2 * (P // block_size if block_size < P else 1)
        prefill.assert_clean()
        metrics = requests.get(dec.base + "/metrics", timeout=10).text
        assert re.search(r"kvstack_kv_transfer_layout_conversions_total\{[^}]*\} 2", metrics)
    finally:
        dec.stop()
        if ref_server is not both:
            ref_server.stop()


def test_layer_by_layer_pull_gives_the_same_output_and_times_every_layer(hosts, cluster):
    """--kv-pull-by-layer reads layer l of every block, then layer l + 1
    (what a pull of each layer as it becomes ready does): the records still
    verify, greedy output equals one server's, and both workers report the
    per-layer times (t_p of the prefill's forward, t_x of the gets)."""
    prefill, _, both, _ = cluster
    dec = Worker(hosts[2], "decode", port=8013, extra=["--kv-pull-by-layer"])
    try:
        for prompt in (PROMPTS[3], PROMPTS[1] + " " + PROMPTS[2] + " " + PROMPTS[0]):
            ref = both.post("/v1/completions", completion(prompt)).json()
            before = prefill.stats()["transfer"]
            params = prefill_request(prefill, prompt)
            after = prefill.stats()["transfer"]
            L = int(re.search(r";L=(\d+);", params["kv_format"]).group(1))
            assert len(after["prefill_layer_seconds"]) == L
            assert after["prefill_steps"] > before["prefill_steps"]
            assert all(a > b for a, b in zip(after["prefill_layer_seconds"],
                                              before["prefill_layer_seconds"] or [0.0] * L))
            r = dec.post("/v1/completions", completion(prompt, kv_transfer_params=params))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"], prompt[:40]
            assert r.json()["usage"] == ref["usage"] | {
                "prompt_tokens_details": r.json()["usage"]["prompt_tokens_details"]}
            # The lookup stops at least one token before the prompt's end.
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert params["n_tokens"] - 1 <= cached <= params["n_tokens"] and cached > 0
            tr = dec.stats()["transfer"]
            assert len(tr["last_layer_get_seconds"]) == L
            assert all(t > 0 for t in tr["last_layer_get_seconds"])
            assert tr["last_gets"] == L * params["n_tokens"] // P
        tr = dec.assert_clean()["transfer"]
        assert tr["pulls_ok"] == 2 and tr["pulls_failed"] == 0
        prefill.assert_clean()
    finally:
        dec.stop()


def test_unconvertible_layout_stays_a_clear_400(hosts, cluster):
    prefill, _, _, _ = cluster
    dec = Worker(hosts[2], "decode", port=8011, extra=["--kv-dtype", "bf16"])
    try:
        params = prefill_request(prefill, PROMPTS[0])
        r = dec.post("/v1/completions", completion(PROMPTS[0], kv_transfer_params=params))
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "not converted" in msg and "f16 -> bf16" in msg, msg
        prefill.assert_clean(timeout=LEASE_S - 1)  # the refusal ended the lease
        tr = dec.assert_clean()["transfer"]
        assert tr["layout_mismatches"] == 1 and tr["layout_conversions"] == 0
    finally:
        dec.stop()


def test_concurrent_pulls_run_at_once_up_to_the_bound(hosts, cluster):
    """Six P/D requests at once on a decode worker with --kv-max-pulls 2 (each
    pull stalls 300 ms between offer and read): two pulls run at a time,
    never more, the rest wait for a lane; every answer equals one server's
    and afterwards neither side holds a block or a lease."""
    prefill, _, both, _ = cluster
    dec = Worker(hosts[2], "decode", port=8012, extra=["--kv-max-pulls", "2"],
                 env={"KVSTACK_TEST_PULL_STALL_MS": "300"})
    try:
        prompts = [f"Request {i}: " + PROMPTS[i % 2] for i in range(6)]
        refs = [both.post("/v1/completions", completion(p)).json()["choices"][0]["text"]
                for p in prompts]
        out = [None] * len(prompts)

        def one(i):
            params = prefill_request(prefill, prompts[i])
            r = dec.post("/v1/completions", completion(prompts[i], kv_transfer_params=params))
            out[i] = (r.status_code, r.json())

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i, (code, body) in enumerate(out):
            assert code == 200, body
            assert body["choices"][0]["text"] == refs[i], prompts[i]
        tr = dec.assert_clean()["transfer"]
        assert tr["pulls_ok"] == len(prompts) and tr["pulls_failed"] == 0
        assert tr["max_pulls"] == 2 and tr["pulls_in_flight"] == 0
        assert tr["pulls_in_flight_max"] == 2, tr  # concurrent, and bounded
        assert tr["pull_wait_seconds"] > 0.2  # some waited for a lane
        prefill.assert_clean()
    finally:
        dec.stop()


def test_kivi_blocks_move_over_pd(hosts):
    """KIVI (kivi4): only converted blocks are published, and they are whole
    (codes and per-block metadata); the decode worker commits them as
    converted (no residual pass) and answers exactly like one KIVI server
    that hits the same prefix in its own cache."""
    flags = ["--kv-dtype", "kivi4"]
    pre = Worker(hosts[0], "prefill", port=8003,
                 extra=[*flags, "--kv-transfer-host", hosts[0].addr, "--kv-transfer-port", "8103"])
    dec = Worker(hosts[1], "decode", port=8003, extra=flags)
    both = Worker(None, "both", extra=flags)
    try:
        pulled = 0
        # No shared prefix between the prompts: a KIVI hit is lossy, so blocks
        # computed after one depend on the cache's history, which must be
        # the same on the prefill worker and the reference.
        for prompt in (PROMPTS[3], " ".join(f"item{i}" for i in range(120)) + " and"):
            both.post("/v1/completions", completion(prompt, 1))  # publishes its converted blocks
            ref = both.post("/v1/completions", completion(prompt)).json()  # hits them
            params = prefill_request(pre, prompt)
            assert params["do_remote_prefill"] and params["n_tokens"] > 0, params
            assert params["n_tokens"] == ref["usage"]["prompt_tokens_details"]["cached_tokens"]
            r = dec.post("/v1/completions", completion(prompt, kv_transfer_params=params))
            assert r.status_code == 200, r.text
            assert r.json()["usage"] == ref["usage"]
            assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"], prompt[:40]
            pulled += params["n_tokens"] // P
        tr = dec.assert_clean()["transfer"]
        assert tr["blocks_pulled"] == pulled and tr["layout_conversions"] == 0
        assert pre.assert_clean()["transfer"]["leases_completed"] == 2
    finally:
        for w in (pre, dec, both):
            w.stop()


def test_retried_decode_request_is_an_error_not_a_second_read(cluster):
    prefill, decode, both, _ = cluster
    params = prefill_request(prefill, PROMPTS[1])
    ok = decode.post("/v1/completions", completion(PROMPTS[1], kv_transfer_params=params))
    assert ok.status_code == 200
    ref = both.post("/v1/completions", completion(PROMPTS[1])).json()
    assert ok.json()["choices"][0]["text"] == ref["choices"][0]["text"]
    # The same params again (a router retry): the lease is gone; but this
    # worker caches the prefix now, so it is served from its own cache.
    again = decode.post("/v1/completions", completion(PROMPTS[1], kv_transfer_params=params))
    assert again.status_code in (200, 502), again.text
    if again.status_code == 200:
        assert again.json()["choices"][0]["text"] == ref["choices"][0]["text"]
    else:
        assert again.json()["error"]["code"] == "kv_transfer_failed"
    prefill.assert_clean()
    decode.assert_clean()


def test_client_disconnects_at_the_decode_worker_and_at_the_router(cluster):
    prefill, decode, _, router = cluster
    params = prefill_request(prefill, PROMPTS[0])
    # A client that goes away while its decode request pulls / decodes.
    with pytest.raises(requests.exceptions.ReadTimeout):
        decode.post("/v1/completions", completion(PROMPTS[0], 200, ignore_eos=True,
                                                  kv_transfer_params=params), timeout=0.3)
    # And one that leaves the router mid-stream.
    r = router.post("/v1/completions", completion(PROMPTS[3], 200, stream=True, ignore_eos=True),
                    stream=True, timeout=30)
    for _ in r.iter_lines():
        break
    r.close()
    # And one that leaves the router while the prefill worker still
    # computes: whatever lease that prefill makes nobody pulls; it expires.
    long_prompt = " ".join(f"item{i}" for i in range(250))  # ~950 tokens: ~1 s of prefill
    with pytest.raises(requests.exceptions.ReadTimeout):
        router.post("/v1/completions", completion(long_prompt, 20), timeout=0.2)
    time.sleep(0.5)
    prefill.assert_clean(timeout=LEASE_S + 15)
    decode.assert_clean(timeout=15)


def test_prefill_killed_mid_transfer_or_frozen_and_a_client_retry(hosts, cluster):
    _, _, both, _ = cluster
    # The decode worker waits 1.5 s between the offer and its reads, so the
    # prefill worker can be killed after the offer and before the data.
    stall = Worker(hosts[1], "decode", port=8001, env={"KVSTACK_TEST_PULL_STALL_MS": "1500"})
    victim_flags = ["--kv-transfer-host", hosts[2].addr, "--kv-transfer-port", "8100"]
    victim = Worker(hosts[2], "prefill", extra=victim_flags)
    router = Router(victim, stall)
    ref = both.post("/v1/completions", completion(PROMPTS[3])).json()
    try:
        result = {}

        def request():
            t0 = time.time()
            result["r"] = router.post("/v1/completions", completion(PROMPTS[3]))
            result["t"] = time.time() - t0

        th = threading.Thread(target=request)
        th.start()
        deadline = time.time() + 20  # until the offer exists
        while victim.stats()["transfer"]["offers"] == 0 and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # offer received by the decode worker, reads not started
        victim.stop(signal.SIGKILL)
        th.join(30)
        assert not th.is_alive()
        r = result["r"]
        # vllm-router passes the decode worker's error through (it does not
        # retry a PD stage): an error, never text from unverified K/V.
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "kv_transfer_failed"
        assert result["t"] < 1.5 + TRANSFER_S + 5
        stall.assert_clean()
        # The client retries through the router once the prefill worker is
        # back: a new prefill, a new lease, the right answer.
        victim = Worker(hosts[2], "prefill", extra=victim_flags)
        deadline = time.time() + 30
        while True:
            r = router.post("/v1/completions", completion(PROMPTS[3]))
            if r.status_code == 200 or time.time() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
        assert stall.stats()["transfer"]["blocks_pulled"] > 0
        victim.assert_clean()
        stall.assert_clean()
        # A frozen prefill worker: the decode worker gives up after its
        # transfer timeout, with an error and no block held.
        params = prefill_request(victim, PROMPTS[0])
        victim.proc.send_signal(signal.SIGSTOP)
        t0 = time.time()
        r = stall.post("/v1/completions", completion(PROMPTS[0], kv_transfer_params=params))
        took = time.time() - t0
        assert r.status_code == 502 and r.json()["error"]["code"] == "kv_transfer_failed", r.text
        assert took < TRANSFER_S + 3, took
        victim.proc.send_signal(signal.SIGCONT)
        victim.assert_clean(timeout=LEASE_S + 3)  # its lease ended (cancelled or expired)
        stall.assert_clean()
        # The same decode worker still serves correct output afterwards.
        ok = stall.post("/v1/completions", completion(PROMPTS[0])).json()
        ref0 = both.post("/v1/completions", completion(PROMPTS[0])).json()
        assert ok["choices"][0]["text"] == ref0["choices"][0]["text"]
    finally:
        router.stop()
        victim.stop(signal.SIGKILL)
        stall.stop()


GEMMA3 = SOURCE_DIR / "models" / "gemma-3-270m-q4_k_m.gguf"


def test_hybrid_model_moves_every_kv_group(hosts):
    """Gemma 3 (one full-attention and five 512-token window KV groups): the
    offer carries every group's blocks a query at the prefix length sees; a
    prompt past the window makes the decode worker drop the window blocks
    before it (never transferred) and still generate what one server does."""
    if not GEMMA3.exists():
        pytest.skip("Gemma 3 model not fetched (scripts/setup.sh model)")
    flags = ["--kv-cache-mem", "96M"]
    pre = Worker(hosts[0], "prefill", port=8002, model=GEMMA3,
                 extra=[*flags, "--kv-transfer-host", hosts[0].addr, "--kv-transfer-port", "8102"])
    dec = Worker(hosts[1], "decode", port=8002, model=GEMMA3, extra=flags)
    both = Worker(None, "both", model=GEMMA3, extra=flags)
    router = Router(pre, dec)
    try:
        groups = dec.stats()["pool"]["groups"]
        assert len(groups) > 1 and any(g["window"] > 0 for g in groups)
        long_prompt = " ".join(f"w{i}" for i in range(200)) + " and then"  # > 512 tokens
        expect_blocks = 0
        for prompt in (PROMPTS[0], long_prompt):
            ref = both.post("/v1/completions", completion(prompt, 10)).json()
            hits = dec.stats()["prefix_cache"]["namespace"]["hit_tokens"]
            got = router.post("/v1/completions", completion(prompt, 10))
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["text"] == ref["choices"][0]["text"], prompt[:40]
            n = ref["usage"]["prompt_tokens"]
            assert dec.stats()["prefix_cache"]["namespace"]["hit_tokens"] - hits == (n - 1) // P * P
            # Its nodes, plus each window group's blocks a query at the
            # prefix length can see (the full-attention group 0 is the nodes).
            n_blocks = (n - 1) // P
            for g in groups[1:]:
                first = max(0, n_blocks * P - g["window"] + 1) // P if g["window"] else 0
                expect_blocks += n_blocks - first
            expect_blocks += n_blocks
        assert n > 528  # the window groups dropped blocks
        tr = dec.assert_clean()["transfer"]
        assert tr["blocks_pulled"] == expect_blocks
        assert pre.assert_clean()["transfer"]["leases_completed"] == 2
    finally:
        router.stop()
        for w in (pre, dec, both):
            w.stop()


def test_router_rewritten_fields_are_accepted_and_bad_values_named(cluster):
    _, _, both, _ = cluster
    body = completion("Hello", 2, no_stop_trim=False, skip_special_tokens=True,
                      return_hidden_states=False, separate_reasoning=True, min_tokens=0,
                      kv_transfer_params={"do_remote_decode": True})
    assert both.post("/v1/completions", body).status_code == 200  # role both: computed here
    for field, value in (("no_stop_trim", True), ("min_tokens", 5), ("kv_transfer_params", 3)):
        r = both.post("/v1/completions", dict(body, **{field: value}))
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
