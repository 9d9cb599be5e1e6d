#!/usr/bin/env python3
"""KV transfer bandwidth and T_ready of `kvstack serve --role prefill|decode` (issue 21).

Two test hosts (bench/netns.py network namespaces, loopback fallback), one
prefill and one decode worker, UCX transports from --tls (UCX_TLS). Each round
prefills a fresh prompt of about --tokens tokens on the prefill worker (as
vllm-router's prefill request does: max_tokens 1, do_remote_decode), then sends
the decode request with the returned kv_transfer_params (max_tokens 1), and
reads the decode worker's transfer figures from /v1/kv/stats: bytes read, gets,
get time (first get issued .. flush complete) and the whole pull (offer +
worker/endpoint set-up + gets + record checks + publish). Then ucx_perftest on
the same pair of hosts, same transports, message size = the pull's mean get
size: ucp_get (what the pull uses) and ucp_am_bw (active messages).

Per-layer figures (spec section 3): t_p = prefill time / L, t_x = get time / L.
The transfer here moves the whole prefix after the prefill (no layer-wise
push), so T_ready = t_prefill + t_pull, to compare with L (t_p + t_x); the
layer-wise formula t_p + t_x + (L - 1) max(t_p, t_x) is printed as what
streaming would give. --by-layer measures t_p and t_x per layer instead
(the prefill worker's forward layer times, the decode worker's layer-major
gets; see by_layer()) and skips ucx_perftest. --by-layer --stream runs the
layer-wise streaming flow instead (the decode request names the prefill
worker's control endpoint; layer l is read as soon as the prefill's forward
reports it): T_ready measured = the decode worker's stream pull (STREAM sent
.. every record verified and published), against the same figures.

  .venv/bin/python bench/pd_transfer_bench.py --tokens 1536 --rounds 3 --tls tcp
  .venv/bin/python bench/pd_transfer_bench.py --by-layer --tokens 1536 --rounds 5 --tls tcp
  .venv/bin/python bench/pd_transfer_bench.py --by-layer --stream --tokens 256 --rounds 5 --tls tcp
"""
import argparse
import os
import pathlib
import random
import re
import statistics
import subprocess
import sys
import time

import requests

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from netns import Hosts  # noqa: E402

ROOT = HERE.parent


