#!/usr/bin/env python3
"""Bounded load generator for `dsv4 serve` on loopback (standard library only).

Streams /v1/completions requests at several concurrency levels and reports throughput and
time-to-first-token / inter-token latency percentiles. Each level sends a fixed number of
requests and stops; nothing runs unbounded.

  python3 tools/bench_serve.py --spawn target/release/dsv4 --model /tmp/tiny   # starts a server
  python3 tools/bench_serve.py --url http://127.0.0.1:8000                      # an existing one

`--temperature T --top-p P` samples (a seed a request) instead of decoding greedily; either way
each level reports how many outputs differ from the first level's (batch invariance).
"""
import argparse
import http.client
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


def one_request(url, prompt, max_tokens, key, out, index=None, sampling=None):
    """`sampling`: extra request fields (temperature, top_p, seed); greedy without."""
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    req = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
           "stream_options": {"include_usage": True}}
    req.update(sampling or {})
    body = json.dumps(req)
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = "Bearer " + key
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body=body, headers=headers)
    r = c.getresponse()
    if r.status != 200:
        out.append({"error": r.status})
        return
    times, tokens, text = [], 0, ""
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
        elif ev["choices"] and ev["choices"][0]["text"]:
            times.append(time.perf_counter())
            text += ev["choices"][0]["text"]
    c.close()
    end = time.perf_counter()
    out.append({"index": index, "text": text, "ttft": times[0] - t0 if times else end - t0,
                "itl": [b - a for a, b in zip(times, times[1:])], "tokens": tokens, "latency": end - t0})


def engine_times(url, key):
    """The engine's step counters from /metrics: (steps, forward seconds, step seconds, plan
    seconds, snapshot seconds, snapshots, restore seconds)."""
    req = urllib.request.Request(url + "/metrics", headers={"authorization": "Bearer " + key} if key else {})
    try:
        body = urllib.request.urlopen(req, timeout=10).read().decode()
    except OSError:
        return None
    v = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, val = line.partition(" ")
            v[name] = float(val)
    paths = {}
    for name, val in v.items():
        # dsv4_engine_path_<what>_total{path="eager"}: steps, forward seconds, rows, prefill rows.
        if name.startswith("dsv4_engine_path_") and '{path="' in name:
            what, _, label = name[len("dsv4_engine_path_"):].partition('{path="')
            paths.setdefault(label.rstrip('"}'), {})[what.removesuffix("_total")] = val
    keys = ("dsv4_engine_steps_total", "dsv4_engine_forward_seconds_total", "dsv4_engine_step_seconds_total",
            "dsv4_engine_plan_seconds_total", "dsv4_engine_snapshot_seconds_total", "dsv4_engine_snapshots_total",
            "dsv4_engine_restore_seconds_total", "dsv4_engine_snapshot_background_seconds_total")
    return tuple(v.get(k, 0.0) for k in keys) + (paths,)


def run_level(url, conc, n_requests, max_tokens, key, sampling=None):
    results, lock_out = [], []
    prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog " * (1 + i % 3) for i in range(n_requests)]
    queue = list(range(n_requests))
    qlock = threading.Lock()

    def worker():
        while True:
            with qlock:
                if not queue:
                    return
                i = queue.pop()
            # A seed a request: a sampled request draws the same tokens at any level.
            extra = dict(sampling, seed=1000 + i) if sampling else None
            one_request(url, prompts[i], max_tokens, key, results, i, extra)

    e0 = engine_times(url, key)
    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(conc)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    e1 = engine_times(url, key)
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    toks = sum(r["tokens"] for r in ok)
    texts = {r["index"]: r["text"] for r in ok}
    return texts, {"concurrency": conc, "requests": len(results), "errors": len(results) - len(ok),
            "completion_tokens": toks, "wall_s": round(wall, 3), "tokens_per_s": round(toks / wall, 1),
            "requests_per_s": round(len(ok) / wall, 2),
            "ttft_ms": {p: round(pct(ttft, p) * 1e3, 1) for p in (50, 90, 99)},
            "itl_ms": {p: round(pct(itl, p) * 1e3, 2) for p in (50, 90, 99)},
            # Per engine step: the forward's time, the engine step's (plus planning, sampling,
            # emission), and the wall time a step (plus the loop between steps: admission, HTTP).
            "engine_ms_per_step": step_split(e0, e1, wall)}


