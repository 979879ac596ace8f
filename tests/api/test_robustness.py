"""Hostile input, parallel streams and disconnects against `dsv4 serve`."""
import http.client
import json
import threading
import urllib.parse

import openai
import pytest

from conftest import API_KEY, MODEL


def raw(server, method, path, body, headers=None, auth=True):
    u = urllib.parse.urlparse(server.base)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    h = {"content-type": "application/json"}
    if auth:
        h["authorization"] = "Bearer " + API_KEY
    h.update(headers or {})
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def hostile_requests():
    chat, comp, msgs, resp = "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"
    ok_chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ok_msgs = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    cases = []
    for path in (chat, comp, msgs, resp):
        cases += [(path, b"{bad json"), (path, b""), (path, b"[]"), (path, b"null"), (path, b"\xff\xfe\x00"),
                  (path, b'"string"'), (path, b"{" * 5000), (path, json.dumps({"model": 7}).encode())]
    wrong = [("messages", "hi"), ("messages", [{"role": "wizard", "content": "x"}]), ("messages", []),
             ("messages", [{"content": "x"}]), ("messages", [{"role": "user", "content": 5}]),
             ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", "ten"), ("temperature", "hot"),
             ("temperature", -1), ("top_p", 0), ("top_p", 7), ("model", "gpt-9"), ("stream", "yes"),
             ("n", 99), ("seed", "x"), ("stop", 5), ("tools", "none"),
             ("tools", [{"type": "function", "function": {"name": 5}}]),
             ("tools", [{"type": "function", "function": {"name": "f", "parameters": "nope"}}]),
             ("messages", [{"role": "user", "content": "x" * 20000}] * 2),
             ("messages", [{"role": "tool", "content": "x"}])]
    for k, v in wrong:
        cases.append((chat, json.dumps({**ok_chat, k: v}).encode()))
    wrong_m = [("max_tokens", 0), ("max_tokens", None), ("messages", []), ("messages", [{"role": "system", "content": "x"}]),
               ("messages", [{"role": "user", "content": [{"type": "image", "source": {}}]}]),
               ("model", "claude-nope"), ("temperature", "x"), ("tools", [{"name": "f"}]),
               ("tools", [{"name": 3, "input_schema": {}}]), ("system", 5), ("thinking", "on"),
               ("messages", [{"role": "user", "content": [{"type": "mystery"}]}])]
    for k, v in wrong_m:
        body = {**ok_msgs, k: v}
        if v is None:
            del body[k]
        cases.append((msgs, json.dumps(body).encode()))
    cases += [(comp, json.dumps({"model": MODEL, "prompt": p, "max_tokens": 2}).encode())
              for p in [None, 5, [], [[1]], {"a": 1}, [999999999]]]
    cases += [(resp, json.dumps({"model": MODEL, "input": i, "max_output_tokens": 2}).encode())
              for i in [None, 5, [], [{"type": "mystery"}], [{"role": "user", "content": 7}]]]
    cases.append((chat, json.dumps({**ok_chat, "messages": [{"role": "user", "content": "x" * 2_000_000}]}).encode()))
    return cases


def test_hostile_requests_get_4xx_and_server_keeps_serving(server):
    cases = hostile_requests()
    n = 0
    while n < 200:
        for path, body in cases:
            status, data = raw(server, "POST", path, body)
            assert 400 <= status < 500, (path, body[:200], status, data[:300])
            err = json.loads(data)
            if path == "/v1/messages":
                assert err["type"] == "error" and err["error"]["message"], err
            else:
                assert err["error"]["message"], err
            n += 1
    # Wrong key, unknown route, wrong method.
    assert raw(server, "GET", "/v1/models", None, auth=False)[0] == 401
    assert raw(server, "POST", "/v1/messages", b"{}", headers={"authorization": "Bearer no"})[0] == 401
    assert raw(server, "GET", "/v1/nothing", None)[0] == 404
    assert raw(server, "GET", "/v1/chat/completions", None)[0] in (404, 405)
    # Still serving.
    c = openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.choices[0].message.role == "assistant"


def run_streams(server, prompts, params):
    c = openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=300)
    out = [None] * len(prompts)

    def one(i):
        s = c.completions.create(model=MODEL, prompt=prompts[i], max_tokens=10, stream=True, **params[i])
        out[i] = "".join(ch.choices[0].text for ch in s if ch.choices)

    return out, one


def test_parallel_streams_equal_sequential_runs(server):
    prompts = [f"Request number {i}: " + "word " * (i % 5) for i in range(16)]
    params = [dict(temperature=0) if i % 2 == 0 else dict(temperature=0.9, top_p=0.9, seed=100 + i)
              for i in range(16)]
    seq, one = run_streams(server, prompts, params)
    for i in range(16):
        one(i)
    sequential = list(seq)
    par, one = run_streams(server, prompts, params)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert par == sequential


def test_disconnect_mid_stream_frees_the_sequence(server):
    import time
    base = server.metrics()
    u = urllib.parse.urlparse(server.base)
    for _ in range(3):
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        body = json.dumps({"model": MODEL, "prompt": "tell me a long story", "max_tokens": 3000, "stream": True})
        c.request("POST", "/v1/completions", body=body,
                  headers={"content-type": "application/json", "authorization": "Bearer " + API_KEY})
        r = c.getresponse()
        assert r.status == 200
        r.fp.readline()  # first event arrives: the sequence is running
        c.sock.close()
        c.close()
    for _ in range(300):
        m = server.metrics()
        if m["dsv4_running_sequences"] == base["dsv4_running_sequences"] == 0 and m["dsv4_queue_depth"] == 0:
            break
        time.sleep(0.1)
    m = server.metrics()
    assert m["dsv4_running_sequences"] == 0, m
    assert m["dsv4_requests_cancelled_total"] >= base["dsv4_requests_cancelled_total"] + 3
