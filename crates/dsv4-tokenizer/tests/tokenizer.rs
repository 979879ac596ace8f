//! Behavioural tests of the wrapper: special tokens, BOS handling, errors and
//! the streaming decoder on hand-picked edge cases.

use dsv4_tokenizer::{tokens, Error, Tokenizer};

fn tok() -> Tokenizer {
    Tokenizer::deepseek_v4().expect("embedded tokenizer loads")
}

#[test]
fn special_token_ids() {
    let s = tok().special;
    assert_eq!(s.bos, 0);
    assert_eq!(s.eos, 1);
    assert_eq!(s.pad, 2);
    assert_eq!(s.user, 128_803);
    assert_eq!(s.assistant, 128_804);
    assert_eq!(s.think_begin, 128_821);
    assert_eq!(s.think_end, 128_822);
    assert_eq!(s.dsml, 128_825);
    assert_eq!(s.dsml_tag_open, 128_840);
    assert_eq!(s.dsml_tag_close, 128_841);
    assert_eq!(s.begin_sys, 128_826);
    assert_eq!(s.end_sys, 128_827);
    assert_eq!(s.latest_reminder, 128_828);
    assert_eq!(s.tool_calls_begin, 128_806);
    assert_eq!(s.tool_sep, 128_814);
}

#[test]
fn special_tokens_are_single_distinct_ids_anywhere_in_text() {
    let tok = tok();
    let all = tok.special.all();
    let mut seen = std::collections::HashSet::new();
    for (text, id) in all {
        assert!(seen.insert(id), "duplicate id {id}");
        assert_eq!(tok.encode(text, false).unwrap(), vec![id], "{text}");
        // Embedded between ordinary text with no separating spaces.
        let ids = tok.encode(&format!("abc{text}def"), false).unwrap();
        assert_eq!(ids.iter().filter(|&&x| x == id).count(), 1, "{text}: {ids:?}");
        assert_eq!(tok.decode(&ids, false).unwrap(), format!("abc{text}def"));
    }
}

#[test]
fn ascii_lookalikes_are_not_special() {
    let tok = tok();
    // ASCII `|` and `_` instead of U+FF5C and U+2581.
    for text in ["<|User|>", "<|begin_of_sentence|>", "|DSML|", "<think >"] {
        let ids = tok.encode(text, false).unwrap();
        assert!(ids.len() > 1, "{text} -> {ids:?}");
        assert!(ids.iter().all(|&id| id < 128_000), "{text} -> {ids:?}");
    }
}

#[test]
fn chat_prompt_encoding() {
    let tok = tok();
    let prompt = format!("{}{}hello{}{}", tokens::BOS, tokens::USER, tokens::ASSISTANT, tokens::THINK_END);
    let ids = tok.encode(&prompt, false).unwrap();
    let s = tok.special;
    assert_eq!(ids.first(), Some(&s.bos));
    assert_eq!(ids[1], s.user);
    assert_eq!(&ids[ids.len() - 2..], &[s.assistant, s.think_end]);
    // Not doubled unless asked for.
    assert_eq!(tok.encode(&prompt, true).unwrap()[..2], [s.bos, s.bos]);
}

#[test]
fn digits_split_in_groups_of_three() {
    let tok = tok();
    let ids = tok.encode("12345678", false).unwrap();
    let pieces: Vec<String> = ids.iter().map(|&i| tok.decode(&[i], false).unwrap()).collect();
    assert_eq!(pieces, ["123", "456", "78"]);
}

#[test]
fn empty_text() {
    let tok = tok();
    assert!(tok.encode("", false).unwrap().is_empty());
    assert_eq!(tok.encode("", true).unwrap(), vec![0]);
    assert_eq!(tok.decode(&[], false).unwrap(), "");
}

#[test]
fn skip_special_drops_only_flagged_tokens() {
    let tok = tok();
    let s = tok.special;
    let ids = [s.bos, s.user, s.assistant, s.think_begin, s.eos, s.pad];
    // BOS/EOS/PAD are `special: true`; the chat markers are not (HF semantics).
    assert_eq!(tok.decode(&ids, true).unwrap(), "<｜User｜><｜Assistant｜><think>");
    assert_eq!(
        tok.decode(&ids, false).unwrap(),
        "<｜begin▁of▁sentence｜><｜User｜><｜Assistant｜><think><｜end▁of▁sentence｜><｜▁pad▁｜>"
    );
}

#[test]
fn unknown_ids_are_rejected() {
    let tok = tok();
    let err = tok.decode(&[5, 200_000], false).unwrap_err();
    assert!(matches!(err, Error::UnknownId { id: 200_000, vocab_size: 129_280 }));
    let mut stream = tok.stream_decoder(false);
    assert!(stream.push(u32::MAX).is_err());
    // A rejected id leaves the stream usable.
    assert_eq!(stream.push(tok.token_to_id("Hello").unwrap()).unwrap(), "Hello");
}

