"""Layer-wise streaming of a prefill to a decode worker (issue 21 item 2).

A decode request whose kv_transfer_params name the prefill worker's control
endpoint (remote_stream_host / remote_stream_port) starts the prefill there
itself (server/pd_agent.h, "Layer-wise streaming"): the prefill worker sends
the reserved blocks' addresses, then LAYER_READY per layer from its forward's
layer hook; the decode worker reads each layer once ready and verifies every
record against the final lease before decoding. Greedy output and usage
equal a `--role both` server's; a prefill worker killed mid-stream gives an
error (502 kv_transfer_failed) and leaves nothing held on the decode side; a
decode worker killed mid-stream leaves nothing held on the prefill side;
two streams of one prompt at once both verify (one may re-read blocks).
"""
import signal
import sys
import threading
import time

import pytest

from conftest import SOURCE_DIR
from test_pd import P, PROMPTS, ROUTER, TRANSFER_S, Worker, completion, read_sse_completion

sys.path.insert(0, str(SOURCE_DIR / "bench"))
from netns import Hosts  # noqa: E402

LONG = PROMPTS[1] + " " + PROMPTS[0] + " " + PROMPTS[3]


@pytest.fixture(scope="module")
def hosts():
    if not ROUTER.exists():  # the same set-up as test_pd (scripts/setup.sh)
        pytest.skip("vllm-router is not installed in .venv (scripts/setup.sh)")
    with Hosts(3) as hs:
        yield hs


def stream_params(prefill):
    return {"do_remote_prefill": True, "remote_stream_host": prefill.addr,
            "remote_stream_port": 8100}


def test_streamed_prefill_matches_a_single_server(hosts):
    # A small prefill chunk for the prefill worker: the long prompt runs in
    # several chunks and only the final one streams layer by layer.
    prefill = Worker(hosts[0], "prefill", extra=["--kv-transfer-host", hosts[0].addr,
                                                 "--kv-transfer-port", "8100",
                                                 "--prefill-chunk", "64"])
    decode = Worker(hosts[1], "decode")
    both = Worker(None, "both")
    try:
        n_stream = 0
        for prompt in (PROMPTS[0], PROMPTS[3], LONG):
            for salt in (None, "tenant-s"):
                kw = {"cache_salt": salt} if salt else {}
                ref = both.post("/v1/completions", completion(prompt, **kw)).json()
                r = decode.post("/v1/completions",
                                completion(prompt, kv_transfer_params=stream_params(prefill), **kw))
                assert r.status_code == 200, r.text
                got = r.json()
                assert got["choices"][0]["text"] == ref["choices"][0]["text"], prompt[:40]
                for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
                    assert got["usage"][k] == ref["usage"][k], k
                n = ref["usage"]["prompt_tokens"]
                cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert (n - 1) // P * P - 1 <= cached <= (n - 1) // P * P and cached > 0
                n_stream += 1
        # Chat and an SSE response through the streamed prefill.
        chat = {"model": "kvstack", "messages": [{"role": "user", "content": PROMPTS[1]}],
                "max_tokens": 10, "temperature": 0}
        ref = both.post("/v1/chat/completions", chat).json()
        got = decode.post("/v1/chat/completions",
                          chat | {"kv_transfer_params": stream_params(prefill)}).json()
        assert got["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
        r = decode.post("/v1/completions",
                        completion(PROMPTS[3], stream=True, stream_options={"include_usage": True},
                                   kv_transfer_params=stream_params(prefill) | {}),
                        stream=True)
        assert r.status_code == 200
        text, usage = read_sse_completion(r)
        ref = both.post("/v1/completions", completion(PROMPTS[3])).json()
        assert text == ref["choices"][0]["text"]
        assert usage["completion_tokens"] == ref["usage"]["completion_tokens"]
        n_stream += 2
        # A prompt without a full block: a clear 400, nothing started.
        r = decode.post("/v1/completions", completion("Hi", kv_transfer_params=stream_params(prefill)))
        assert r.status_code == 400 and "longer than one block" in r.text, r.text
        pst, dst = prefill.assert_clean(), decode.assert_clean()
        ptr, dtr = pst["transfer"], dst["transfer"]
        assert ptr["streams"] == ptr["streams_ok"] == n_stream
        assert ptr["leases_completed"] == ptr["leases_created"] == n_stream
        assert dtr["stream_pulls"] == dtr["pulls_ok"] == n_stream and dtr["pulls_failed"] == 0
        L = len(ptr["prefill_layer_seconds"])
        assert len(dtr["last_layer_get_seconds"]) == L > 0
        assert dtr["blocks_pulled"] > 0
    finally:
        for w in (prefill, decode, both):
            w.stop()


def test_prefill_killed_mid_stream_leaves_nothing_held(hosts):
    # The decode worker stalls 1.5 s after reading layer 0 of the stream.
    stall = Worker(hosts[1], "decode", port=8001, env={"KVSTACK_TEST_PULL_STALL_MS": "1500"})
    victim = Worker(hosts[2], "prefill", extra=["--kv-transfer-host", hosts[2].addr,
                                                "--kv-transfer-port", "8100"])
    try:
        result = {}

        def request():
            t0 = time.time()
            result["r"] = stall.post("/v1/completions",
                                     completion(LONG, kv_transfer_params=stream_params(victim)))
            result["t"] = time.time() - t0

        th = threading.Thread(target=request)
        th.start()
        deadline = time.time() + 20  # until the stream has started
        while victim.stats()["transfer"]["streams"] == 0 and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)
        victim.stop(signal.SIGKILL)
        th.join(30)
        assert not th.is_alive()
        r = result["r"]
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "kv_transfer_failed"
        assert result["t"] < 1.5 + TRANSFER_S + 5
        tr = stall.assert_clean()["transfer"]
        assert tr["stream_pulls"] == tr["pulls_failed"] == 1 and tr["pulls_ok"] == 0
        # Nobody listening: a clear error within the transfer timeout.
        t0 = time.time()
        r = stall.post("/v1/completions", completion(LONG, kv_transfer_params=stream_params(victim)))
        assert r.status_code == 502 and r.json()["error"]["code"] == "kv_transfer_failed", r.text
        assert time.time() - t0 < TRANSFER_S + 3
        stall.assert_clean()
    finally:
        victim.stop(signal.SIGKILL)
        stall.stop()


