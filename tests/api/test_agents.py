"""What coding agents and the SDKs send (issue 13, points 1, 2 and 4), against `dsv4 serve` on the
random demo model: the text is gibberish, so the tests check protocol, counts and equivalences."""
import json
import urllib.request

import anthropic
import openai
import pytest

from conftest import API_KEY, MODEL, start_server, stop_server


@pytest.fixture(scope="module")
def loose(model_dir):
    """A server that accepts any model name and clamps completions to 24 tokens."""
    srv = start_server(model_dir, extra=["--max-tokens-limit", "24"], tag="loose", strict=False)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def oai(loose):
    return openai.OpenAI(base_url=loose.url("/v1"), api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ant(loose):
    return anthropic.Anthropic(base_url=loose.base, api_key=API_KEY, max_retries=0, timeout=120)


def tokenize(srv, body):
    req = urllib.request.Request(srv.url("/tokenize"), data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", "authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


# --- 1. the clients' own settings -------------------------------------------------------------

def test_any_model_name_is_accepted_and_echoed(oai, ant):
    r = oai.chat.completions.create(model="gpt-5-codex", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.model == "gpt-5-codex"
    m = ant.messages.create(model="claude-sonnet-4-5-20250929", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert m.model == "claude-sonnet-4-5-20250929"
    assert oai.models.retrieve("gpt-5-codex").id == "gpt-5-codex"


def test_strict_model_name_gives_404(server):
    c = openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="claude-x", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("claude-x")
    assert c.models.retrieve(MODEL).id == MODEL


def test_system_messages_anywhere(oai, ant):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "system", "content": "Now be formal."},
            {"role": "user", "content": "again"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")
    m = ant.messages.create(model=MODEL, max_tokens=3, system="Be brief.", messages=msgs[1:])
    assert m.stop_reason in ("end_turn", "max_tokens")
    r = oai.responses.create(model=MODEL, input=msgs, max_output_tokens=3)
    assert r.status in ("completed", "incomplete")


def test_max_tokens_beyond_the_context_is_clamped(oai, ant):
    # The server's context is 4096 and its per-request limit 24: 32000 (Claude Code) is clamped.
    m = ant.messages.create(model=MODEL, max_tokens=32000, messages=[{"role": "user", "content": "hi"}])
    assert m.usage.output_tokens <= 24
    if m.usage.output_tokens == 24:
        assert m.stop_reason == "max_tokens"
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=100000)
    assert r.usage.completion_tokens <= 24
    if r.usage.completion_tokens == 24:
        assert r.choices[0].finish_reason == "length"


def test_max_tokens_clamped_to_the_remaining_context(model_dir):
    srv = start_server(model_dir, extra=["--max-context", "64"], tag="ctx64")
    try:
        c = openai.OpenAI(base_url=srv.url("/v1"), api_key=API_KEY, max_retries=0, timeout=120)
        r = c.completions.create(model=MODEL, prompt="hello there", max_tokens=32000, temperature=0,
                                 extra_body={"logit_bias": {"1": -100}})  # no EOS: runs to the limit
        assert r.usage.prompt_tokens + r.usage.completion_tokens == 64
        assert r.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model=MODEL, prompt="word " * 100, max_tokens=4)
    finally:
        stop_server(srv)


def test_default_max_tokens(model_dir):
    srv = start_server(model_dir, extra=["--default-max-tokens", "5"], tag="dmt")
    try:
        c = openai.OpenAI(base_url=srv.url("/v1"), api_key=API_KEY, max_retries=0, timeout=120)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                      extra_body={"logit_bias": {"1": -100}})
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        r = c.responses.create(model=MODEL, input="hi", extra_body={"logit_bias": {"1": -100}})
        assert r.usage.output_tokens == 5 and r.status == "incomplete"
        assert r.incomplete_details.reason == "max_output_tokens"
        assert "default-max-tokens 5" in srv.log()
    finally:
        stop_server(srv)


# --- 2. API completeness ----------------------------------------------------------------------

def test_count_tokens_matches_the_prompt(loose, ant):
    kw = dict(model=MODEL, system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
              messages=[{"role": "user", "content": "count me"}],
              tools=[{"name": "f", "description": "d", "input_schema": {"type": "object", "properties": {}}}])
    n = ant.messages.count_tokens(**kw).input_tokens
    m = ant.messages.create(max_tokens=2, **kw)
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert n > 20


def test_streaming_usage_equals_non_streaming(ant):
    kw = dict(model=MODEL, max_tokens=6, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "usage check please"}])
    m = ant.messages.create(**kw)
    starts, deltas = [], []
    with ant.messages.stream(**kw) as s:
        for ev in s:
            if ev.type == "message_start":
                starts.append(ev.message.usage)
            elif ev.type == "message_delta":
                deltas.append(ev.usage)
        final = s.get_final_message()
    assert len(starts) == 1 and len(deltas) == 1
    st, d = starts[0], deltas[0]
    # The second request reads the first one's prompt from the prefix cache: the split moves
    # between input and cache read, the sum does not; the stream agrees with itself throughout.
    assert st.input_tokens + st.cache_read_input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert st.input_tokens > 0 or st.cache_read_input_tokens > 0
    assert (d.input_tokens, d.cache_read_input_tokens) == (st.input_tokens, st.cache_read_input_tokens)
    assert d.output_tokens == m.usage.output_tokens == final.usage.output_tokens
    assert [b.model_dump(exclude={"parsed_output"}) for b in final.content] == [b.model_dump() for b in m.content]


