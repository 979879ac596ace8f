//! DSML tool calls in the model's output come back as JSON tool calls in all three chat APIs,
//! streamed as deltas, with no DSML in the content. The engine is a scripted stand-in that
//! "generates" exactly the DeepSeek V4 rendering of an assistant turn with reasoning and a call.

use dsv4_chat::{encode_chat, EncodeOptions, Message, ToolCall};
use dsv4_server::AppState;
use dsv4_tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

/// The completion text of an assistant turn (what the model emits after the prompt).
fn scripted_completion(thinking: bool) -> String {
    let mut a = Message::assistant("Let me check.");
    if thinking {
        a.reasoning_content = Some("The user wants the weather.".into());
    }
    a.tool_calls =
        vec![ToolCall { id: "x".into(), name: "get_weather".into(), arguments: r#"{"city": "Paris"}"#.into() }];
    let opts = EncodeOptions { thinking, drop_thinking: false, ..Default::default() };
    let prompt = encode_chat(&[Message::user("Weather in Paris?")], &[], &opts).unwrap();
    let full = encode_chat(&[Message::user("Weather in Paris?"), a], &[], &opts).unwrap();
    assert!(full.starts_with(&prompt), "{prompt:?} / {full:?}");
    full[prompt.len()..].to_string()
}

fn start(thinking: bool) -> (String, tokio::runtime::Runtime) {
    let tok = Tokenizer::deepseek_v4().unwrap();
    let script = tok.encode(&scripted_completion(thinking), false).unwrap();
    let engine = dsv4_engine::scripted(tok.vocab_size(), vec![tok.special.eos], script);
    let state = Arc::new(AppState {
        engine,
        tok,
        model_name: "m".into(),
        aliases: vec![],
        api_key: None,
        max_body: 1 << 20,
        default_max_tokens: Some(256),
        strict_model_name: true,
        max_tokens_limit: None,
        request_defaults: Default::default(),
        live: Default::default(),
        guard: Default::default(),
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    rt.spawn(async move { axum::serve(listener, dsv4_server::router(state)).await });
    (addr, rt)
}

/// POSTs JSON; returns the status and body (SSE bodies are returned raw).
fn post(addr: &str, path: &str, body: &Value) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    let b = body.to_string();
    write!(s, "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}", b.len()).unwrap();
    let mut r = BufReader::new(s);
    let mut status = String::new();
    r.read_line(&mut status).unwrap();
    let code = status.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut chunked = false;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        if h.to_ascii_lowercase().starts_with("transfer-encoding: chunked") {
            chunked = true;
        }
        if h == "\r\n" {
            break;
        }
    }
    let mut out = String::new();
    if chunked {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).unwrap();
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            if n == 0 {
                break;
            }
            let mut buf = vec![0u8; n + 2];
            r.read_exact(&mut buf).unwrap();
            out.push_str(std::str::from_utf8(&buf[..n]).unwrap());
        }
    } else {
        r.read_to_string(&mut out).unwrap();
    }
    (code, out)
}

fn sse_data(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn no_dsml(s: &str) {
    assert!(!s.contains("DSML") && !s.contains("dsml") && !s.contains("invoke"), "markup leaked: {s:?}");
}

#[test]
fn openai_chat_tool_calls_non_streaming_and_streaming() {
    for thinking in [false, true] {
        let (addr, _rt) = start(thinking);
        let req = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 200,
                         "chat_template_kwargs": {"thinking": thinking}});
        let (code, body) = post(&addr, "/v1/chat/completions", &req);
        assert_eq!(code, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls");
        let m = &c["message"];
        no_dsml(m["content"].as_str().unwrap());
        assert_eq!(m["content"], "Let me check.");
        let tc = &m["tool_calls"][0];
        assert_eq!(tc["function"]["name"], "get_weather");
        let args: Value = serde_json::from_str(tc["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"city": "Paris"}));
        if thinking {
            assert_eq!(m["reasoning_content"], "The user wants the weather.");
        }
        // Streaming: the same call assembled from deltas.
        let mut sreq = req.clone();
        sreq["stream"] = json!(true);
        let (_, body) = post(&addr, "/v1/chat/completions", &sreq);
        let (mut content, mut reasoning, mut name, mut args) =
            (String::new(), String::new(), String::new(), String::new());
        let mut finish = Value::Null;
        for ev in sse_data(&body) {
            let ch = &ev["choices"][0];
            let d = &ch["delta"];
            content += d["content"].as_str().unwrap_or("");
            reasoning += d["reasoning_content"].as_str().unwrap_or("");
            if let Some(tcs) = d["tool_calls"].as_array() {
                name += tcs[0]["function"]["name"].as_str().unwrap_or("");
                args += tcs[0]["function"]["arguments"].as_str().unwrap_or("");
            }
            if !ch["finish_reason"].is_null() {
                finish = ch["finish_reason"].clone();
            }
        }
        no_dsml(&content);
        assert_eq!((content.as_str(), name.as_str()), ("Let me check.", "get_weather"));
        assert_eq!(serde_json::from_str::<Value>(&args).unwrap(), json!({"city": "Paris"}));
        assert_eq!(finish, "tool_calls");
        if thinking {
            assert_eq!(reasoning, "The user wants the weather.");
        }
    }
}

#[test]
fn anthropic_and_responses_tool_calls() {
    let (addr, _rt) = start(true);
    let req = json!({"model": "m", "max_tokens": 200, "thinking": {"type": "enabled", "budget_tokens": 100},
                     "messages": [{"role": "user", "content": "Weather in Paris?"}]});
    let (code, body) = post(&addr, "/v1/messages", &req);
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["stop_reason"], "tool_use");
    let kinds: Vec<&str> = v["content"].as_array().unwrap().iter().map(|b| b["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["thinking", "text", "tool_use"]);
    assert_eq!(v["content"][2]["input"], json!({"city": "Paris"}));
    no_dsml(v["content"][1]["text"].as_str().unwrap());
    // Streaming event sequence, with the tool input as input_json_delta.
    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    let (_, body) = post(&addr, "/v1/messages", &sreq);
    let evs = sse_data(&body);
    let types: Vec<&str> = evs.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types.first(), Some(&"message_start"));
    assert_eq!(types.last(), Some(&"message_stop"));
    let json_in: String = evs
        .iter()
        .filter(|e| e["delta"]["type"] == "input_json_delta")
        .map(|e| e["delta"]["partial_json"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(serde_json::from_str::<Value>(&json_in).unwrap(), json!({"city": "Paris"}));
    let starts = evs.iter().filter(|e| e["type"] == "content_block_start").count();
    let stops = evs.iter().filter(|e| e["type"] == "content_block_stop").count();
    assert_eq!((starts, stops), (3, 3));
    // Responses API: a function_call output item.
    let (code, body) = post(
        &addr,
        "/v1/responses",
        &json!({"model": "m", "input": "Weather in Paris?", "reasoning": {"effort": "high"}}),
    );
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let items = v["output"].as_array().unwrap();
    let call = items.iter().find(|i| i["type"] == "function_call").expect("function_call item");
    assert_eq!(call["name"], "get_weather");
    assert_eq!(serde_json::from_str::<Value>(call["arguments"].as_str().unwrap()).unwrap(), json!({"city": "Paris"}));
}
