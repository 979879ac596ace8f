//! Validation errors (the server's HTTP 400s) and streaming-parser behaviour.

use dsv4_chat::{
    encode_chat, parse_output, ChatError, EncodeOptions, Event, Message, OutputParser, ReasoningEffortProfile, Role,
    Task, Tool, ToolCall,
};
use serde_json::json;

fn call(id: &str, name: &str, args: &str) -> ToolCall {
    ToolCall { id: id.into(), name: name.into(), arguments: args.into() }
}

fn with_calls(calls: Vec<ToolCall>) -> Message {
    Message { tool_calls: calls, ..Message::assistant("") }
}

fn tool(name: &str, parameters: serde_json::Value) -> Tool {
    Tool { name: name.into(), description: None, parameters }
}

fn encode(messages: &[Message]) -> Result<String, ChatError> {
    encode_chat(messages, &[], &EncodeOptions::default())
}

fn encode_tools(tools: &[Tool]) -> Result<String, ChatError> {
    encode_chat(&[Message::user("hi")], tools, &EncodeOptions::default())
}

#[test]
fn empty_messages() {
    assert_eq!(encode(&[]), Err(ChatError::EmptyMessages));
}

#[test]
fn tool_message_needs_a_preceding_call() {
    assert_eq!(encode(&[Message::tool("a", "x")]), Err(ChatError::ToolWithoutCall { index: 0 }));
    let msgs = [Message::user("q"), Message::assistant("no calls"), Message::tool("a", "x")];
    assert_eq!(encode(&msgs), Err(ChatError::ToolWithoutCall { index: 2 }));
    let msgs =
        [Message::user("q"), with_calls(vec![call("a", "f", "{}")]), Message::user("u"), Message::tool("a", "x")];
    assert_eq!(encode(&msgs), Err(ChatError::ToolWithoutCall { index: 3 }));
    // Several results after one call turn are fine.
    let msgs = [
        Message::user("q"),
        with_calls(vec![call("a", "f", "{}"), call("b", "f", "{}")]),
        Message::tool("b", "2"),
        Message::tool("a", "1"),
    ];
    assert!(encode(&msgs)
        .unwrap()
        .ends_with("<tool_result>1</tool_result>\n\n<tool_result>2</tool_result><｜Assistant｜></think>"));
}

#[test]
fn tool_call_id_must_match_a_call() {
    let msgs = [Message::user("q"), with_calls(vec![call("a", "f", "{}")]), Message::tool("zzz", "x")];
    assert_eq!(encode(&msgs), Err(ChatError::UnknownToolCallId { index: 2, id: "zzz".into() }));
}

#[test]
fn tool_calls_only_on_assistant_messages() {
    let user = Message { tool_calls: vec![call("a", "f", "{}")], ..Message::user("q") };
    assert_eq!(encode(&[user]), Err(ChatError::UnexpectedToolCalls { index: 0 }));
}

#[test]
fn tool_call_arguments_must_be_a_json_object() {
    for args in ["", "[1]", "\"s\"", "{oops"] {
        let msgs = [Message::user("q"), with_calls(vec![call("a", "f", args)])];
        assert!(matches!(encode(&msgs), Err(ChatError::InvalidToolCall { index: 1, call: 0, .. })), "{args:?}");
    }
    let msgs = [Message::user("q"), with_calls(vec![call("a", "", "{}")])];
    assert!(matches!(encode(&msgs), Err(ChatError::InvalidToolCall { .. })));
}

#[test]
fn unknown_role() {
    assert_eq!("wizard".parse::<Role>(), Err(ChatError::UnknownRole("wizard".into())));
    assert_eq!("latest_reminder".parse::<Role>(), Ok(Role::LatestReminder));
    let bad = serde_json::from_value::<Message>(json!({"role": "wizard", "content": "x"}));
    assert!(bad.is_err());
    assert_eq!(
        ChatError::UnknownRole("wizard".into()).to_string().split(' ').take(3).collect::<Vec<_>>(),
        ["unknown", "role", "`wizard`"]
    );
}