@pytest.mark.parametrize("thinking", [False, True])
def test_no_empty_blocks(ant, thinking):
    kw = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    if thinking:
        kw["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    for seed in range(3):
        m = ant.messages.create(**kw, extra_body={"seed": seed, "temperature": 1})
        for b in m.content:
            assert (b.type == "text" and b.text) or (b.type == "thinking" and b.thinking) or b.type == "tool_use", b
        if thinking:
            assert all(b.type == "thinking" for b in m.content)  # the reasoning never ended in 8 tokens
        with ant.messages.stream(**kw, extra_body={"seed": seed, "temperature": 1}) as s:
            final = s.get_final_message()
        assert [b.model_dump(exclude={"parsed_output"}) for b in final.content] == [b.model_dump() for b in m.content]


def test_models_retrieve_in_both_sdks(oai, ant):
    assert oai.models.retrieve(MODEL).id == MODEL
    assert ant.models.retrieve(MODEL).id == MODEL


def test_responses_reasoning_is_its_own_item_in_openais_order(oai):
    kw = dict(model=MODEL, input="think first", max_output_tokens=10, reasoning={"effort": "high"}, temperature=0)
    r = oai.responses.create(**kw)
    assert r.output[0].type == "reasoning" and r.output[0].summary[0].text
    assert r.status == "incomplete" and r.usage.output_tokens == 10
    events = list(oai.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[2:4] == ["response.output_item.added", "response.reasoning_summary_part.added"]
    assert events[2].item.type == "reasoning"
    assert "response.reasoning_summary_text.delta" in types
    assert "response.reasoning_text.delta" not in types
    assert types[-4:] == ["response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.status == "incomplete"
    assert [o.model_dump(exclude={"id"}) for o in final.output] == [o.model_dump(exclude={"id"}) for o in r.output]
    # Without reasoning: a message item, completed unless cut.
    r = oai.responses.create(model=MODEL, input="hi", max_output_tokens=4, temperature=0)
    assert r.output[0].type == "message"
    events = list(oai.responses.create(model=MODEL, input="hi", max_output_tokens=4, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[-1].response.status == r.status
    assert events[-1].response.output_text == r.output_text


def test_previous_response_id_and_store(loose, oai):
    r1 = oai.responses.create(model=MODEL, input="first question", max_output_tokens=4, temperature=0)
    assert oai.responses.retrieve(r1.id).id == r1.id
    r2 = oai.responses.create(model=MODEL, previous_response_id=r1.id, input="second", max_output_tokens=4,
                              temperature=0)
    expect = tokenize(loose, {"messages": [{"role": "user", "content": "first question"},
                                           {"role": "assistant", "content": r1.output_text},
                                           {"role": "user", "content": "second"}]})["count"]
    assert r2.usage.input_tokens == expect
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=MODEL, previous_response_id="resp_nope", input="x", max_output_tokens=2)
    r3 = oai.responses.create(model=MODEL, input="not kept", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r3.id)


def test_n_choices(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=3,
                                    seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1
    chunks = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, n=2, seed=5, stream=True,
                                              stream_options={"include_usage": True}))
    text = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
    assert text[0] == r.choices[0].message.content and text[1] == r.choices[1].message.content
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    c = oai.completions.create(model=MODEL, prompt="abc", max_tokens=4, n=2, seed=1)
    assert [x.index for x in c.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=99)


def single_token(srv, text):
    ids = tokenize(srv, {"prompt": text})["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


def test_logit_bias(loose, oai):
    hello = single_token(loose, " hello")
    r = oai.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=1, logit_bias={str(hello): 100})
    assert r.choices[0].text == " hello" * 4
    base = oai.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=0)
    first = tokenize(loose, {"prompt": base.choices[0].text})["tokens"][0]
    r = oai.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=0, logit_bias={str(first): -100})
    assert r.choices[0].text != base.choices[0].text
    for bad in [{"a": 1}, {str(hello): 1000}, {"99999999": 1}]:
        with pytest.raises(openai.BadRequestError):
            oai.completions.create(model=MODEL, prompt="x", max_tokens=1, logit_bias=bad)


def test_frequency_presence_and_repetition_penalties(loose, oai):
    hello = single_token(loose, " hello")
    kw = dict(model=MODEL, max_tokens=12, temperature=0)
    bias = {str(hello): 10}
    plain = oai.completions.create(prompt="x", logit_bias=bias, **kw).choices[0].text
    assert plain == " hello" * 12
    freq = oai.completions.create(prompt="x", logit_bias=bias, frequency_penalty=2, **kw).choices[0].text
    assert 0 < freq.count(" hello") < 12
    # The repetition penalty also counts the prompt: " hello" in the prompt is discouraged from the start.
    rep = oai.completions.create(prompt="say hello", logit_bias=bias, extra_body={"repetition_penalty": 10}, **kw)
    assert rep.choices[0].text.count(" hello") < 12
    # The presence penalty is flat (2 once the token appeared): a bias of 10 still wins every step.
    pres = oai.completions.create(prompt="x", logit_bias=bias, presence_penalty=2, **kw).choices[0].text
    assert pres == plain
    for k, v in [("presence_penalty", 3), ("frequency_penalty", -2.5)]:
        with pytest.raises(openai.BadRequestError):
            oai.completions.create(prompt="x", **{k: v}, **kw)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(prompt="x", extra_body={"repetition_penalty": 0}, **kw)


def test_echo(oai):
    r = oai.completions.create(model=MODEL, prompt="Echo this", max_tokens=3, temperature=0, echo=True)
    plain = oai.completions.create(model=MODEL, prompt="Echo this", max_tokens=3, temperature=0)
    assert r.choices[0].text == "Echo this" + plain.choices[0].text
    text = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="Echo this", max_tokens=3, temperature=0, echo=True, stream=True) if c.choices)
    assert text == r.choices[0].text
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=1, echo=True, logprobs=1)