def words(n, seed):
    rng = random.Random(seed)
    vocab = ["river", "stone", "cloud", "market", "engine", "garden", "signal", "paper", "window",
             "forest", "copper", "lantern", "harbor", "violet", "summer", "ladder", "orbit"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def start(host, role, args, extra=()):
    cmd = [args.bin, "serve", "-m", args.model, "--host", host.addr, "--port", "8000",
           "--threads", str(args.threads), "--kv-cache-mem", args.kv_mem, "--role", role,
           "--kv-transfer-timeout", "60", *extra]
    env = dict(os.environ, UCX_TLS=args.tls)
    p = host.popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://{host.addr}:8000"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if requests.get(base + "/health", timeout=2).status_code == 200:
                return p, base
        except requests.RequestException:
            pass
        time.sleep(0.1)
    p.kill()
    raise SystemExit(f"{role} worker did not start")


# Larger TCP segments than UCX's defaults (8 KiB / 64 KiB): a second
# ucx_perftest reference per round (the workers get them only when they are
# in this script's environment, which both workers inherit).
BIG_TCP_SEGMENTS = {"UCX_TCP_TX_SEG_SIZE": "64K", "UCX_TCP_RX_SEG_SIZE": "256K"}


def perftest(hosts, test, size, iters, tls, err_handling, extra_env=None):
    """ucx_perftest between the two hosts; err_handling: endpoints with peer error
    handling (-e), as the pull creates them; extra_env: more UCX_* settings."""
    env = {"UCX_TLS": tls, "PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(extra_env or {})}
    port = str(14000 + os.getpid() % 1000)
    e = ["-e"] if err_handling else []
    srv = hosts[0].popen(["ucx_perftest", "-p", port, *e], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    out = hosts[1].run(["ucx_perftest", hosts[0].addr, "-p", port, "-t", test, "-s", str(size),
                        "-n", str(iters), "-w", str(max(2, iters // 10)), *e],
                       env=env, capture_output=True, text=True, timeout=120)
    srv.wait(30)
    m = re.search(r"^Final:\s+\d+\s+\S+\s+\S+\s+\S+\s+(\S+)\s+(\S+)", out.stdout, re.M)
    if not m:
        raise SystemExit(f"ucx_perftest {test} failed:\n{out.stdout}\n{out.stderr}")
    return float(m.group(2)) * 2**20  # "overall" bandwidth column, MB/s (ucx: 2^20 bytes)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(ROOT / "build" / "src" / "cli" / "kvstack"))
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--tokens", type=int, default=1536, help="prompt words per round (about tokens)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-mem", default="256M")
    ap.add_argument("--tls", default="tcp", help="UCX_TLS for both workers and ucx_perftest")
    ap.add_argument("--by-layer", action="store_true",
                    help="decode worker with --kv-pull-by-layer: per-layer t_p (the prefill "
                         "worker's forward layer times) and t_x (layer-major gets), T_ready "
                         "against the layer-wise formula; no ucx_perftest")
    ap.add_argument("--stream", action="store_true",
                    help="with --by-layer: the layer-wise streaming flow (decode-initiated, "
                         "kv_transfer_params remote_stream_host/port)")
    args = ap.parse_args()
    if args.by_layer:
        return by_layer(args)

    with Hosts(2) as hosts:
        if hosts.fallback_reason:
            print("note:", hosts.fallback_reason)
        pre, pbase = start(hosts[0], "prefill", args, ["--kv-transfer-host", hosts[0].addr])
        dec, dbase = start(hosts[1], "decode", args)
        try:
            n_layers = None
            rows = []
            for r in range(args.rounds + 1):  # round 0 warms both workers up
                prompt = words(args.tokens, seed=1000 + r)
                body = {"model": "kvstack", "prompt": prompt, "max_tokens": 1, "temperature": 0}
                t0 = time.time()
                pr = requests.post(pbase + "/v1/completions", timeout=600, json=dict(
                    body, kv_transfer_params={"do_remote_decode": True}, min_tokens=1)).json()
                t_prefill = time.time() - t0
                kp = pr["kv_transfer_params"]
                t1 = time.time()
                dr = requests.post(dbase + "/v1/completions", timeout=600,
                                   json=dict(body, kv_transfer_params=kp))
                t_decode_req = time.time() - t1
                assert dr.status_code == 200, dr.text
                st = requests.get(dbase + "/v1/kv/stats", timeout=30).json()
                tr = st["transfer"]
                if n_layers is None:
                    m = re.search(r";L=(\d+);", kp["kv_format"])
                    n_layers = int(m.group(1)) if m else 1
                if r == 0:
                    continue
                # Alternated with the pull (a shared machine): ucx_perftest
                # ucp_get at the pull's mean get size, right after it.
                mean_get = int(tr["last_read_bytes"] / max(1, tr["last_gets"]))
                iters = max(10, min(400, int(3e8 // max(1, mean_get))))
                ref = perftest(hosts, "ucp_get", mean_get, iters, args.tls, True)
                ref_seg = perftest(hosts, "ucp_get", mean_get, iters, args.tls, True,
                                   BIG_TCP_SEGMENTS)
                bw_r = tr["last_read_bytes"] / tr["last_get_seconds"]
                rows.append(dict(tokens=pr["usage"]["prompt_tokens"], t_prefill=t_prefill,
                                 pull=tr["last_pull_seconds"], read=tr["last_read_seconds"],
                                 get=tr["last_get_seconds"], wireup=tr["last_wireup_seconds"],
                                 bytes=tr["last_read_bytes"],
                                 gets=tr["last_gets"], decode_req=t_decode_req, bw=bw_r,
                                 ref=ref, ratio=bw_r / ref, ref_seg=ref_seg,
                                 ratio_seg=bw_r / ref_seg))
                print(f"round {r}: pull {bw_r / 2**20:.0f} MiB/s, ucp_get -e {ref / 2**20:.0f} MiB/s "
                      f"({bw_r / ref * 100:.0f}%), ucp_get -e with 64K/256K TCP segments "
                      f"{ref_seg / 2**20:.0f} MiB/s ({bw_r / ref_seg * 100:.0f}%)", flush=True)
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            bw = med["bw"]
            mean_get = int(med["bytes"] / max(1, med["gets"]))
            iters = max(10, min(400, int(3e8 // max(1, mean_get))))
            bw_get = med["ref"]
            bw_get_noerr = perftest(hosts, "ucp_get", mean_get, iters, args.tls, False)
            bw_am = perftest(hosts, "ucp_am_bw", mean_get, iters, args.tls, True)
            L = n_layers
            t_p, t_x = med["t_prefill"] / L, med["get"] / L
            print(f"UCX_TLS={args.tls} hosts={'loopback' if hosts.fallback_reason else 'netns'} "
                  f"rounds={args.rounds} (medians), L={L}")
            print(f"prompt tokens {med['tokens']:.0f}, KV bytes pulled {med['bytes'] / 2**20:.1f} MiB "
                  f"in {med['gets']:.0f} gets (mean {mean_get / 2**20:.2f} MiB)")
            print(f"pull: gets {med['get'] * 1e3:.1f} ms ({bw / 2**20:.0f} MiB/s), endpoint "
                  f"connection {med['wireup'] * 1e3:.1f} ms, read incl. UCX worker/endpoint set-up {med['read'] * 1e3:.1f} ms, whole pull (offer, read, "
                  f"checks, publish) {med['pull'] * 1e3:.1f} ms; decode request (pull + tail + "
                  f"1 token) {med['decode_req'] * 1e3:.1f} ms")
            print(f"ucx_perftest same hosts, {mean_get} B messages, peer error handling (-e, as "
                  f"the pull, alternated): ucp_get {bw_get / 2**20:.0f} MiB/s -> pull/perftest "
                  f"median of ratios {med['ratio'] * 100:.0f}%; once after: ucp_am_bw {bw_am / 2**20:.0f} MiB/s; without -e: "
                  f"ucp_get {bw_get_noerr / 2**20:.0f} MiB/s -> {bw / bw_get_noerr * 100:.0f}%; "
                  f"with larger TCP segments ({', '.join(f'{k}={v}' for k, v in BIG_TCP_SEGMENTS.items())}, "
                  f"alternated): ucp_get -e {med['ref_seg'] / 2**20:.0f} MiB/s -> median of ratios "
                  f"{med['ratio_seg'] * 100:.0f}%")
            print(f"prefill (HTTP, max_tokens 1) {med['t_prefill'] * 1e3:.0f} ms: t_p {t_p * 1e3:.2f} "
                  f"ms/layer, t_x {t_x * 1e3:.2f} ms/layer")
            tr_meas = med["t_prefill"] + med["pull"]
            print(f"T_ready measured (prefill then whole-prefix pull) {tr_meas * 1e3:.0f} ms; "
                  f"L (t_p + t_x) = {L * (t_p + t_x) * 1e3:.0f} ms; layer-wise formula "
                  f"t_p + t_x + (L-1) max = {(t_p + t_x + (L - 1) * max(t_p, t_x)) * 1e3:.0f} ms "
                  f"(not built: streaming would save {(tr_meas - (t_p + t_x + (L - 1) * max(t_p, t_x))) * 1e3:.0f} ms)")
        finally:
            for p in (pre, dec):
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()


def by_layer(args):
    """Per-layer t_p and t_x measured (spec section 3) and T_ready.

    t_p[l]: seconds the prefill worker's forward spent in layer l over the
    request's prefill steps (/v1/kv/stats transfer.prefill_layer_seconds,
    difference around the request). t_x[l]: the decode worker's get time of
    layer l's bytes of every pulled block (layer-major reads,
    transfer.last_layer_get_seconds). T_ready measured = the HTTP prefill
    (max_tokens 1) + the whole pull (offer, reads, checks, publish), the
    transfer starting after the prefill. Against: the whole-prefix figure
    sum t_p + sum t_x, the layer-wise formula t_p + t_x + (L-1) max(t_p, t_x)
    with per-layer medians, and the same pipeline replayed exactly with the
    measured per-layer values (layer l's get starts when layer l is computed
    and layer l-1's get is done)."""
    with Hosts(2) as hosts:
        if hosts.fallback_reason:
            print("note:", hosts.fallback_reason)
        # The whole prompt in one forward step (the formula's premise: layer l
        # of the prefix is complete when the forward finishes layer l; with
        # chunked prefill only the last chunk would overlap the transfer).
        one = str(max(4096, 2 * args.tokens))
        pre, pbase = start(hosts[0], "prefill", args, ["--kv-transfer-host", hosts[0].addr,
                                                       "--prefill-chunk", one,
                                                       "--max-batch-tokens", one,
                                                       "--kv-transfer-port", "8100"])
        dec, dbase = start(hosts[1], "decode", args, [] if args.stream else ["--kv-pull-by-layer"])
        stream = {"do_remote_prefill": True, "remote_stream_host": hosts[0].addr,
                  "remote_stream_port": 8100}
        try:
            rows = []
            for r in range(args.rounds + 1):  # round 0 warms both workers up
                prompt = words(args.tokens, seed=2000 + r)
                body = {"model": "kvstack", "prompt": prompt, "max_tokens": 1, "temperature": 0}
                before = requests.get(pbase + "/v1/kv/stats", timeout=30).json()["transfer"]
                t0 = time.time()
                if args.stream:  # one request: the decode worker starts the prefill
                    dr = requests.post(dbase + "/v1/completions", timeout=600,
                                       json=dict(body, kv_transfer_params=stream))
                    t_prefill = time.time() - t0  # here: the whole decode request
                    pr = dr.json()
                    after = requests.get(pbase + "/v1/kv/stats", timeout=30).json()["transfer"]
                else:
                    pr = requests.post(pbase + "/v1/completions", timeout=600, json=dict(
                        body, kv_transfer_params={"do_remote_decode": True}, min_tokens=1)).json()
                    t_prefill = time.time() - t0
                    after = requests.get(pbase + "/v1/kv/stats", timeout=30).json()["transfer"]
                    dr = requests.post(dbase + "/v1/completions", timeout=600,
                                       json=dict(body, kv_transfer_params=pr["kv_transfer_params"]))
                assert dr.status_code == 200, dr.text
                tr = requests.get(dbase + "/v1/kv/stats", timeout=30).json()["transfer"]
                tp = [a - b for a, b in zip(after["prefill_layer_seconds"],
                                            before["prefill_layer_seconds"])]
                tx = tr["last_layer_get_seconds"]
                assert tx and len(tx) == len(tp), (len(tx), len(tp))
                if r == 0:
                    continue
                L = len(tp)
                # The layer-wise pipeline replayed with the measured values.
                ready = done = 0.0
                for l in range(L):
                    ready += tp[l]
                    done = max(ready, done) + tx[l]
                mp, mx = statistics.median(tp), statistics.median(tx)
                rows.append(dict(tokens=pr["usage"]["prompt_tokens"], L=L, t_prefill=t_prefill,
                                 steps=after["prefill_steps"] - before["prefill_steps"],
                                 sum_tp=sum(tp), sum_tx=sum(tx), tp=mp, tx=mx,
                                 pull=tr["last_pull_seconds"], get=tr["last_get_seconds"],
                                 measured=(tr["last_pull_seconds"] if args.stream
                                           else t_prefill + tr["last_pull_seconds"]),
                                 whole=sum(tp) + sum(tx),
                                 formula=mp + mx + (L - 1) * max(mp, mx),
                                 formula_mean=(sum(tp) + sum(tx)) / L
                                 + (L - 1) * max(sum(tp), sum(tx)) / L, replay=done))
                print(f"round {r}: t_p {mp * 1e3:.2f} ms/layer, t_x {mx * 1e3:.2f} ms/layer, "
                      f"T_ready measured {rows[-1]['measured'] * 1e3:.0f} ms, formula "
                      f"{rows[-1]['formula'] * 1e3:.0f} ms", flush=True)
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print(f"UCX_TLS={args.tls} hosts={'loopback' if hosts.fallback_reason else 'netns'} "
                  f"{'stream ' if args.stream else ''}"
                  f"rounds={args.rounds} (medians), L={med['L']:.0f}, prompt tokens "
                  f"{med['tokens']:.0f}, prefill steps {med['steps']:.0f}")
            print(f"per layer: t_p {med['tp'] * 1e3:.2f} ms, t_x {med['tx'] * 1e3:.2f} ms; "
                  f"sum t_p {med['sum_tp'] * 1e3:.0f} ms (HTTP prefill {med['t_prefill'] * 1e3:.0f} "
                  f"ms), sum t_x {med['sum_tx'] * 1e3:.0f} ms (gets {med['get'] * 1e3:.0f} ms, "
                  f"whole pull {med['pull'] * 1e3:.0f} ms)")
            how = ("the streamed pull: STREAM .. verified" if args.stream
                   else "prefill, then the pull")
            print(f"T_ready measured ({how}) {med['measured'] * 1e3:.0f} ms; "
                  f"whole-prefix sum t_p + sum t_x {med['whole'] * 1e3:.0f} ms "
                  f"({med['measured'] / med['whole'] * 100:.0f}%); layer-wise formula "
                  f"{med['formula'] * 1e3:.0f} ms ({med['measured'] / med['formula'] * 100:.0f}%); "
                  f"with per-layer means {med['formula_mean'] * 1e3:.0f} ms "
                  f"({med['measured'] / med['formula_mean'] * 100:.0f}%); "
                  f"pipeline replayed with the measured per-layer values "
                  f"{med['replay'] * 1e3:.0f} ms ({med['measured'] / med['replay'] * 100:.0f}%)")
        finally:
            for p in (pre, dec):
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()


if __name__ == "__main__":
    main()