def test_decode_worker_killed_mid_stream_prefill_releases_everything(hosts):
    prefill = Worker(hosts[2], "prefill", extra=["--kv-transfer-host", hosts[2].addr,
                                                 "--kv-transfer-port", "8100"])
    victim = Worker(hosts[1], "decode", port=8002, env={"KVSTACK_TEST_PULL_STALL_MS": "1500"})
    dec = None
    try:
        th = threading.Thread(target=lambda: _post_quietly(victim, LONG, prefill))
        th.start()
        deadline = time.time() + 20
        while prefill.stats()["transfer"]["streams"] == 0 and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        victim.stop(signal.SIGKILL)
        th.join(30)
        # The prefill worker's stream ends on the lost connection (or its
        # lease's pull): no block, reference or lease left.
        tr = prefill.assert_clean(timeout=TRANSFER_S + 5)["transfer"]
        assert tr["streams"] == 1 and tr["streams_ok"] + tr["leases_cancelled"] >= 1
        assert tr["leases_completed"] == 0
        # It still streams correctly to another decode worker.
        dec = Worker(hosts[0], "decode", port=8003)
        both = Worker(None, "both")
        try:
            ref = both.post("/v1/completions", completion(LONG)).json()
        finally:
            both.stop()
        r = dec.post("/v1/completions", completion(LONG, kv_transfer_params=stream_params(prefill)))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
        prefill.assert_clean()
        dec.assert_clean()
    finally:
        for w in (prefill, victim, dec):
            if w is not None:
                w.stop(signal.SIGKILL)


def _post_quietly(worker, prompt, prefill):
    try:
        worker.post("/v1/completions", completion(prompt, kv_transfer_params=stream_params(prefill)))
    except Exception:  # noqa: BLE001 - the worker is killed under the request
        pass


def test_concurrent_streams_of_one_prompt_both_verify(hosts):
    """Two decode workers stream the same prompt at once: the prefill worker
    runs two prefills of it, publishes one copy, and the other stream's
    blocks are offered at the published copy's addresses, which that decode
    worker reads again (stream_rereads; how often depends on timing). Both
    answers equal one server's; every lease completes; nothing is held."""
    prefill = Worker(hosts[0], "prefill", extra=["--kv-transfer-host", hosts[0].addr,
                                                 "--kv-transfer-port", "8100"])
    decs = [Worker(hosts[1], "decode", port=8004), Worker(hosts[2], "decode", port=8005)]
    both = Worker(None, "both")
    try:
        for i in range(3):
            prompt = LONG + f" variant {i}"
            ref = both.post("/v1/completions", completion(prompt)).json()["choices"][0]["text"]
            out = {}

            def go(k):
                out[k] = decs[k].post("/v1/completions",
                                      completion(prompt, kv_transfer_params=stream_params(prefill)))

            ts = [threading.Thread(target=go, args=(k,)) for k in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(60)
            for k in range(2):
                assert out[k].status_code == 200, out[k].text
                assert out[k].json()["choices"][0]["text"] == ref, (i, k)
        tr = prefill.assert_clean()["transfer"]
        assert tr["streams_ok"] == tr["leases_completed"] == tr["leases_created"] == 6
        rereads = 0
        for d in decs:
            dt = d.assert_clean()["transfer"]
            assert dt["pulls_ok"] == dt["stream_pulls"] == 3
            rereads += dt["stream_rereads"]
        print("blocks read again:", rereads)
    finally:
        for w in (prefill, *decs, both):
            w.stop()
