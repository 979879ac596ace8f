"""Agent-like multi-turn conversations: from turn 2 on the server prefills only the new tokens
(reported as `usage.prompt_tokens_details.cached_tokens`), outputs equal a cold server's, and the
same holds after a restart with the same --kv-disk-dir."""
import json
import os
import signal
import tempfile
import urllib.request

import openai

from conftest import API_KEY, MODEL, start_server, stop_server

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]

USER_TURNS = ["List the files in src.", "Open the main one.", "What does it do?", "Suggest a fix.", "Thanks, summarise."]


def tokenize(srv, messages, thinking):
    req = urllib.request.Request(
        srv.url("/tokenize"),
        data=json.dumps({"messages": messages, "tools": TOOLS, "chat_template_kwargs": {"thinking": thinking}}).encode(),
        headers={"content-type": "application/json", "authorization": "Bearer " + API_KEY})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["tokens"]


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def converse(srv, thinking, turns=USER_TURNS):
    """Runs the conversation; returns per turn (message dict, usage, prompt ids)."""
    c = openai.OpenAI(base_url=srv.url("/v1"), api_key=API_KEY, max_retries=0, timeout=300)
    messages = [{"role": "system", "content": "You are a coding agent."}]
    out = []
    for i, u in enumerate(turns):
        messages.append({"role": "user", "content": u})
        ids = tokenize(srv, messages, thinking)
        r = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=12, temperature=0,
                                      extra_body={"chat_template_kwargs": {"thinking": thinking}})
        m = r.choices[0].message
        out.append(({"content": m.content, "reasoning": getattr(m, "reasoning_content", None),
                     "tool_calls": [(t.function.name, t.function.arguments) for t in (m.tool_calls or [])]},
                    r.usage, ids))
        messages.append({"role": "assistant", "content": m.content or ""})
        if i == 1:
            # A tool call round trip in the history, as an agent would send it.
            messages.append({"role": "assistant", "content": "", "tool_calls": [{
                "id": "call_9", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": "src/main.rs"})}}]})
            messages.append({"role": "tool", "tool_call_id": "call_9", "content": "fn main() { println!(\"hi\"); }"})
    return out


def check_warm(turns):
    for k in range(1, len(turns)):
        _, usage, ids = turns[k]
        new = len(ids) - max(lcp(ids, turns[j][2]) for j in range(k))
        cached = usage.prompt_tokens_details.cached_tokens
        prev_completion = turns[k - 1][1].completion_tokens
        prefilled = usage.prompt_tokens - cached
        assert usage.prompt_tokens == len(ids)
        # Only new tokens are prefilled (the previous completion, when the model's own tokens
        # re-encode identically, may be reused too).
        print("turn", k, "prompt", len(ids), "new", new, "prefilled", prefilled, "cached", cached)
        assert new - prev_completion <= prefilled <= new, (k, prefilled, new, cached)


def test_multi_turn_prefills_only_new_tokens_and_matches_cold(model_dir):
    disk = tempfile.mkdtemp(prefix="dsv4-kv-")
    cold = start_server(model_dir, ["--prefix-cache-mb", "0"], tag="cold")
    warm = start_server(model_dir, ["--kv-disk-dir", disk], tag="warm")
    try:
        for thinking in (False, True):
            want = converse(cold, thinking)
            got = converse(warm, thinking)
            assert [t[0] for t in got] == [t[0] for t in want]
            assert all(t[1].prompt_tokens_details.cached_tokens == 0 for t in want)
            check_warm(got)
        m = warm.metrics()
        assert m["dsv4_prefix_cache_hits_total"] >= 8
        assert m["dsv4_prefix_cache_tokens_reused_total"] > 0
    finally:
        stop_server(cold)
        stop_server(warm, signal.SIGINT)  # graceful: snapshots go to disk
    assert any(f.endswith(".dsv4kv") for f in os.listdir(disk))
    # After a restart with the same directory, a new conversation that resends the old one
    # starts from the disk snapshots.
    again = start_server(model_dir, ["--kv-disk-dir", disk], tag="restart")
    cold = start_server(model_dir, ["--prefix-cache-mb", "0"], tag="cold2")
    try:
        got = converse(again, True, USER_TURNS[:2])
        want = converse(cold, True, USER_TURNS[:2])
        assert [t[0] for t in got] == [t[0] for t in want]
        first = got[0][1]
        # The very first request after the restart already reuses the earlier run's prefix.
        assert first.prompt_tokens_details.cached_tokens > 0
        assert again.metrics()["dsv4_kv_disk_files"] >= 1
    finally:
        stop_server(again)
        stop_server(cold)
