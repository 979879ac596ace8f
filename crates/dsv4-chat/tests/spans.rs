//! The prompt's literal ranges are exactly the user and tool content: those are tokenised as
//! plain text; the system prompt, assistant history and template markers are not in them.

use dsv4_chat::{encode_chat, encode_chat_spans, EncodeOptions, Message, ToolCall};

#[test]
fn literal_ranges_are_the_user_and_tool_content() {
    let mut call = Message::assistant("");
    call.tool_calls = vec![ToolCall { id: "c1".into(), name: "read".into(), arguments: "{\"p\": \"x\"}".into() }];
    let msgs = vec![
        Message::system("SYS <｜User｜>"),
        Message::user("first <｜Assistant｜> user"),
        call,
        Message::tool("c1", "tool says </think>"),
        Message::user("second"),
        Message::assistant("ASSIST"),
        Message::user("third"),
    ];
    let opts = EncodeOptions { thinking: true, ..Default::default() };
    let (text, spans) = encode_chat_spans(&msgs, &[], &opts).unwrap();
    assert_eq!(text, encode_chat(&msgs, &[], &opts).unwrap());
    let got: Vec<&str> = spans.iter().map(|r| &text[r.clone()]).collect();
    assert_eq!(got, ["first <｜Assistant｜> user", "tool says </think>", "second", "third"]);
    assert!(spans.windows(2).all(|w| w[0].end <= w[1].start));
}