#[test]
fn invalid_tool_schemas() {
    let bad = [
        json!({"type": "object", "properties": {"x": {"type": "strng"}}}),
        json!({"type": "array", "items": {"type": "string"}}),
        json!({"type": "object", "properties": {"x": {"type": "array", "items": {"type": 3}}}}),
        json!({"type": "object", "properties": {"x": {"anyOf": [{"type": "string"}, {"type": "float"}]}}}),
        json!({"type": "object", "properties": [1, 2]}),
        json!("object"),
    ];
    for params in bad {
        let err = encode_tools(&[tool("f", params.clone())]).unwrap_err();
        assert!(matches!(err, ChatError::InvalidTool { .. }), "{params}: {err}");
    }
    let ok = json!({"type": "object", "properties": {"x": {"type": ["string", "null"]}, "y": {"items": [true]}}});
    encode_tools(&[tool("f", ok), tool("g", json!(null))]).unwrap();
    let dup = encode_tools(&[tool("f", json!({})), tool("f", json!({}))]).unwrap_err();
    assert!(dup.to_string().contains("more than once"), "{dup}");
    assert!(matches!(encode_tools(&[tool("", json!({}))]), Err(ChatError::InvalidTool { .. })));
}

#[test]
fn option_errors() {
    let bad_effort = EncodeOptions { reasoning_effort: Some("low".into()), ..EncodeOptions::default() };
    let err = encode_chat(&[Message::user("q")], &[], &bad_effort).unwrap_err();
    assert!(matches!(err, ChatError::InvalidReasoningEffort { .. }));
    assert!(err.to_string().contains("high, max"), "{err}");
    let official = EncodeOptions { reasoning_effort_profile: ReasoningEffortProfile::Official, ..bad_effort };
    encode_chat(&[Message::user("q")], &[], &official).unwrap();

    assert!("nope".parse::<ReasoningEffortProfile>().is_err());
    assert_eq!("read_url".parse::<Task>(), Ok(Task::ReadUrl));
    assert!(matches!("nope".parse::<Task>(), Err(ChatError::UnknownTask(_))));

    let cont = EncodeOptions { continue_final_message: true, ..EncodeOptions::default() };
    assert_eq!(encode_chat(&[Message::user("q")], &[], &cont), Err(ChatError::NoFinalAssistant));
    let task = EncodeOptions { task: Some(Task::Query), ..EncodeOptions::default() };
    assert_eq!(encode_chat(&[Message::system("s")], &[], &task), Err(ChatError::TaskWithoutUser));
    let dev = [Message::new(Role::Developer, ""), Message::user("q")];
    assert_eq!(encode(&dev), Err(ChatError::EmptyDeveloperMessage { index: 0 }));
}

