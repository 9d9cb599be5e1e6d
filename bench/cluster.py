#!/usr/bin/env python3
"""N prefill + M decode workers behind vllm-router against N+M colocated
workers on the same cores (issue 21 item 5; spec sections 10 and 11).

PD mode: N `kvstack serve --role prefill` and M `--role decode` workers, each
on its own test host (a network namespace of bench/netns.py, created and
removed by this script; loopback addresses when namespaces cannot be made),
pinned with taskset, behind `vllm-router --vllm-pd-disaggregation` on one
more host (UCX over --tls between the hosts; the clients run in the root
namespace and reach the hosts over the bridge). Colocated mode: N+M `--role both` workers on the
same hosts with the same pins, behind vllm-router in plain mode (--policy).
Worker i (prefill first, then decode) gets the cpu list --pin[i]; a core named
by two workers is shared by them (half a core each), which is how fractional
cores are expressed. Threads per worker = cores in its list.

Workload (seeded, the same for both modes): --requests streaming completions
cycling over the --classes "prompt_words:output_tokens" (default: long prompt
and short output, short prompt and long output, long prompt and long output;
`ignore_eos`), arriving closed-loop from --concurrency clients or as a
Poisson process of --rate requests/s (--arrival). Per request, measured at
the client through the router: TTFT (send to first streamed token: router,
queueing, prefill and, in PD, the KV pull), the first decode gap (first to
second token), TPOT ((last - first) / (tokens - 1)) and inter-token gaps.
Goodput = requests meeting both --slo-ttft and --slo-tpot (count, fraction and
per second of the run). Separately: queueing (each worker's running and
waiting requests, sampled from /get_load every --sample-ms, means and the
waiting maximum by role: a worker admits up to --max-seqs requests at once,
so a backlog shows as running requests sharing the steps), bytes moved,
pulls and transfer time (the decode workers' /v1/kv/stats, this run only), and
TTFT / gap / TPOT / ITL percentiles, overall and per class.

Progress goes to stderr; the tables (markdown) to stdout; --json FILE writes
every figure. Example (2 cores: 1 prefill + 1 decode, one core each, against
2 colocated workers, one core each):

  .venv/bin/python bench/cluster.py --prefill 1 --decode 1 --pin 0 1 --requests 36
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import requests

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from netns import Host, Hosts  # noqa: E402

ROOT = HERE.parent
VOCAB = ["river", "stone", "cloud", "market", "engine", "garden", "signal", "paper", "window",
         "forest", "copper", "lantern", "harbor", "violet", "summer", "ladder", "orbit"]
WORKER_PORT = 8000
ROUTER_PORT = 8100


def log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Proc:
    """A child process in its own session (stopped as a group), output to a log file."""

    def __init__(self, name: str, cmd: list[str], logdir: str, host: Optional[Host] = None,
                 env: Optional[dict] = None):
        self.name = name
        self.log_path = os.path.join(logdir, name.replace(" ", "_") + ".log")
        self._log = open(self.log_path, "w")
        wrapped = host.wrap(cmd) if host else [str(c) for c in cmd]
        self.proc = subprocess.Popen(wrapped, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)

    def tail(self, n: int = 3000) -> str:
        try:
            return pathlib.Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_http(self, url: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if requests.get(url, timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise SystemExit(f"{self.name} did not come up at {url}:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        self._log.close()


@dataclass
class Worker:
    role: str  # prefill, decode, both
    host: Host
    pin: list[int]
    proc: Proc
    url: str


def start_worker(args, host: Host, role: str, pin: list[int], idx: int, logdir: str) -> Worker:
    cmd = ["taskset", "-c", ",".join(map(str, pin)), args.bin, "serve", "-m", args.model,
           "--host", host.addr, "--port", str(WORKER_PORT), "--threads", str(len(pin)),
           "--kv-cache-mem", args.kv_mem, "--role", role, *args.worker_arg]
    if role == "prefill":
        cmd += ["--kv-transfer-host", host.addr]
    env = dict(os.environ, UCX_TLS=args.tls)
    proc = Proc(f"{role}{idx} on {host.addr}", cmd, logdir, host, env)
    w = Worker(role, host, pin, proc, f"http://{host.addr}:{WORKER_PORT}")
    return w


def start_router(args, host: Host, workers: list[Worker], pd: bool,
                 logdir: str) -> tuple[Proc, str]:
    """vllm-router on its own test host (port 8100, metrics 8101), in front of `workers`."""
    cmd = [args.router, "--host", host.addr, "--port", str(ROUTER_PORT), "--prometheus-host",
           host.addr, "--prometheus-port", str(ROUTER_PORT + 1)]
    if pd:
        cmd.append("--vllm-pd-disaggregation")
        for w in workers:
            cmd += ["--prefill" if w.role == "prefill" else "--decode", w.url]
    else:
        cmd += ["--policy", args.policy, "--worker-urls", *[w.url for w in workers]]
    cmd += args.router_arg
    proc = Proc("vllm-router " + ("pd" if pd else "plain"), cmd, logdir, host)
    base = f"http://{host.addr}:{ROUTER_PORT}"
    proc.wait_http(base + "/health", 60)
    return proc, base


# ---- workload -------------------------------------------------------------------------------

@dataclass
class Req:
    idx: int
    cls: str
    body: dict
    arrival: float  # seconds after the start (Poisson), 0 for closed loop


def parse_classes(spec: str) -> list[tuple[int, int]]:
    out = []
    for part in spec.split(","):
        try:
            w, t = part.split(":")
            out.append((int(w), int(t)))
        except ValueError:
            raise SystemExit(f"--classes: '{part}' is not prompt_words:output_tokens") from None
        if out[-1][0] < 1 or out[-1][1] < 1:
            raise SystemExit(f"--classes: '{part}' needs positive numbers")
    return out


def workload(args) -> list[Req]:
    rng = random.Random(args.seed)
    classes = parse_classes(args.classes)
    reqs, t = [], 0.0
    for i in range(args.requests):
        words, out = classes[i % len(classes)]
        prompt = f"Request {i}: " + " ".join(rng.choice(VOCAB) for _ in range(words))
        if args.arrival == "poisson":
            t += rng.expovariate(args.rate)
        reqs.append(Req(i, f"{words}:{out}", {
            "model": "kvstack", "prompt": prompt, "max_tokens": out, "temperature": 0,
            "ignore_eos": True, "stream": True}, t if args.arrival == "poisson" else 0.0))
    return reqs


@dataclass
class Result:
    req: Req
    ok: bool = False
    error: str = ""
    t0: float = 0.0
    stamps: list[float] = field(default_factory=list)


def one_request(base: str, r: Req, t0: float) -> Result:
    res = Result(r, t0=t0)
    try:
        with requests.post(base + "/v1/completions", json=r.body, stream=True, timeout=600) as h:
            if h.status_code != 200:
                res.error = f"HTTP {h.status_code}: {h.text[:200]}"
                return res
            done = False
            for line in h.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    done = True
                    break
                ev = json.loads(line[6:])
                if "error" in ev:
                    res.error = str(ev["error"])[:200]
                    return res
                ch = ev.get("choices") or []
                if ch and ch[0].get("text"):
                    res.stamps.append(time.time())
            res.ok = done and bool(res.stamps)
            if not res.ok and not res.error:
                res.error = "stream ended without tokens or [DONE]"
    except (requests.RequestException, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


def drive(base: str, reqs: list[Req], args) -> tuple[list[Result], float]:
    results: list[Optional[Result]] = [None] * len(reqs)
    n_done = [0]
    lock = threading.Lock()

    def finish(i: int, res: Result) -> None:
        results[i] = res
        with lock:
            n_done[0] += 1
            if n_done[0] % max(1, len(reqs) // 6) == 0 or n_done[0] == len(reqs):
                log(f"  {n_done[0]}/{len(reqs)} requests done")

    t_start = time.time()
    threads = []
    if args.arrival == "closed":
        nxt = [0]

        def client():
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= len(reqs):
                    return
                finish(i, one_request(base, reqs[i], time.time()))

        threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
    else:
        for i, r in enumerate(reqs):
            delay = t_start + r.arrival - time.time()
            if delay > 0:
                time.sleep(delay)
            t0 = t_start + r.arrival  # the scheduled arrival: a late thread start counts in TTFT
            th = threading.Thread(target=lambda i=i, r=r, t0=t0: finish(i, one_request(base, r, t0)))
            th.start()
            threads.append(th)
    for t in threads:
        t.join()
    return [r for r in results if r is not None], time.time() - t_start


class QueueSampler:
    """Polls each worker's /get_load (waiting and running requests) every `interval` s."""

    def __init__(self, workers: list[Worker], interval: float):
        self.workers, self.interval = workers, interval
        self.samples: dict[str, list[tuple[int, int]]] = {w.url: [] for w in workers}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        s = requests.Session()
        while not self._stop.is_set():
            for w in self.workers:
                try:
                    load = s.get(w.url + "/get_load", timeout=2).json()[0]
                    self.samples[w.url].append((load["num_waiting_reqs"], load["num_reqs"]))
                except (requests.RequestException, ValueError, KeyError, IndexError):
                    pass
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)

    def by_role(self) -> dict[str, dict]:
        out = {}
        for role in ("prefill", "decode", "both"):
            ws = [w for w in self.workers if w.role == role]
            if not ws:
                continue
            waiting = [x for w in ws for x, _ in self.samples[w.url]]
            running = [y for w in ws for _, y in self.samples[w.url]]
            out[role] = {"waiting_mean": mean(waiting), "waiting_max": max(waiting, default=0),
                         "running_mean": mean(running), "samples": len(waiting)}
        return out


