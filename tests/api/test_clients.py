"""Claude Code and Codex CLI (pinned npm releases, installed by tools/test.sh under
target/agent-clients) against `dsv4 serve` on the demo model, with only their base URL and a key
set, plus the full request shape Claude Code sends."""
import json
import os
import shutil
import subprocess
import tempfile
import urllib.request

import pytest

from conftest import API_KEY, MODEL, ROOT, start_server, stop_server

BIN_DIR = os.path.join(ROOT, "target", "agent-clients", "node_modules", ".bin")


def client(name):
    path = os.path.join(BIN_DIR, name)
    if not os.path.exists(path):
        if os.environ.get("DSV4_SKIP_CLIENTS") == "1":
            pytest.skip(f"{name} not installed and DSV4_SKIP_CLIENTS=1")
        raise AssertionError(f"{path} missing: run tools/test.sh (it installs the pinned CLIs)")
    return path


@pytest.fixture(scope="module")
def agent_server(model_dir):
    # The agents' prompts are long (system prompt and tools): a 64K context. A random model
    # almost never samples EOS; an operator default bias towards it (id 1) ends its answers after
    # a few tokens, as a real model's would end (an answer cut at max_tokens is an error to the
    # agents).
    srv = start_server(model_dir, extra=["--max-context", "65536", "--request-defaults",
                                         '{"logit_bias": {"1": 12}}'], tag="agents", strict=False)
    yield srv
    stop_server(srv)


def run(cmd, env, cwd, timeout=300):
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def clean_env(home):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_"))}
    env.update(HOME=home, XDG_CONFIG_HOME=os.path.join(home, ".config"), NO_COLOR="1", CI="1")
    return env


def test_claude_code_print_mode(agent_server):
    claude = client("claude")
    home = tempfile.mkdtemp(prefix="dsv4-claude-")
    env = clean_env(home)
    env.update(ANTHROPIC_BASE_URL=agent_server.base, ANTHROPIC_API_KEY=API_KEY,
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1", DISABLE_TELEMETRY="1")
    code, out, err = run([claude, "-p", "Say hello", "--output-format", "json"], env, home)
    assert code == 0, (out[-2000:], err[-2000:])
    result = json.loads(out.strip().splitlines()[-1])
    assert not result.get("is_error"), result
    assert "API Error" not in out + err
    log = agent_server.log()
    assert "POST /v1/messages status=200" in log


def test_codex_exec(agent_server):
    codex = client("codex")
    home = tempfile.mkdtemp(prefix="dsv4-codex-")
    env = clean_env(home)
    env["DSV4_KEY"] = API_KEY
    provider = (f'model_providers.dsv4={{name="dsv4", base_url="{agent_server.url("/v1")}", '
                f'wire_api="responses", env_key="DSV4_KEY"}}')
    cmd = [codex, "exec", "--skip-git-repo-check", "-c", "model_provider=dsv4", "-c", provider,
           "-c", f"model={MODEL}", "-c", "model_reasoning_effort=high", "Say hello"]
    code, out, err = run(cmd, env, home)
    assert code == 0, (out[-2000:], err[-2000:])
    assert "ERROR" not in err, err[-2000:]
    log = agent_server.log()
    assert "POST /v1/responses status=200" in log


def test_claude_code_request_shape_streams(agent_server):
    """What Claude Code sends: its own model name, 32000 max_tokens, system blocks with
    cache_control, tools, thinking, metadata, and a system message mid-conversation."""
    tools = [{"name": n, "description": f"The {n} tool", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["path"], "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}}
        for n in ("Read", "Write", "Bash", "Grep")]
    body = {
        "model": "claude-sonnet-4-5-20250929", "max_tokens": 32000, "stream": True,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Be helpful.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                         {"type": "text", "text": "list files", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Sure."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                               "input": {"path": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"}]},
            {"role": "system", "content": "The user switched to plan mode."},
            {"role": "user", "content": "and now?"}],
        "tools": tools, "tool_choice": {"type": "auto"}, "metadata": {"user_id": "user_abc"},
        "thinking": {"type": "enabled", "budget_tokens": 31999}, "temperature": 1,
    }
    req = urllib.request.Request(agent_server.url("/v1/messages"), data=json.dumps(body).encode(), headers={
        "content-type": "application/json", "x-api-key": API_KEY, "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200
        events = [json.loads(l[6:]) for l in r.read().decode().splitlines() if l.startswith("data: ")]
    types = [e["type"] for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert events[0]["message"]["model"] == "claude-sonnet-4-5-20250929"
    assert events[0]["message"]["usage"]["input_tokens"] + events[0]["message"]["usage"]["cache_read_input_tokens"] > 50
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["delta"]["stop_reason"] in ("max_tokens", "end_turn", "tool_use")