def step_split(e0, e1, wall):
    if not e0 or not e1 or e1[0] <= e0[0]:
        return None
    n = e1[0] - e0[0]
    per = lambda i: round((e1[i] - e0[i]) / n * 1e3, 3)  # noqa: E731
    # plan and snapshot are parts of step outside forward; restore runs between steps (in wall);
    # snapshot_bg is the snapshots' time off the engine thread (device copies waited for beside
    # the steps), in no step.
    return {"steps": int(n), "forward": per(1), "step": per(2), "wall": round(wall / n * 1e3, 3),
            "plan": per(3), "snapshot": per(4), "snapshots": int(e1[5] - e0[5]), "restore": per(6),
            "snapshot_bg": per(7), "paths": path_split(e0[8], e1[8])}


def path_split(p0, p1):
    """Per way a step ran (eager, recorded, replayed): steps, mean forward ms, mean rows and mean
    prompt rows a step."""
    out = {}
    for path, c1 in sorted(p1.items()):
        c0 = p0.get(path, {})
        d = {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in ("steps", "forward_seconds", "rows", "prefill_rows")}
        if d["steps"] > 0:
            n = d["steps"]
            out[path] = {"steps": int(n), "forward_ms": round(d["forward_seconds"] / n * 1e3, 2),
                         "rows": round(d["rows"] / n, 1), "prefill_rows": round(d["prefill_rows"] / n, 1)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--spawn", help="path of the dsv4 binary: start `dsv4 serve` on a free loopback port")
    ap.add_argument("--model", help="checkpoint for --spawn (default: the built-in demo model)")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--requests-per-level", type=int, default=0, help="default: max(8, 2 x concurrency)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--api-key")
    ap.add_argument("--extra", default="", help="more `dsv4 serve` arguments for --spawn, space-separated")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (with --top-p and a seed a request) instead of greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    a = ap.parse_args()
    sampling = {"temperature": a.temperature, "top_p": a.top_p} if a.temperature > 0 else None
    proc = None
    url = a.url
    if a.spawn:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        levels = [int(x) for x in a.concurrency.split(",")]
        cmd = [a.spawn, "serve", "--port", str(port), "--backend", a.backend, "--max-seqs", str(max(levels)),
               "--max-waiting", "4096"]
        if a.model:
            cmd += ["--model", a.model]
        cmd += a.extra.split()
        # The server's log goes to a file, so a server that exits (a bad flag, a model that does
        # not fit) is reported with its own message instead of a silent wait for /health.
        log = tempfile.NamedTemporaryFile(prefix="dsv4-serve-", suffix=".log", delete=False)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        url = f"http://127.0.0.1:{port}"
        for _ in range(3000):
            if proc.poll() is not None:
                with open(log.name, errors="replace") as f:
                    tail = f.read()[-3000:]
                raise SystemExit(f"dsv4 serve exited with status {proc.returncode} before it was ready "
                                 f"(command: {' '.join(cmd)}):\n{tail}")
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise SystemExit(f"dsv4 serve was not ready after 300 s (log: {log.name})")
    u = urllib.parse.urlparse(url)
    assert u.hostname in ("127.0.0.1", "localhost", "::1"), "loopback only"
    try:
        one_request(url, "warm up", 4, a.api_key, [])
        first = None
        for conc in [int(x) for x in a.concurrency.split(",")]:
            n = a.requests_per_level or max(8, 2 * conc)
            texts, row = run_level(url, conc, n, a.max_tokens, a.api_key, sampling)
            # Batch invariance: the outputs of the same prompts (greedy, or sampled with the same
            # seed) at every concurrency level.
            if first is None:
                first = texts
            row["differs_from_first_level"] = sum(1 for i, t in first.items() if i in texts and texts[i] != t)
            if sampling:
                row["sampling"] = sampling
            print(json.dumps(row), flush=True)
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
