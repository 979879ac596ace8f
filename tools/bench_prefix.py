#!/usr/bin/env python3
"""Time to first token, cold vs warm (prefix cache), for long prompts against `dsv4 serve` on
loopback. Standard library only; bounded (a few requests per length).

  python3 tools/bench_prefix.py --spawn target/release/dsv4 --model /tmp/tiny --lengths 8192,32768
"""
import argparse
import http.client
import json
import random
import socket
import subprocess
import time
import urllib.parse
import urllib.request


def ttft(url, prompt_ids):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=3600)
    body = json.dumps({"prompt": prompt_ids, "max_tokens": 2, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    first, cached = None, None
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            cached = ev["usage"]["prompt_tokens_details"]["cached_tokens"]
        elif first is None and ev["choices"]:
            first = time.perf_counter() - t0
    c.close()
    return first, cached


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spawn", required=True)
    ap.add_argument("--model")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--extra", default="", help="more `dsv4 serve` arguments, space-separated")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [a.spawn, "serve", "--port", str(port), "--backend", a.backend,
           "--max-context", str(max(lengths) + a.new_tokens + 16), "--token-budget", "2048"]
    if a.model:
        cmd += ["--model", a.model]
    cmd += a.extra.split()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(3000):
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        rng = random.Random(0)
        for n in lengths:
            base = [rng.randrange(1000, 100000) for _ in range(n)]
            cold, c0 = ttft(url, base)
            turn2 = base + [rng.randrange(1000, 100000) for _ in range(a.new_tokens)]
            warm, c1 = ttft(url, turn2)
            print(json.dumps({"prompt_tokens": n, "new_tokens": a.new_tokens, "cold_ttft_s": round(cold, 3),
                              "cold_cached": c0, "warm_ttft_s": round(warm, 4), "warm_cached": c1,
                              "speedup": round(cold / warm, 1)}), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
