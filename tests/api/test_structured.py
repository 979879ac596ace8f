"""Structured outputs from the random demo model at temperature 1: every answer must be JSON that
validates against its schema (the grammar masks everything else), and forced tool calls must carry
arguments that validate against the tool's schema, in both APIs."""
import json

import anthropic
import jsonschema
import openai
import pytest

from conftest import API_KEY, MODEL

S = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"}, "tag": S},
                                               "required": ["id", "tag"]}}, "required": ["user"]},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "minItems": 1,
                                             "maxItems": 4}}, "required": ["xs"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["p"]},
    {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 8}}, "required": ["note"]},
    {"type": "object", "properties": {"a": S, "b": {"type": "boolean"}}, "required": ["a", "b"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"]},
    {"type": "object", "properties": {"v": {"anyOf": [S, {"type": "integer"}]}}, "required": ["v"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer"}}, "required": ["kind", "x"]},
    {"type": "object", "properties": {"grid": {"type": "array", "maxItems": 3, "items": {
        "type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": -5, "maximum": 5}}}},
     "required": ["grid"]},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}},
     "required": ["n"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3, None, "max"]}}, "required": ["level"]},
    {"type": "object", "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                          "y": {"type": "integer"}},
                                        "required": ["x", "y"], "additionalProperties": False}},
     "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}}, "required": ["from", "to"]},
    {"type": "object", "properties": {"title": S, "subtitle": S, "pages": {"type": "integer", "minimum": 1}},
     "required": ["title"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "array", "maxItems": 2, "items": {"enum": ["x", "y"]}}}, "required": ["c"],
        "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}}, "required": ["a"]},
    {"type": "object", "properties": {"owner": {"anyOf": [{"type": "object", "properties": {"name": S},
                                                           "required": ["name"], "additionalProperties": False},
                                                          {"type": "null"}]}}, "required": ["owner"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 5}}, "required": ["word"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"temp": {"type": "number", "minimum": -40, "maximum": 50},
                                      "unit": {"enum": ["C", "F"]}, "ts": {"type": "integer", "minimum": 0}},
     "required": ["temp", "unit", "ts"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "maxItems": 3}, "score": {"type": ["number", "null"]}},
     "required": ["tags", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "child": {"type": "object", "properties": {
        "id": {"type": "integer"}, "alias": {"type": ["string", "null"], "maxLength": 6}},
        "required": ["id", "alias"], "additionalProperties": False}}, "required": ["flag", "child"],
     "additionalProperties": False},
]



def bounded(schema):
    """What keeps a random model's answer finite: objects closed (`additionalProperties: false`),
    numbers bounded (and non-integers on a grid: a fraction of free length never ends either),
    strings capped. A random model never stops a free-length number or key."""
    if isinstance(schema, list):
        return [bounded(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    s = {k: bounded(v) for k, v in schema.items()}
    types = s.get("type") if isinstance(s.get("type"), list) else [s.get("type")]
    if "object" in types:
        s.setdefault("additionalProperties", False)
    if ("integer" in types or "number" in types) and not any(k in s for k in ("maximum", "exclusiveMaximum")):
        s.setdefault("minimum", -1000)
        s["maximum"] = 1000
    if "number" in types:
        s.setdefault("multipleOf", 0.25)
    if "string" in types and "pattern" not in s:
        s.setdefault("maxLength", 16)
    return s


SCHEMAS = [bounded(x) for x in SCHEMAS]

TOOLS = [
    {"name": "get_weather", "description": "Weather for a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "unit": {"enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"], "additionalProperties": False}},
    {"name": "add", "description": "Adds numbers", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "items": {"type": "number"}, "maxItems": 4}},
        "required": ["xs"], "additionalProperties": False}},
]
TOOLS = [{**t, "parameters": bounded(t["parameters"])} for t in TOOLS]
BY_NAME = {t["name"]: t["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def ant(server):
    return anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0, timeout=300)


def validate(text, schema):
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_from_the_random_model(oai, i):
    schema = SCHEMAS[i]
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
    # Seeded: each case is the same on every run (a failure reproduces).
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Answer in JSON."}],
                                    temperature=1, max_tokens=1500, response_format=fmt, seed=100 + i)
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    validate(r.choices[0].message.content, schema)


@pytest.mark.parametrize("i", [0, 8, 15, 22])
def test_responses_text_format(oai, i):
    schema = SCHEMAS[i]
    r = oai.responses.create(model=MODEL, input="JSON please", temperature=1, max_output_tokens=1500,
                             text={"format": {"type": "json_schema", "name": f"s{i}", "schema": schema}},
                             extra_body={"seed": 200 + i})
    assert r.status == "completed"
    validate(r.output_text, schema)