/// Streams `ids` and returns the chunks (the last one from `finish`).
fn stream_chunks(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
    let mut s = tok.stream_decoder(false);
    let mut chunks: Vec<String> = ids.iter().map(|&id| s.push(id).unwrap()).collect();
    chunks.push(s.finish().unwrap());
    chunks
}

#[test]
fn stream_holds_back_emoji_split_across_tokens() {
    let tok = tok();
    for text in ["🦀", "a🦀b", "👨‍👩‍👧‍👦", "🇯🇵 ok", "𠀀漢"] {
        let ids = tok.encode(text, false).unwrap();
        let chunks = stream_chunks(&tok, &ids);
        assert_eq!(chunks.concat(), text);
        for c in &chunks {
            assert!(!c.contains('\u{FFFD}'), "{text}: {chunks:?}");
        }
    }
    // The crab really is split across tokens, so the test exercises hold-back.
    let crab = tok.encode("🦀", false).unwrap();
    assert!(crab.len() > 1, "{crab:?}");
    let chunks = stream_chunks(&tok, &crab);
    assert!(chunks[..crab.len() - 1].iter().all(String::is_empty));
    assert_eq!(chunks[crab.len() - 1], "🦀");
}

#[test]
fn stream_flushes_incomplete_and_invalid_bytes_like_decode() {
    let tok = tok();
    let crab = tok.encode("🦀", false).unwrap();
    // Truncated character: held back, then U+FFFD on finish, as decode does.
    let truncated = &crab[..crab.len() - 1];
    let chunks = stream_chunks(&tok, truncated);
    assert_eq!(chunks.concat(), tok.decode(truncated, false).unwrap());
    assert!(chunks.last().unwrap().ends_with('\u{FFFD}'));

    // A lone continuation byte (0x80, `Ģ` in the byte-level alphabet) is
    // invalid UTF-8; it is emitted as U+FFFD once the next token arrives.
    let lone = tok.token_to_id("Ģ").expect("byte token 0x80");
    let a = tok.token_to_id("a").unwrap();
    let ids = [a, lone, a, lone, lone, a];
    let mut s = tok.stream_decoder(false);
    let mut out = String::new();
    for &id in &ids {
        out.push_str(&s.push(id).unwrap());
    }
    assert!(!s.has_pending());
    out.push_str(&s.finish().unwrap());
    assert_eq!(out, tok.decode(&ids, false).unwrap());
    assert_eq!(out, "a\u{FFFD}a\u{FFFD}\u{FFFD}a");
}

#[test]
fn stream_decoder_resets_after_finish() {
    let tok = tok();
    let mut s = tok.stream_decoder(true);
    let ids = tok.encode("first", true).unwrap();
    let first: String = ids.iter().map(|&i| s.push(i).unwrap()).collect();
    assert_eq!(first + &s.finish().unwrap(), "first");
    let ids = tok.encode("second 🦀", true).unwrap();
    let second: String = ids.iter().map(|&i| s.push(i).unwrap()).collect();
    assert_eq!(second + &s.finish().unwrap(), "second 🦀");
}

#[test]
fn from_file_and_from_bytes() {
    let tok = tok();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    let zst = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/data/deepseek-v4-tokenizer.json.zst")).unwrap();
    let json = zstd::stream::decode_all(&zst[..]).unwrap();
    std::fs::write(&path, &json).unwrap();
    let from_file = Tokenizer::from_file(&path).unwrap();
    assert_eq!(from_file.special, tok.special);
    assert_eq!(from_file.vocab_size(), tok.vocab_size());
    let text = "<｜User｜>def f():\n    return '深度求索' 🦀<｜Assistant｜>";
    assert_eq!(from_file.encode(text, true).unwrap(), tok.encode(text, true).unwrap());

    assert!(matches!(Tokenizer::from_file(dir.path().join("missing.json")), Err(Error::Io { .. })));
    assert!(matches!(Tokenizer::from_bytes(b"not json"), Err(Error::Tokenizers { .. })));
    let tiny = br#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
        "normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,
        "model":{"type":"BPE","vocab":{"a":0},"merges":[]}}"#;
    assert!(matches!(
        Tokenizer::from_bytes(tiny),
        Err(Error::MissingSpecialToken(t)) if t == tokens::BOS
    ));
}

#[test]
fn shared_across_threads() {
    let tok = tok();
    let text = "并发 test 🦀 <think>x</think>";
    let want = tok.encode(text, true).unwrap();
    std::thread::scope(|scope| {
        for _ in 0..4 {
            let tok = tok.clone();
            let want = &want;
            scope.spawn(move || assert_eq!(&tok.encode(text, true).unwrap(), want));
        }
    });
}