#[test]
fn tools_go_into_a_leading_system_message() {
    let tools = [Tool {
        name: "f".into(),
        description: Some("d".into()),
        parameters: json!({"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "number"}}}),
    }];
    let text = encode_chat(&[Message::user("q")], &tools, &EncodeOptions::default()).unwrap();
    assert!(text.starts_with("<｜begin▁of▁sentence｜>\n\n## Tools\n\n"), "{text}");
    // Key order of the schema is kept as given.
    assert!(text.contains(
        r#"{"name": "f", "description": "d", "parameters": {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "number"}}}}"#
    ));
    assert!(text.ends_with("invoke tool calls.\n<｜User｜>q<｜Assistant｜></think>"));
}

fn collect(parser: &mut OutputParser, pieces: &[&str]) -> Vec<Vec<Event>> {
    pieces.iter().map(|p| parser.push(p)).collect()
}

#[test]
fn streaming_holds_back_possible_markup() {
    let mut p = OutputParser::new(true);
    let steps = collect(&mut p, &["Let me th", "ink</th", "ink>Sure", "\n", "\n<｜DS", "ML｜tool", "_calls>\n"]);
    assert_eq!(steps[0], [Event::Reasoning("Let me th".into())]);
    assert_eq!(steps[1], [Event::Reasoning("ink".into())]);
    assert_eq!(steps[2], [Event::Content("Sure".into())]);
    assert!(steps[3].is_empty() && steps[4].is_empty() && steps[5].is_empty() && steps[6].is_empty());
    let steps = collect(&mut p, &[
        "<｜DSML｜invoke name=\"search\">\n<｜DSML｜parameter name=\"q\" string=\"true\">hello \"",
        "world</",
        "｜DSML｜parameter>\n<｜DSML｜parameter name=\"n\" string=\"false\">5</｜DSML｜parameter>\n</｜DSML｜invoke>\n",
        "</｜DSML｜tool_calls>",
    ]);
    assert_eq!(
        steps[0],
        [
            Event::ToolCallStart { index: 0, id: "call_0".into(), name: "search".into() },
            Event::ToolCallArgs { index: 0, delta: "{\"q\": \"hello \\\"".into() },
        ]
    );
    assert_eq!(steps[1], [Event::ToolCallArgs { index: 0, delta: "world".into() }]);
    assert_eq!(
        steps[2],
        [Event::ToolCallArgs { index: 0, delta: "\", \"n\": 5}".into() }, Event::ToolCallEnd { index: 0 }]
    );
    assert!(steps[3].is_empty());
    assert_eq!(p.finish().unwrap(), []);
}

#[test]
fn content_that_only_looks_like_markup_is_released() {
    let mut p = OutputParser::new(false);
    assert_eq!(p.push("a <"), [Event::Content("a ".into())]);
    assert_eq!(p.push("b>\n"), [Event::Content("<b>".into())]);
    assert_eq!(p.push("\n"), []);
    assert_eq!(p.finish().unwrap(), [Event::Content("\n\n".into())]);
}

#[test]
fn truncated_outputs() {
    // Cut off while reasoning or answering (e.g. max_tokens): kept as is.
    let p = parse_output("still thinking </thi", true).unwrap();
    assert_eq!((p.reasoning_content.as_str(), p.content.as_str()), ("still thinking </thi", ""));
    assert_eq!(parse_output("half an ans", false).unwrap().content, "half an ans");
    // Cut off inside a tool call: an error.
    let err = parse_output("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n", false).unwrap_err();
    assert!(err.to_string().contains("incomplete"), "{err}");
}

#[test]
fn errors_stop_the_parser() {
    let mut p = OutputParser::new(false);
    assert_eq!(p.push("ok "), [Event::Content("ok ".into())]);
    assert_eq!(p.push("<think>"), []);
    assert_eq!(p.push("more"), []);
    assert!(matches!(p.finish(), Err(ChatError::MalformedOutput(_))));
}

#[test]
fn ids_and_empty_arguments() {
    let text = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"a\">\n\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"b\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>";
    let mut p = OutputParser::with_id_prefix(false, "call_req7_");
    let mut events = p.push(text);
    events.extend(p.finish().unwrap());
    let parsed = dsv4_chat::ParsedOutput::from_events(&events);
    assert_eq!(parsed.tool_calls, [call("call_req7_0", "a", "{}"), call("call_req7_1", "b", "{}")]);
    assert_eq!(parse_output(text, false).unwrap().tool_calls[1].id, "call_1");
}

#[test]
fn message_serde_shape() {
    let m: Message = serde_json::from_value(json!({
        "role": "assistant",
        "content": "x",
        "tool_calls": [{"id": "c", "name": "f", "arguments": "{}"}]
    }))
    .unwrap();
    assert_eq!(m.tool_calls[0], call("c", "f", "{}"));
    assert_eq!(m.reasoning_content, None);
}

/// Random mixes of markup fragments: chunked streaming always agrees with the
/// one-shot parse (same result or both errors) and never leaks DSML.
#[test]
fn random_markup_streams_agree_with_one_shot() {
    use rand::{Rng, SeedableRng};
    const PIECES: [&str; 22] = [
        "a",
        "é",
        "🙂",
        " ",
        "\n",
        "\n\n",
        "<",
        ">",
        "/",
        "\"",
        "</think>",
        "<think>",
        "<｜end▁of▁sentence｜>",
        "\n\n<｜DSML｜tool_calls>\n",
        "<｜DSML｜invoke name=\"f\">\n",
        "</｜DSML｜invoke>\n",
        "</｜DSML｜tool_calls>",
        "<｜DSML｜parameter name=\"k\" string=\"true\">",
        "<｜DSML｜parameter name=\"n\" string=\"false\">",
        "</｜DSML｜parameter>\n",
        "｜DSML｜",
        "<\n/｜DSML｜parameter>\n",
    ];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let mut oks = 0;
    for _ in 0..3000 {
        let n = rng.gen_range(0..14);
        let text: String = (0..n).map(|_| PIECES[rng.gen_range(0..PIECES.len())]).collect();
        let thinking = rng.gen_bool(0.5);
        let one_shot = parse_output(&text, thinking);
        let mut p = OutputParser::new(thinking);
        let mut events = Vec::new();
        let mut rest = text.as_str();
        while !rest.is_empty() {
            let mut cut = rng.gen_range(1..=rest.len());
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            events.extend(p.push(&rest[..cut]));
            rest = &rest[cut..];
        }
        let streamed = p.finish().map(|tail| {
            events.extend(tail);
            dsv4_chat::ParsedOutput::from_events(&events)
        });
        assert_eq!(streamed.is_ok(), one_shot.is_ok(), "{text:?}");
        if let (Ok(a), Ok(b)) = (&streamed, &one_shot) {
            assert_eq!(a, b, "{text:?}");
            assert!(!a.content.contains("｜DSML｜") && !a.reasoning_content.contains("｜DSML｜"), "{text:?}");
            oks += 1;
        }
    }
    assert!(oks > 300, "only {oks} valid samples");
}