def token_id(server, text):
    import urllib.request
    req = urllib.request.Request(server.url("/tokenize"), data=json.dumps({"prompt": text}).encode(),
                                 headers={"content-type": "application/json", "authorization": f"Bearer {API_KEY}"})
    ids = json.loads(urllib.request.urlopen(req).read())["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


def test_json_object_and_streaming(server, oai):
    # Any object is allowed, keys and values of any length, which a random model never ends on
    # its own: a bias towards `}` makes it close as soon as the grammar lets it (unconstrained,
    # the bias would give `}}}}`).
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "JSON"}], temperature=1, max_tokens=200,
              response_format={"type": "json_object"}, seed=4, logit_bias={str(token_id(server, "}")): 30})
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    text = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(**kw, stream=True)
                   if c.choices)
    assert text == r.choices[0].message.content


def test_bad_schema_is_a_400(oai):
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}})


def test_constraint_applies_after_the_reasoning(server, oai):
    import urllib.request
    req = urllib.request.Request(server.url("/tokenize"), data=json.dumps({"prompt": "</think>", "parse_special_tokens": True}).encode(),
                                 headers={"content-type": "application/json", "authorization": f"Bearer {API_KEY}"})
    think_end = json.loads(urllib.request.urlopen(req).read())["tokens"]
    assert len(think_end) == 1
    schema = SCHEMAS[6]
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    # Reasoning is free text: the random model does not stop thinking within 6 tokens.
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=6,
                                    response_format=fmt, extra_body={"chat_template_kwargs": {"thinking": True}})
    assert r.choices[0].message.content == "" and r.choices[0].message.reasoning_content
    # A bias that ends the reasoning at once: the answer after it follows the schema (the bias
    # keeps pushing `</think>`, which the grammar now masks).
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1500,
                                    temperature=1, response_format=fmt, logit_bias={str(think_end[0]): 100},
                                    seed=7, extra_body={"chat_template_kwargs": {"thinking": True}})
    assert r.choices[0].message.reasoning_content == ""
    validate(r.choices[0].message.content, schema)


def openai_tools():
    return [{"type": "function", "function": t} for t in TOOLS]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_openai_chat(oai, choice):
    for seed in range(3):
        r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}],
                                        temperature=1, max_tokens=1500, tools=openai_tools(), tool_choice=choice,
                                        seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0].function
        if isinstance(choice, dict):
            assert call.name == "add"
        jsonschema.validate(json.loads(call.arguments), BY_NAME[call.name])


def test_forced_tool_call_responses(oai):
    tools = [{"type": "function", **t} for t in TOOLS]
    r = oai.responses.create(model=MODEL, input="weather?", temperature=1, max_output_tokens=1500, tools=tools,
                             tool_choice={"type": "function", "name": "get_weather"}, extra_body={"seed": 3})
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), BY_NAME["get_weather"])


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_calls_anthropic(ant, choice):
    tools = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS]
    for seed in range(3):
        m = ant.messages.create(model=MODEL, max_tokens=1500, tools=tools, tool_choice=choice,
                                messages=[{"role": "user", "content": "weather?"}],
                                extra_body={"seed": seed, "temperature": 1})
        assert m.stop_reason == "tool_use", m
        uses = [b for b in m.content if b.type == "tool_use"]
        assert len(uses) == 1
        if choice["type"] == "tool":
            assert uses[0].name == "get_weather"
        jsonschema.validate(uses[0].input, BY_NAME[uses[0].name])
    # Streaming gives the same call.
    with ant.messages.stream(model=MODEL, max_tokens=1500, tools=tools, tool_choice=choice,
                             messages=[{"role": "user", "content": "weather?"}],
                             extra_body={"seed": 2, "temperature": 1}) as s:
        final = s.get_final_message()
    assert [b.model_dump(exclude={"parsed_output"}) for b in final.content] == [b.model_dump() for b in m.content]


def test_tool_choice_none_never_calls(server, oai, ant):
    import urllib.request
    req = urllib.request.Request(server.url("/tokenize"), data=json.dumps({"prompt": "｜DSML｜", "parse_special_tokens": True}).encode(),
                                 headers={"content-type": "application/json", "authorization": f"Bearer {API_KEY}"})
    dsml = json.loads(urllib.request.urlopen(req).read())["tokens"]
    assert len(dsml) == 1
    # A bias that would make every token the DSML marker that opens a call: with tool_choice
    # none the marker is masked.
    push = {str(dsml[0]): 100}
    for seed in range(3):
        r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}],
                                        max_tokens=30, tools=openai_tools(), tool_choice="none", seed=seed,
                                        logit_bias=push)
        msg = r.choices[0].message
        assert not msg.tool_calls and r.choices[0].finish_reason != "tool_calls" and "DSML" not in msg.content
    tools = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS]
    m = ant.messages.create(model=MODEL, max_tokens=30, tools=tools, tool_choice={"type": "none"},
                            messages=[{"role": "user", "content": "weather?"}], extra_body={"logit_bias": push})
    assert all(b.type != "tool_use" for b in m.content)
    assert all("DSML" not in getattr(b, "text", "") for b in m.content)