# ---- statistics -----------------------------------------------------------------------------

def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def pct(xs, q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def latency(results: list[Result], args) -> dict:
    ttft, gap, tpot, itl = [], [], [], []
    good = 0
    for r in results:
        if not r.ok:
            continue
        s = r.stamps
        t_first = s[0] - r.t0
        ttft.append(t_first)
        tp = 0.0
        if len(s) > 1:
            gap.append(s[1] - s[0])
            tp = (s[-1] - s[0]) / (len(s) - 1)
            tpot.append(tp)
            itl += [b - a for a, b in zip(s, s[1:])]
        if t_first <= args.slo_ttft and tp <= args.slo_tpot:
            good += 1
    n_ok = sum(r.ok for r in results)
    return {
        "n": len(results), "ok": n_ok, "good": good,
        "ttft_p50": pct(ttft, .5), "ttft_p90": pct(ttft, .9), "ttft_p99": pct(ttft, .99),
        "gap_p50": pct(gap, .5), "gap_p99": pct(gap, .99),
        "tpot_p50": pct(tpot, .5), "tpot_p90": pct(tpot, .9),
        "itl_p50": pct(itl, .5), "itl_p99": pct(itl, .99),
        "output_tokens": sum(len(r.stamps) for r in results if r.ok),
    }


def transfer_stats(workers: list[Worker]) -> dict:
    """Sums of the decode workers' pull counters and the prefill workers' lease counters."""
    keys = ("bytes_pulled", "pulls", "pulls_ok", "pulls_failed", "blocks_pulled", "blocks_local",
            "pull_seconds", "read_seconds", "leases_completed", "leases_expired",
            "leases_cancelled", "leases_open", "layout_conversions")
    tot = {k: 0.0 for k in keys}
    for w in workers:
        if w.role == "both":
            continue
        tr = requests.get(w.url + "/v1/kv/stats", timeout=30).json().get("transfer", {})
        for k in keys:
            tot[k] += tr.get(k, 0)
    return tot


# ---- one mode -------------------------------------------------------------------------------

def run_mode(args, pd: bool, hosts: Hosts, pins: list[list[int]], reqs: list[Req],
             logdir: str) -> dict:
    roles = (["prefill"] * args.prefill + ["decode"] * args.decode) if pd else \
        ["both"] * (args.prefill + args.decode)
    name = (f"PD {args.prefill}P+{args.decode}D" if pd
            else f"colocated {len(roles)}x both ({args.policy})")
    log(f"{name}: starting {len(roles)} workers (pins {pins})")
    workers, router = [], None
    try:
        for i, role in enumerate(roles):
            workers.append(start_worker(args, hosts[i], role, pins[i], i, logdir))
        for w in workers:
            w.proc.wait_http(w.url + "/health", 120)
        router, base = start_router(args, hosts[len(roles)], workers, pd, logdir)
        log(f"{name}: router at {base}; warm-up")
        warm = Req(-1, "warm", {"model": "kvstack", "prompt": "Warm up " + " ".join(VOCAB * 2),
                                "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                "stream": True}, 0.0)
        for w in workers:
            if w.role != "decode":  # a decode worker needs kv_transfer_params: only via the router
                one_request(w.url, warm, time.time())
        for _ in range(len(workers)):
            res = one_request(base, warm, time.time())
            if not res.ok:
                raise SystemExit(f"{name}: warm-up request failed: {res.error}")
        before = transfer_stats(workers)
        log(f"{name}: {len(reqs)} requests ({args.arrival}"
            + (f", {args.rate}/s" if args.arrival == "poisson" else f", {args.concurrency} clients")
            + ")")
        with QueueSampler(workers, args.sample_ms / 1000) as sampler:
            results, wall = drive(base, reqs, args)
        after = transfer_stats(workers)
        moved = {k: after[k] - before[k] for k in after}
        moved["leases_open"] = after["leases_open"]  # a level, not a counter
        failures = [f"#{r.req.idx}: {r.error}" for r in results if not r.ok]
        if failures:
            log(f"{name}: {len(failures)} failed: " + "; ".join(failures[:3]))
        classes = sorted({r.req.cls for r in results}, key=lambda c: [int(x) for x in c.split(":")])
        out = {
            "mode": "pd" if pd else "colocated", "name": name, "wall_s": wall,
            "workers": [{"role": w.role, "host": w.host.addr, "cores": w.pin} for w in workers],
            "latency": latency(results, args),
            "per_class": {c: latency([r for r in results if r.req.cls == c], args) for c in classes},
            "queue": sampler.by_role(), "transfer": moved if pd else None,
            "failures": failures,
            "requests": [{"idx": r.req.idx, "class": r.req.cls, "ok": r.ok, "tokens": len(r.stamps),
                          "ttft": r.stamps[0] - r.t0 if r.stamps else None,
                          "tpot": ((r.stamps[-1] - r.stamps[0]) / (len(r.stamps) - 1)
                                   if len(r.stamps) > 1 else None)} for r in results],
        }
        log(f"{name}: done in {wall:.1f} s, goodput {out['latency']['good']}/{len(results)}")
        return out
    finally:
        if router:
            router.stop()
        for w in workers:
            w.proc.stop()


# ---- report ---------------------------------------------------------------------------------

def ms(x: float) -> str:
    return "-" if x != x else f"{x * 1e3:,.0f}"


def report(runs: list[dict], args) -> str:
    lines = [f"SLOs: TTFT <= {args.slo_ttft} s, TPOT <= {args.slo_tpot * 1e3:.0f} ms; "
             f"{args.requests} requests, classes {args.classes} (prompt words:output tokens), "
             + (f"Poisson {args.rate}/s" if args.arrival == "poisson"
                else f"closed loop, {args.concurrency} clients"), ""]
    lines += ["| mode | workers: cores | wall | goodput (both SLOs) | TTFT p50 / p90 / p99 | "
              "first decode gap p50 / p99 | TPOT p50 / p90 | ITL p50 / p99 | "
              "queue: running mean, waiting mean / max | "
              "bytes moved, pulls | pull time mean (UCX read) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        lat, q, tr = run["latency"], run["queue"], run["transfer"]
        cores = ", ".join(f"{w['role'][0].upper()}{w['cores']}" for w in run["workers"])
        wait = "; ".join(f"{role[0].upper()} {v['running_mean']:.1f}, {v['waiting_mean']:.2f} / "
                         f"{v['waiting_max']}" for role, v in q.items())
        if tr:
            pulls = max(1.0, tr["pulls_ok"])
            moved = f"{tr['bytes_pulled'] / 2**20:,.1f} MiB, {tr['pulls_ok']:.0f}"
            if tr["pulls_failed"]:
                moved += f" (+{tr['pulls_failed']:.0f} failed)"
            pull = f"{ms(tr['pull_seconds'] / pulls)} ({ms(tr['read_seconds'] / pulls)}) ms"
        else:
            moved = pull = "-"
        lines.append(
            f"| {run['name']} | {cores} | {run['wall_s']:.1f} s | {lat['good']}/{lat['n']} "
            f"({lat['good'] / run['wall_s']:.2f}/s; {lat['ok']} ok) | {ms(lat['ttft_p50'])} / "
            f"{ms(lat['ttft_p90'])} / {ms(lat['ttft_p99'])} ms | {ms(lat['gap_p50'])} / "
            f"{ms(lat['gap_p99'])} ms | {ms(lat['tpot_p50'])} / {ms(lat['tpot_p90'])} ms | "
            f"{ms(lat['itl_p50'])} / {ms(lat['itl_p99'])} ms | {wait} | {moved} | {pull} |")
    lines += ["", "| mode | class | goodput | TTFT p50 / p90 | TPOT p50 / p90 |",
              "|---|---|---|---|---|"]
    for run in runs:
        for c, lat in run["per_class"].items():
            lines.append(f"| {run['name']} | {c} | {lat['good']}/{lat['n']} | "
                         f"{ms(lat['ttft_p50'])} / {ms(lat['ttft_p90'])} ms | "
                         f"{ms(lat['tpot_p50'])} / {ms(lat['tpot_p90'])} ms |")
    return "\n".join(lines)


def parse_pins(args) -> list[list[int]]:
    n = args.prefill + args.decode
    if args.pin:
        pins = []
        for p in args.pin:
            try:
                pins.append([int(c) for c in p.split(",")])
            except ValueError:
                raise SystemExit(f"--pin: '{p}' is not a cpu list such as 0 or 0,1") from None
        if len(pins) != n:
            raise SystemExit(f"--pin: {n} workers need {n} cpu lists, got {len(pins)}")
    else:
        avail = sorted(os.sched_getaffinity(0))
        pins = [[avail[i % len(avail)]] for i in range(n)]
    return pins


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(ROOT / "build" / "src" / "cli" / "kvstack"))
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--router", default=str(ROOT / ".venv" / "bin" / "vllm-router"))
    ap.add_argument("--prefill", type=int, default=1, help="N prefill workers (default 1)")
    ap.add_argument("--decode", type=int, default=1, help="M decode workers (default 1)")
    ap.add_argument("--pin", nargs="+", metavar="CPUS",
                    help="one cpu list per worker, prefill workers first (e.g. --pin 0 1 1: "
                         "prefill on core 0, two decode workers sharing core 1); the colocated "
                         "mode uses the same lists. Default: one core each, round robin over "
                         "the cores this process may use")
    ap.add_argument("--mode", choices=["both", "pd", "colo"], default="both",
                    help="which modes to run (default both: colocated, then PD)")
    ap.add_argument("--policy", default="round_robin",
                    help="vllm-router policy of the colocated mode (default round_robin)")
    ap.add_argument("--requests", type=int, default=36)
    ap.add_argument("--classes", default="600:8,40:96,600:96",
                    help="request classes 'prompt_words:output_tokens', comma-separated, cycled")
    ap.add_argument("--arrival", choices=["closed", "poisson"], default="closed")
    ap.add_argument("--concurrency", type=int, default=4, help="clients (closed loop)")
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson)")
    ap.add_argument("--slo-ttft", type=float, default=3.0, help="TTFT objective, s")
    ap.add_argument("--slo-tpot", type=float, default=0.1, help="TPOT objective, s")
    ap.add_argument("--kv-mem", default="192M", help="--kv-cache-mem of every worker")
    ap.add_argument("--tls", default="tcp", help="UCX_TLS of the workers (default tcp)")
    ap.add_argument("--sample-ms", type=float, default=100, help="/get_load polling period")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("--worker-arg", action="append", default=[],
                    help="extra argument for every `kvstack serve` (repeatable)")
    ap.add_argument("--router-arg", action="append", default=[],
                    help="extra argument for vllm-router (repeatable)")
    args = ap.parse_args()
    if args.prefill < 1 or args.decode < 1:
        raise SystemExit("--prefill and --decode must be >= 1")
    if args.requests < 1 or args.concurrency < 1 or args.rate <= 0:
        raise SystemExit("--requests and --concurrency must be >= 1, --rate > 0")
    for path, what in ((args.bin, "--bin"), (args.model, "--model"), (args.router, "--router")):
        if not pathlib.Path(path).exists():
            raise SystemExit(f"{what}: {path} does not exist")
    pins = parse_pins(args)
    reqs = workload(args)
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvstack-cluster-") as logdir, \
            Hosts(args.prefill + args.decode + 1) as hosts:  # the workers', then the router's
        log(hosts.fallback_reason or
            f"{len(hosts)} namespace hosts {[h.addr for h in hosts]}, bridge {hosts.bridge_addr}")
        if args.mode in ("both", "colo"):
            runs.append(run_mode(args, False, hosts, pins, reqs, logdir))
        if args.mode in ("both", "pd"):
            runs.append(run_mode(args, True, hosts, pins, reqs, logdir))
        hosts_note = hosts.fallback_reason or "network namespaces"
    print(report(runs, args), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"args": vars(args), "hosts": hosts_note, "runs": runs}, indent=1, default=str))


if __name__ == "__main__":
    main()
