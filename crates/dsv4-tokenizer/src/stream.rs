//! Incremental detokenisation for streaming generation.

use crate::{Result, Tokenizer};

/// Turns a stream of token ids into text chunks as soon as they are complete.
///
/// Byte-level BPE tokens are byte strings, so one character (an emoji, a CJK
/// character) may be spread over several tokens. Decoding each token on its
/// own would emit U+FFFD fragments; this decoder instead holds back ids until
/// the text they produce ends in a complete character.
///
/// The invariant is: the concatenation of everything returned by
/// [`push`](Self::push) followed by [`finish`](Self::finish) equals
/// `tokenizer.decode(all_ids, skip_special)`.
///
/// How: it keeps the ids since the start of the last emitted chunk
/// (`window`), decodes them with and without the new id and emits the
/// difference, unless the new text ends in U+FFFD (an incomplete UTF-8
/// sequence). Because an emitted chunk always ends on a complete character,
/// decoding the window on its own gives the same text as decoding it as
/// part of the whole sequence. Decoding goes through [`Tokenizer::decode`],
/// so it stays correct whatever the tokenizer's decoder does.
///
/// A genuine trailing U+FFFD (invalid bytes, or the U+FFFD character itself)
/// is indistinguishable from an incomplete sequence, so it is held back until
/// the next id or [`finish`](Self::finish).
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    tokenizer: Tokenizer,
    skip_special: bool,
    /// Ids from the start of the last emitted chunk to now.
    window: Vec<u32>,
    /// `window[..read]` has been emitted; `window[read..]` is pending.
    read: usize,
}

impl StreamDecoder {
    /// A decoder with nothing pending. `skip_special` has the meaning of
    /// [`Tokenizer::decode`]'s argument.
    pub fn new(tokenizer: &Tokenizer, skip_special: bool) -> StreamDecoder {
        StreamDecoder { tokenizer: tokenizer.clone(), skip_special, window: Vec::new(), read: 0 }
    }

    /// Feeds one id and returns the text that became complete (possibly
    /// empty). On error (an id outside the vocabulary) the id is not consumed
    /// and the state is unchanged.
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.tokenizer.check_id(id)?;
        self.window.push(id);
        match self.step() {
            Ok(text) => Ok(text),
            Err(e) => {
                self.window.pop();
                Err(e)
            }
        }
    }

    fn step(&mut self) -> Result<String> {
        let tok = &self.tokenizer;
        let prefix = tok.decode(&self.window[..self.read], self.skip_special)?;
        let full = tok.decode(&self.window, self.skip_special)?;
        if full.len() <= prefix.len() || full.ends_with(char::REPLACEMENT_CHARACTER) {
            // Nothing new (e.g. a skipped special token) or an incomplete
            // character: wait for more ids.
            return Ok(String::new());
        }
        let new = match full.strip_prefix(prefix.as_str()) {
            Some(new) => new.to_owned(),
            // Only reachable with a context-dependent decoder that rewrote
            // already-emitted text; never for DeepSeek's ByteLevel decoder.
            // Emit the unseen tail rather than repeating text.
            None => full.get(prefix.len()..).unwrap_or_default().to_owned(),
        };
        // Drop ids that were already emitted in earlier chunks; the chunk
        // just emitted becomes the new prefix.
        self.window.drain(..self.read);
        self.read = self.window.len();
        Ok(new)
    }

    /// Flushes whatever is pending (an incomplete character decodes to
    /// U+FFFD, exactly as in [`Tokenizer::decode`]) and resets the decoder so
    /// it can be reused for a new sequence.
    pub fn finish(&mut self) -> Result<String> {
        let tok = &self.tokenizer;
        let prefix = tok.decode(&self.window[..self.read], self.skip_special)?;
        let full = tok.decode(&self.window, self.skip_special)?;
        let rest = match full.strip_prefix(prefix.as_str()) {
            Some(rest) => rest.to_owned(),
            None => full.get(prefix.len()..).unwrap_or_default().to_owned(),
        };
        self.window.clear();
        self.read = 0;
        Ok(rest)
    }

    /// Whether some pushed ids are not yet reflected in the returned text:
    /// the start of an incomplete character, or ids that decoded to nothing
    /// (e.g. skipped special tokens).
    pub fn has_pending(&self) -> bool {
        self.read < self.window.len()
    }
}
