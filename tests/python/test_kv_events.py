"""`kvstack serve --kv-events tcp://... --kv-events-replay tcp://...` (issue 21 item 4).

One worker on a network-namespace host (bench/netns.py) with a small KV pool,
so that blocks are both stored and evicted. The stream is decoded with msgspec
structs declared as vLLM declares its KV events (array_like, tagged), so the
format is checked against vLLM's own schema, not against our encoder:
- a subscriber present from the start rebuilds exactly the worker's set of
  cached blocks (/v1/kv/blocks: hash, parent, namespace), with sequence
  numbers 0, 1, 2, ... and no gap;
- a subscriber that starts late (and one that drops messages) catches up
  through the replay socket and rebuilds the same set;
- a block's token ids are the prompt's tokens (`kvstack tokenize`), parents
  chain prompt blocks in order, and a cache_salt puts blocks in another
  namespace (extra_keys);
- /metrics counts published events, replay requests and no drops;
- clearing the cache (POST /flush_cache, also through vllm-router, and
  /reset_prefix_cache) while a request streams: the blocks that request holds
  stay (BlockRemoved for the others), the subscriber's set still equals the
  worker's, the request's greedy text is unchanged, and a clear of an idle
  worker sends AllBlocksCleared and leaves the pool with nothing cached; a
  late subscriber replaying the stream ends in the same state.
"""
import json
import pathlib
import threading
import time
from typing import Optional, Union

import pytest
import requests

from conftest import MODEL, run_kvstack
from router_cluster import ROUTER_BIN, Hosts, Router, Worker

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Optional[Union[int, bytes]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple]]] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[int, bytes]]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