# --- 4. operators -----------------------------------------------------------------------------

def test_request_id_log_line_and_http_metrics(loose):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "log me"}], "max_tokens": 3}).encode()
    req = urllib.request.Request(loose.url("/v1/chat/completions"), data=body, headers={
        "content-type": "application/json", "authorization": f"Bearer {API_KEY}", "x-request-id": "trace-42"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["x-request-id"] == "trace-42"
        usage = json.loads(r.read())["usage"]
    req = urllib.request.Request(loose.url("/v1/models"), headers={"authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["x-request-id"].startswith("req_")
    with urllib.request.urlopen(loose.url("/metrics"), timeout=10) as r:
        metrics = r.read().decode()
    assert 'dsv4_http_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics
    assert 'dsv4_http_requests_total{endpoint="/v1/models",status="200"}' in metrics
    log = loose.log()
    line = next(l for l in log.splitlines() if "request trace-42 " in l)
    assert "POST /v1/chat/completions status=200" in line
    assert f"prompt={usage['prompt_tokens']} " in line and f"completion={usage['completion_tokens']} " in line
    assert "ttft_ms=" in line and "duration_ms=" in line
    assert "\x1b[" not in log  # stderr is a file: no colour codes
    assert "serving `dsv4-test`" in log and "max-context 4096" in log


def test_fresh_seed_per_request_across_restarts(model_dir):
    """Without a seed, the first sampled answer differs from one server start to the next."""
    answers = []
    for i in range(2):
        srv = start_server(model_dir, tag=f"seed{i}")
        try:
            c = openai.OpenAI(base_url=srv.url("/v1"), api_key=API_KEY, max_retries=0, timeout=120)
            answers.append(c.completions.create(model=MODEL, prompt="random", max_tokens=12, temperature=1).choices[0].text)
        finally:
            stop_server(srv)
    assert answers[0] != answers[1]
