"""The official OpenAI and Anthropic Python SDKs against `dsv4 serve` (demo model, random weights:
the text is gibberish, so the tests check protocol shape and equivalences, not content)."""
import json

import anthropic
import openai
import pytest

from conftest import API_KEY, MODEL

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ant(server):
    return anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0, timeout=120)


def test_models(oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]


def test_completion_and_stream_agree(oai):
    r = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 8
    text = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert text == r.choices[0].text


def test_completion_logprobs(oai):
    r = oai.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs)


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_non_streaming_and_streaming_agree(oai, thinking):
    kw = dict(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Say hi"}],
              max_tokens=12, temperature=0, seed=3,
              extra_body={"chat_template_kwargs": {"thinking": thinking}})
    r = oai.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    content, reasoning = "", ""
    for c in oai.chat.completions.create(stream=True, **kw):
        if c.choices:
            d = c.choices[0].delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
    assert content == (msg.content or "")
    assert reasoning == (getattr(msg, "reasoning_content", None) or "")
    if not thinking:
        assert reasoning == ""


def test_chat_reasoning_effort_is_accepted(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2+2?"}],
                                    max_tokens=6, temperature=0, reasoning_effort="high")
    assert r.choices[0].message.role == "assistant"


def test_chat_tool_round_trip(oai):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=10, temperature=0)
    m = r.choices[0].message
    assert m.role == "assistant"
    for tc in m.tool_calls or []:
        json.loads(tc.function.arguments)
    assert "DSML" not in (m.content or "") and "dsml" not in (m.content or "")


def test_responses(oai):
    r = oai.responses.create(model=MODEL, input="Hello there", max_output_tokens=8, temperature=0)
    assert r.status in ("completed", "incomplete")
    text = "".join(ev.delta for ev in oai.responses.create(
        model=MODEL, input="Hello there", max_output_tokens=8, temperature=0, stream=True)
        if ev.type == "response.output_text.delta")
    assert text == r.output_text


@pytest.mark.parametrize("thinking", [False, True])
def test_messages_non_streaming_and_streaming_agree(ant, thinking):
    kw = dict(model=MODEL, max_tokens=12, extra_body={"temperature": 0}, system="Be brief.",
              messages=[{"role": "user", "content": "Say hi"}])
    if thinking:
        kw["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    r = ant.messages.create(**kw)
    assert r.role == "assistant" and r.stop_reason in ("end_turn", "max_tokens", "tool_use", "stop_sequence")
    text = "".join(b.text for b in r.content if b.type == "text")
    thought = "".join(b.thinking for b in r.content if b.type == "thinking")
    with ant.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert "".join(b.text for b in final.content if b.type == "text") == text
    assert "".join(b.thinking for b in final.content if b.type == "thinking") == thought
    assert r.usage.output_tokens <= 12


def test_messages_tool_round_trip(ant):
    tools = [{"name": "get_weather", "description": "Weather for a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21C"}]}]
    r = ant.messages.create(model=MODEL, max_tokens=10, extra_body={"temperature": 0}, tools=tools, messages=messages)
    assert r.role == "assistant"
    for b in r.content:
        assert b.type in ("text", "tool_use", "thinking")


def test_errors_come_in_each_apis_format(oai, ant):
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(anthropic.BadRequestError):
        ant.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "x"}])
    bad = openai.OpenAI(base_url=oai.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_stop_token_ids_and_stop_strings(oai):
    base = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=0)
    toks = base.choices[0].logprobs.tokens
    # Stop at the third generated token's id: generation ends there with finish_reason "stop".
    ids = oai.post("/tokenize", body={"prompt": base.choices[0].text}, cast_to=object)["tokens"]
    r = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
                               extra_body={"stop_token_ids": [ids[0]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    # A stop string cuts the text before it.
    if len(base.choices[0].text) > 3:
        stop = base.choices[0].text[2:4]
        r = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stop=[stop])
        assert r.choices[0].text == base.choices[0].text[:base.choices[0].text.index(stop)]
        assert r.choices[0].finish_reason == "stop"
    assert len(toks) == 8