# The same events as maps tagged by "type" (--kv-events-encoding map; vLLM's
# structs without array_like), in the positional batch.
class MapEvent(msgspec.Struct, omit_defaults=True, tag_field="type"):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Optional[Union[int, bytes]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple]]] = None


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[Union[int, bytes]]
    medium: Optional[str]


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Union[MapBlockStored, MapBlockRemoved, MapAllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


DECODERS = {"array": msgspec.msgpack.Decoder(KVEventBatch),
            "map": msgspec.msgpack.Decoder(MapKVEventBatch)}
PUB, REPLAY = 5557, 5558
TOPICS = {"array": b"", "map": b"kvstack-w0"}  # the map run also sets --kv-events-topic
BLOCK = 16


def hexof(h) -> str:
    return h.hex() if isinstance(h, bytes) else f"{h:032x}"


class Mirror:
    """The set of cached blocks, rebuilt from events: hash -> (parent, namespace)."""

    def __init__(self, encoding: str):
        self.decoder = DECODERS[encoding]
        self.topic = TOPICS[encoding]
        self.blocks: dict[str, tuple[str, str]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.seqs: list[int] = []
        self.n_cleared = 0

    def apply(self, seq: int, payload: bytes) -> None:
        if self.seqs and seq <= self.seqs[-1]:
            return  # already applied (live and replayed overlap)
        assert not self.seqs or seq == self.seqs[-1] + 1, f"gap: {self.seqs[-1]} -> {seq}"
        self.seqs.append(seq)
        batch = self.decoder.decode(payload)
        assert batch.data_parallel_rank == 0 and batch.ts > 1e9
        for ev in batch.events:
            if isinstance(ev, (BlockStored, MapBlockStored)):
                assert len(ev.block_hashes) == 1 and ev.block_size == BLOCK
                assert ev.medium == "CPU" and ev.lora_id is None and ev.lora_name is None
                assert len(ev.token_ids) == BLOCK and len(ev.extra_keys) == 1
                h = hexof(ev.block_hashes[0])
                parent = "0" * 32 if ev.parent_block_hash is None else hexof(ev.parent_block_hash)
                assert parent == "0" * 32 or parent in self.blocks, "parent stored after its child"
                assert h not in self.blocks, "stored twice"
                self.blocks[h] = (parent, ev.extra_keys[0][0])
                self.tokens[h] = list(ev.token_ids)
            elif isinstance(ev, (BlockRemoved, MapBlockRemoved)):
                for b in ev.block_hashes:
                    assert self.blocks.pop(hexof(b), None) is not None, "removed an unknown block"
            else:
                assert isinstance(ev, (AllBlocksCleared, MapAllBlocksCleared))
                self.blocks.clear()
                self.n_cleared += 1


def drain(sock, mirror: Mirror, quiet: float = 0.5, skip=()) -> None:
    """Applies messages until none arrives for `quiet` seconds; seqs in `skip` are dropped."""
    while sock.poll(int(quiet * 1000)):
        topic, seq, payload = sock.recv_multipart()
        assert topic == mirror.topic
        s = int.from_bytes(seq, "big")
        if s in skip or (mirror.seqs and s != mirror.seqs[-1] + 1):
            continue  # lost; a subscriber that sees a gap waits for a replay
        mirror.apply(s, payload)


def replay(ctx, addr: str, start: int, mirror: Mirror) -> int:
    """vLLM's replay protocol; returns the number of batches received."""
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://{addr}:{REPLAY}")
    s.send_multipart([b"", start.to_bytes(8, "big")])
    n = 0
    try:
        while True:
            assert s.poll(10000), "replay: no answer"
            empty, seq, payload = s.recv_multipart()
            assert empty == b""
            v = int.from_bytes(seq, "big", signed=True)
            if v == -1:
                assert payload == b""
                return n
            mirror.apply(v, payload)
            n += 1
    finally:
        s.close(linger=0)


def worker_blocks(w: Worker) -> dict[str, tuple[str, str]]:
    blocks = requests.get(w.url + "/v1/kv/blocks", timeout=30).json()["blocks"]
    return {b["hash"]: (b["parent"], b["namespace"]) for b in blocks}


def metric(w: Worker, name: str) -> float:
    for line in requests.get(w.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def traffic(w: Worker, prompts, salt=None) -> None:
    for p in prompts:
        body = {"model": "kvstack", "prompt": p, "max_tokens": 4, "temperature": 0}
        if salt:
            body["cache_salt"] = salt
        r = requests.post(w.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text


PROMPTS = [f"Story {i}: " + " ".join(["once upon a time there was a small village by the sea"] * 6)
           + f" and then number {i} happened." for i in range(10)]


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_events_rebuild_the_cached_blocks_live_late_and_after_drops(encoding):
    with Hosts(1) as hosts:
        h = hosts[0]
        with Worker(h, "--kv-cache-tokens", 512, "--kv-events", f"tcp://{h.addr}:{PUB}",
                    "--kv-events-replay", f"tcp://{h.addr}:{REPLAY}",
                    "--kv-events-encoding", encoding,
                    *(["--kv-events-topic", TOPICS[encoding].decode()] if TOPICS[encoding] else [])
                    ) as w:
            ctx = zmq.Context()
            live = ctx.socket(zmq.SUB)
            live.setsockopt(zmq.SUBSCRIBE, b"")
            live.connect(f"tcp://{h.addr}:{PUB}")
            dropping = ctx.socket(zmq.SUB)
            dropping.setsockopt(zmq.SUBSCRIBE, b"")
            dropping.connect(f"tcp://{h.addr}:{PUB}")
            time.sleep(0.5)  # PUB/SUB joins are asynchronous
            live_m, drop_m = Mirror(encoding), Mirror(encoding)
            if True:  # noqa: SIM108 (one block: the live subscriber's checks)
                traffic(w, PROMPTS)  # 512 tokens hold ~3 prompts: evictions
                traffic(w, PROMPTS[:2], salt="tenant-a")
                drain(live, live_m)
                want = worker_blocks(w)
                assert want and live_m.blocks == want
                assert live_m.seqs == list(range(len(live_m.seqs)))
                assert metric(w, "kvstack:kv_events_dropped_total") == 0
                n_published = metric(w, "kvstack:kv_events_published_total")
                assert n_published == sum(1 for _ in live_m.seqs) or n_published > len(want)
                assert n_published > len(want), "no block was evicted"

                # Namespaces: the salted prompts' blocks sit in their own namespace.
                assert len({ns for _, ns in live_m.blocks.values()}) == 2

                # Token ids: the chain of the last prompt is its tokenization.
                toks = json.loads(run_kvstack("tokenize", "-m", MODEL, "-p", PROMPTS[-1]).stdout)
                by_parent = {}
                for hsh, (parent, ns) in live_m.blocks.items():
                    by_parent.setdefault((parent, ns), []).append(hsh)
                chain, parent = [], "0" * 32
                default_ns = {ns for hsh, (p, ns) in live_m.blocks.items()
                              if live_m.tokens[hsh] == toks[:BLOCK]}
                assert len(default_ns) == 1
                ns = default_ns.pop()
                for j in range(len(toks) // BLOCK):
                    nxt = [c for c in by_parent.get((parent, ns), [])
                           if live_m.tokens[c] == toks[j * BLOCK:(j + 1) * BLOCK]]
                    if not nxt:
                        break
                    chain.append(nxt[0])
                    parent = nxt[0]
                assert len(chain) >= 3, "the last prompt's blocks are not a chain of its tokens"

                # A subscriber that lost messages 3..5 (and so ignores the rest).
                drain(dropping, drop_m, skip=set(range(3, 6)))
            # The dropping mirror holds seqs 0..2 only; replay the rest.
            late_m = Mirror(encoding)
            assert replay(ctx, h.addr, 0, late_m) == len(live_m.seqs)
            assert late_m.blocks == worker_blocks(w)
            assert drop_m.seqs == [0, 1, 2]
            replay(ctx, h.addr, 3, drop_m)
            assert drop_m.blocks == worker_blocks(w)
            # Later traffic goes on from the replayed state.
            late_sub = ctx.socket(zmq.SUB)
            late_sub.setsockopt(zmq.SUBSCRIBE, b"")
            late_sub.connect(f"tcp://{h.addr}:{PUB}")
            time.sleep(0.5)
            traffic(w, PROMPTS[:3])
            drain(late_sub, late_m)
            drain(live, live_m)
            assert late_m.blocks == live_m.blocks == worker_blocks(w)
            assert metric(w, "kvstack:kv_event_replay_requests_total") == 2
            assert metric(w, "kvstack:kv_events_dropped_total") == 0
            for s in (live, dropping, late_sub):
                s.close(linger=0)
            ctx.term()


def pool_stats(w: Worker) -> dict:
    return w.kv_stats()["pool"]


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_cache_clear_keeps_running_requests_and_events_follow(encoding):
    if not pathlib.Path(ROUTER_BIN).exists():
        pytest.skip("vllm-router is not installed in .venv (scripts/setup.sh)")
    with Hosts(1) as hosts:
        h = hosts[0]
        with Worker(h, "--kv-events", f"tcp://{h.addr}:{PUB}", "--kv-events-encoding", encoding,
                    "--kv-events-replay", f"tcp://{h.addr}:{REPLAY}",
                    *(["--kv-events-topic", TOPICS[encoding].decode()] if TOPICS[encoding] else [])
                    ) as w, Router(h, [w.url], "round_robin") as router:
            ctx = zmq.Context()
            live = ctx.socket(zmq.SUB)
            live.setsockopt(zmq.SUBSCRIBE, b"")
            live.connect(f"tcp://{h.addr}:{PUB}")
            time.sleep(0.5)
            m = Mirror(encoding)
            long_prompt = PROMPTS[0]
            body = {"model": "kvstack", "prompt": long_prompt, "max_tokens": 48, "temperature": 0,
                    "ignore_eos": True}
            want = requests.post(w.url + "/v1/completions", json=body, timeout=120).json()
            traffic(w, PROMPTS[1:4])
            drain(live, m)
            assert m.blocks == worker_blocks(w) and len(m.blocks) > 10

            # Through vllm-router (POST /flush_cache to every worker): idle, so all goes.
            r = requests.post(router.url + "/flush_cache", timeout=30)
            assert r.status_code == 200, r.text
            drain(live, m)
            assert m.n_cleared == 1 and m.blocks == {} and worker_blocks(w) == {}
            ps = pool_stats(w)
            assert ps["blocks_cached"] == 0 and ps["blocks_used"] == 0
            assert ps["blocks_free"] == ps["blocks_total"]

            # A clear while a request streams: its blocks stay, the others go.
            traffic(w, PROMPTS[4:6])
            drain(live, m)
            n_other = len(m.blocks)
            got, clears = [], []

            def stream():
                with requests.post(w.url + "/v1/completions", json={**body, "stream": True},
                                   stream=True, timeout=120) as s:
                    for line in s.iter_lines():
                        if line.startswith(b"data: {"):
                            for ch in json.loads(line[6:]).get("choices", []):
                                got.append(ch.get("text") or "")
                                if len(got) == 8:  # mid-stream: the prompt's blocks are held
                                    clears.append(requests.post(
                                        w.url + "/reset_prefix_cache", timeout=30).json())

            t = threading.Thread(target=stream)
            t.start()
            t.join(120)
            assert not t.is_alive() and len(clears) == 1
            c = clears[0]
            assert c["status"] == "ok" and c["prefix_cache"] is True
            assert c["kept_blocks"] >= len(long_prompt.split()) // BLOCK  # the request's prompt
            assert c["freed_blocks"] >= n_other and not c["all_cleared"]
            assert "".join(got) == want["choices"][0]["text"], "a clear corrupted a running request"
            drain(live, m)
            assert m.n_cleared == 1  # that clear sent BlockRemoved events, not AllBlocksCleared
            assert m.blocks == worker_blocks(w) and len(m.blocks) >= c["kept_blocks"]
            ps = pool_stats(w)
            assert ps["blocks_used"] == 0 and ps["blocks_cached"] == len(m.blocks)
            late = Mirror(encoding)  # a late subscriber replays through both clears
            assert replay(ctx, h.addr, 0, late) == len(m.seqs)
            assert late.blocks == m.blocks and late.n_cleared == 1

            # Idle again: a direct clear empties it (AllBlocksCleared), twice is fine.
            for _ in range(2):
                c = requests.post(w.url + "/flush_cache", timeout=30).json()
                assert c["all_cleared"] and c["kept_blocks"] == 0
            drain(live, m)
            assert m.n_cleared == 3 and m.blocks == {} and worker_blocks(w) == {}
            replay(ctx, h.addr, late.seqs[-1] + 1, late)
            assert late.blocks == {} and late.n_cleared == 3 and late.seqs == m.seqs
            assert pool_stats(w)["blocks_free"] == pool_stats(w)["blocks_total"]
            assert requests.get(w.url + "/flush_cache", timeout=30).status_code in (404, 405)
            live.close(linger=0)
            ctx.term()


def test_cache_clear_needs_the_key_when_one_is_set():
    with Hosts(1) as hosts:
        with Worker(hosts[0], "--api-key", "user-k", "--admin-api-key", "admin-k") as w:
            for auth in ({}, {"Authorization": "Bearer user-k"}):
                r = requests.post(w.url + "/flush_cache", headers=auth, timeout=30)
                assert r.status_code == 403 and "admin key" in r.json()["error"]["message"]
            r = requests.post(w.url + "/flush_cache", headers={"Authorization": "Bearer admin-k"},
                              timeout=30)
            assert r.status_code == 200 and r.json()["all_cleared"]


def test_bad_event_options_are_refused(tmp_path):
    from conftest import KVSTACK_BIN
    import subprocess

    def serve(*args):
        return subprocess.run([KVSTACK_BIN, "serve", "-m", MODEL, "--port", "0", *args],
                              capture_output=True, text=True, timeout=120)

    p = serve("--kv-events-replay", "tcp://127.0.0.1:5999")
    assert p.returncode != 0 and "need --kv-events tcp://" in p.stderr
    p = serve("--kv-events", "tcp://127.0.0.1:5999", "--kv-events-encoding", "json")
    assert p.returncode != 0 and "--kv-events-encoding: 'json'" in p.stderr
    p = serve("--kv-events", "tcp://256.1.1.1:notaport")
    assert p.returncode != 0 and "--kv-events tcp://256.1.1.1:notaport" in p.stderr
