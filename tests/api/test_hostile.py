"""A hostile-client suite against `dsv4 serve` on the demo model, loopback only and bounded in
count and time: thousands of malformed requests, a disconnect storm, slow-loris connections,
huge prompts under an RSS bound, kill -9 during snapshot writes, a forged snapshot, bad
checkpoints and signals. After the abuse a valid request still works and greedy output equals a
cold server's."""
import http.client
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import urllib.parse

import pytest

from conftest import API_KEY, BIN, MODEL, start_server, stop_server

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3, 5, 8,"]


def conn(srv, timeout=30):
    u = urllib.parse.urlparse(srv.base)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)


def call(c, method, path, body=None, headers=None):
    h = {"content-type": "application/json", "authorization": "Bearer " + API_KEY}
    h.update(headers or {})
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    return r.status, r.read(), r.getheader("retry-after")


def greedy(srv, prompts=PROMPTS):
    c = conn(srv, 120)
    out = []
    for p in prompts:
        st, data, _ = call(c, "POST", "/v1/completions",
                           json.dumps({"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0}))
        assert st == 200, data[:300]
        out.append(json.loads(data)["choices"][0]["text"])
    c.close()
    return out


def health_latency(srv):
    t = time.time()
    c = conn(srv, 30)
    c.request("GET", "/health")
    r = c.getresponse()
    r.read()
    c.close()
    return r.status, time.time() - t


def peak_rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture(scope="module")
def cold(model_dir):
    srv = start_server(model_dir, ["--prefix-cache-mb", "0"], tag="hostile-cold")
    want = greedy(srv)
    stop_server(srv)
    return want


@pytest.fixture(scope="module")
def target(model_dir):
    srv = start_server(model_dir, ["--max-body-mb", "32", "--max-waiting", "64"], tag="hostile")
    yield srv
    stop_server(srv)


# ---- 1. malformed requests ---------------------------------------------------------------

BASES = {
    "/v1/chat/completions": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": MODEL, "max_tokens": 2, "prompt": "hi"},
    "/v1/messages": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": MODEL, "max_output_tokens": 2, "input": "hi"},
    "/tokenize": {"prompt": "hi"},
}
WRONG = [None, True, -1, 0, 1e308, -1e308, 2 ** 70, "", "x", "\u0000\ud7ff", [], [None], {}, {"a": {}},
         "<｜User｜>", [1, "a"], 1e-40, "9" * 400]
FIELDS = ["model", "max_tokens", "messages", "prompt", "input", "temperature", "top_p", "top_k", "stop", "stream",
          "seed", "tools", "tool_choice", "logprobs", "top_logprobs", "n", "system", "stop_token_ids",
          "min_p", "thinking", "reasoning_effort", "chat_template_kwargs", "parse_special_tokens",
          "max_output_tokens", "response_format", "stream_options"]


def mutations(rng, n):
    paths = list(BASES)
    out = []
    while len(out) < n:
        path = rng.choice(paths)
        body = json.loads(json.dumps(BASES[path]))
        kind = rng.randrange(7)
        if kind == 0:  # a field of the wrong type
            body[rng.choice(FIELDS)] = rng.choice(WRONG)
            raw = json.dumps(body).encode()
        elif kind == 1:  # a required field missing
            body.pop(rng.choice(list(body)), None)
            raw = json.dumps(body).encode()
        elif kind == 2:  # truncated JSON
            raw = json.dumps(body).encode()
            raw = raw[:rng.randrange(len(raw))]
        elif kind == 3:  # flipped bytes
            raw = bytearray(json.dumps(body).encode())
            for _ in range(rng.randrange(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            raw = bytes(raw)
        elif kind == 4:  # broken messages
            m = rng.choice([{"role": "tool", "content": "x"}, {"role": 5}, {"content": None}, "str", [],
                            {"role": "user", "content": [{"type": "image_url"}]},
                            {"role": "assistant", "tool_calls": [{"function": {"name": "", "arguments": "{"}}]},
                            {"role": "user", "content": [{"type": "text"}]}])
            body["messages"] = [m] * rng.randrange(1, 3)
            raw = json.dumps(body).encode()
        elif kind == 5:  # deep nesting or many stops
            raw = (b"[" * rng.randrange(1000, 50000)) if rng.random() < 0.5 else json.dumps(
                {**body, "stop": ["s" * rng.randrange(1, 3000)] * rng.randrange(60, 400)}).encode()
        else:  # not JSON at all
            raw = rng.choice([b"", b"\xff\xfe\xfd", b"null", b"[]", b"\"s\"", b"{}", b"{\"a\":1}" * 3,
                              "💥".encode() * 100])
        out.append((path, raw))
    return out


def check_error(path, status, data):
    assert status < 500 and status != 0, (path, status, data[:300])
    if status >= 400:
        # An error body never shows internals. (A 2xx body is the model's text, which may hold
        # any of these strings: a sampled completion of 4,091 tokens once held one.)
        text = data.decode("utf-8", "replace")
        for leak in ("panicked", "/src/", "RUST_BACKTRACE", "/home/", "/work/"):
            assert leak not in text, (path, text[:300])
        err = json.loads(data)
        msg = err["error"]["message"]
        assert msg and isinstance(msg, str)


def test_2000_malformed_requests_get_4xx_in_the_api_format(target, cold):
    cases = mutations(random.Random(14), 2900)
    errors = []
    counts = {}

    def worker(chunk):
        c = conn(target)
        for path, raw in chunk:
            try:
                status, data, _ = call(c, "POST", path, raw)
                check_error(path, status, data)
                counts[status // 100] = counts.get(status // 100, 0) + 1
            except (http.client.HTTPException, OSError):
                c.close()
                c = conn(target)
            except AssertionError as e:
                errors.append(e)
        c.close()

    threads = [threading.Thread(target=worker, args=(cases[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert counts.get(4, 0) >= 2000, counts
    assert greedy(target) == cold


def test_tiny_temperature_is_greedy_not_nan(target, cold):
    c = conn(target)
    for t in (1e-40, 1e-45, 1e-30):
        st, data, _ = call(c, "POST", "/v1/completions",
                           json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": t}))
        assert st == 200, data
        assert json.loads(data)["choices"][0]["text"] == cold[0]


# ---- 2. disconnect storm -----------------------------------------------------------------

def test_disconnect_storm_of_100_streams(target, cold):
    rng = random.Random(7)
    u = urllib.parse.urlparse(target.base)

    def one(i):
        s = socket.create_connection((u.hostname, u.port), timeout=30)
        body = json.dumps({"model": MODEL, "prompt": f"story {i}", "max_tokens": 400, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                  b"authorization: Bearer " + API_KEY.encode() + b"\r\ncontent-length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        # Cut at a random point: before the answer, mid-headers, after a few events.
        want = rng.choice([0, 10, 200, 2000])
        got = 0
        while got < want:
            d = s.recv(want - got)
            if not d:
                break
            got += len(d)
        if rng.random() < 0.5:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
        s.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _ in range(600):
        m = target.metrics()
        if m["dsv4_running_sequences"] == 0 and m["dsv4_queue_depth"] == 0:
            break
        time.sleep(0.1)
    assert m["dsv4_running_sequences"] == 0 and m["dsv4_queue_depth"] == 0, m
    assert health_latency(target)[0] == 200
    assert greedy(target) == cold


# ---- 3. huge prompts -----------------------------------------------------------------------

def test_huge_prompts_are_refused_within_an_rss_bound(target):
    base = peak_rss_mb(target.proc.pid)
    big = "lorem ipsum dolor sit amet " * 400_000  # ~10.8 MB: refused before tokenising
    under = "lorem ipsum dolor sit amet " * 18_000  # ~490 KB: under the byte limit, tokenised, too long
    results = []

    def send(kind):
        c = conn(target, 120)
        if kind == "under":
            body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": under}]}
            path = "/v1/chat/completions"
        elif kind == "chat":
            body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": big}]}
            path = "/v1/chat/completions"
        else:
            body = {"model": MODEL, "max_tokens": 2, "prompt": big}
            path = "/v1/completions"
        results.append(call(c, "POST", path, json.dumps(body))[:2])
        c.close()

    threads = [threading.Thread(target=send, args=(k,)) for k in ("chat", "completion", "chat", "under", "under")]
    t0 = time.time()
    for t in threads:
        t.start()
    lat = [health_latency(target)[1] for _ in range(5)]
    for t in threads:
        t.join()
    assert all(st == 400 for st, _ in results), results
    assert all(b"context" in d for _, d in results), [d[:200] for _, d in results]
    assert max(lat) < 2.0, lat
    assert time.time() - t0 < 30
    grew = peak_rss_mb(target.proc.pid) - base
    assert grew < 600, f"peak RSS grew by {grew:.0f} MB"


# ---- 4. slow loris and the connection cap --------------------------------------------------

def test_slow_loris_is_cut_off_and_the_server_answers(model_dir):
    srv = start_server(model_dir, ["--max-connections", "16", "--header-timeout-secs", "1",
                                   "--body-timeout-secs", "1"], tag="loris")
    u = urllib.parse.urlparse(srv.base)
    try:
        socks = []
        for _ in range(40):
            s = socket.create_connection((u.hostname, u.port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nx-a: ")
            socks.append(s)
        # Trickle a byte now and then: the header timeout is for the whole head.
        for _ in range(3):
            for s in socks:
                try:
                    s.sendall(b"a")
                except OSError:
                    pass
            time.sleep(0.3)
        # Within a couple of seconds every slow connection is closed by the server...
        deadline = time.time() + 5
        for s in socks:
            s.settimeout(max(0.1, deadline - time.time()))
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
            s.close()
        assert time.time() < deadline, "slow connections were held"
        # ...and the server answers normally.
        st, lat = health_latency(srv)
        assert st == 200 and lat < 1.0
        # A body that never completes gets a 408.
        s = socket.create_connection((u.hostname, u.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer " + API_KEY.encode()
                  + b"\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{")
        assert s.recv(100).startswith(b"HTTP/1.1 408")
        s.close()
    finally:
        stop_server(srv)


# ---- 5. kill -9 during snapshot writes, FIFOs, forged snapshots -----------------------------

MAGIC = b"DSV4KVC\0"


def fnv1a(b):
    h = 0xcbf29ce484222325
    for x in b:
        h = ((h ^ x) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def long_prompt(i):
    return " ".join(f"w{(i * 7919 + k * 104729) % 5000}" for k in range(700))


def test_kill9_during_snapshot_writes_then_a_clean_restart(model_dir, cold):
    disk = tempfile.mkdtemp(prefix="dsv4-kv9-")
    rng = random.Random(9)
    for i in range(5):
        srv = start_server(model_dir, ["--kv-disk-dir", disk, "--kv-snapshot-interval", "16"], tag=f"kill9-{i}")

        def go(i=i):
            try:
                c = conn(srv, 60)
                call(c, "POST", "/v1/completions",
                     json.dumps({"model": MODEL, "prompt": long_prompt(i), "max_tokens": 4}))
            except (OSError, http.client.HTTPException):
                pass

        t = threading.Thread(target=go)
        t.start()
        time.sleep(rng.uniform(0.05, 0.6))
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait()
        t.join()
    assert [f for f in os.listdir(disk) if f.endswith(".dsv4kv") or f.startswith(".tmp-")], "nothing was written"
    os.mkfifo(os.path.join(disk, "trap.dsv4kv"))  # would hang a naive open()
    srv = start_server(model_dir, ["--kv-disk-dir", disk], tag="kill9-restart")
    try:
        assert not [f for f in os.listdir(disk) if f.startswith(".tmp-")]
        assert greedy(srv) == cold
        c = conn(srv, 60)
        st, _, _ = call(c, "POST", "/v1/completions",
                        json.dumps({"model": MODEL, "prompt": long_prompt(0), "max_tokens": 4}))
        assert st == 200
    finally:
        stop_server(srv)


def test_sigterm_writes_snapshots_and_a_forged_one_is_refused(model_dir, cold):
    disk = tempfile.mkdtemp(prefix="dsv4-kvf-")
    srv = start_server(model_dir, ["--kv-disk-dir", disk], tag="forge-a")
    p = PROMPTS[0] + " and the capital of Italy is"
    base = greedy(srv, [p])
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=60) == 0
    files = [f for f in os.listdir(disk) if f.endswith(".dsv4kv")]
    assert files, "SIGTERM wrote no snapshot"
    # Forge: a snapshot's state filed under one token more (right checksum, wrong state).
    src = max((os.path.join(disk, f) for f in files), key=os.path.getsize)
    b = open(src, "rb").read()
    assert b[:8] == MAGIC
    n = struct.unpack_from("<Q", b, 20)[0]
    toks = list(struct.unpack_from(f"<{n}I", b, 28))
    rest = b[28 + 4 * n:-8]
    forged_toks = toks + [toks[-1]]
    body = b[:20] + struct.pack("<Q", n + 1) + struct.pack(f"<{n + 1}I", *forged_toks) + rest
    for f in files:
        os.remove(os.path.join(disk, f))
    forged = os.path.join(disk, "forged.dsv4kv")
    open(forged, "wb").write(body + struct.pack("<Q", fnv1a(body)))
    srv = start_server(model_dir, ["--kv-disk-dir", disk], tag="forge-b")
    try:
        # A prompt that starts with the forged tokens: the lookup finds it, the check refuses it.
        c = conn(srv, 60)
        st, data, _ = call(c, "POST", "/v1/completions",
                           json.dumps({"model": MODEL, "prompt": forged_toks + [5, 6, 7], "max_tokens": 4,
                                       "temperature": 0}))
        assert st == 200, data
        assert json.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert srv.metrics()["dsv4_kv_disk_rejected_total"] >= 1
        assert not os.path.exists(forged), "refused snapshot not deleted"
        assert health_latency(srv)[0] == 200
        assert greedy(srv, [p]) == base
        assert greedy(srv) == cold
    finally:
        stop_server(srv)


# ---- 6. startup refusals -------------------------------------------------------------------

def run_serve(args, env=None, timeout=60):
    p = subprocess.run([BIN, "serve", "--port", "0", *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    return p.returncode, p.stderr


def test_empty_api_keys_are_refused(model_dir):
    code, err = run_serve(["--model", model_dir, "--api-key", ""])
    assert code != 0 and "API key is empty" in err, err[-500:]
    code, err = run_serve(["--model", model_dir], env={"DSV4_API_KEY": ""})
    assert code != 0 and "API key is empty" in err, err[-500:]


def bad_copy(model_dir, name):
    d = os.path.join(tempfile.mkdtemp(prefix="dsv4-bad-"), name)
    shutil.copytree(model_dir, d)
    return d


def edit_config(d, **kw):
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    cfg.update(kw)
    json.dump(cfg, open(path, "w"))
    return cfg


def test_bad_checkpoints_are_refused(model_dir):
    d = bad_copy(model_dir, "eos")
    edit_config(d, eos_token_id=10_000_000)
    code, err = run_serve(["--model", d])
    assert code != 0 and "eos_token_id" in err, err[-500:]
    d = bad_copy(model_dir, "pos")
    edit_config(d, max_position_embeddings=0)
    code, err = run_serve(["--model", d])
    assert code != 0 and "max_position_embeddings" in err, err[-500:]
    # NaN in a weight: the first norm of the stack.
    d = bad_copy(model_dir, "nan")
    st = os.path.join(d, "model.safetensors")
    raw = bytearray(open(st, "rb").read())
    hlen = struct.unpack_from("<Q", raw, 0)[0]
    header = json.loads(raw[8:8 + hlen])
    name = "model.layers.0.input_layernorm.weight"
    a, b = header[name]["data_offsets"]
    nan = {"BF16": b"\xc0\x7f", "F32": b"\x00\x00\xc0\x7f"}[header[name]["dtype"]]
    raw[8 + hlen + a:8 + hlen + b] = nan * ((b - a) // len(nan))
    open(st, "wb").write(raw)
    code, err = run_serve(["--model", d])
    assert code != 0 and "non-finite" in err, err[-500:]


def test_missing_tokenizer_is_said(model_dir):
    d = bad_copy(model_dir, "notok")
    os.remove(os.path.join(d, "tokenizer.json"))
    srv = start_server(d, tag="notok")
    try:
        assert greedy(srv, PROMPTS[:1])
    finally:
        stop_server(srv)
    log = open(os.path.join(os.path.dirname(d), [f for f in os.listdir(os.path.dirname(d))
                                                  if f.startswith("notok-")][0])).read()
    assert "no tokenizer.json" in log, log[-500:]


# ---- 7. after everything -------------------------------------------------------------------

def test_after_the_abuse_greedy_output_equals_a_cold_servers(target, cold):
    assert health_latency(target)[0] == 200
    assert greedy(target) == cold
