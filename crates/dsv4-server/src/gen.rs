//! Drives one engine request for the HTTP layer: detokenises incrementally, applies stop
//! strings (holding back text that may be the start of one), and cancels the sequence when done.

use dsv4_engine::{Event, FinishReason, Submission, TokenEvent};
use dsv4_tokenizer::{StreamDecoder, Tokenizer};
use std::collections::VecDeque;

#[derive(Clone, Debug, PartialEq)]
pub enum Finish {
    /// A stop token (end of sequence).
    Stop,
    /// A stop string matched (it is not included in the text).
    StopSequence(String),
    Length,
    Cancelled,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens restored from the prefix cache (not prefilled).
    pub cached_tokens: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    /// New text and the tokens that produced it.
    Text(String, Vec<TokenEvent>),
    Done(Finish, Usage),
    Error(String),
}

pub struct Gen {
    sub: Submission,
    dec: StreamDecoder,
    stops: Vec<String>,
    pending: String,
    pending_tokens: Vec<TokenEvent>,
    out: VecDeque<Piece>,
    completion_tokens: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    done: bool,
    /// The HTTP request's counters (the operator's log line).
    stats: Option<crate::ops::ReqStats>,
}

/// Length of the longest suffix of `s` that is a proper prefix of some stop string: linear in
/// the stops' total length (a KMP scan of the tail of `s` per stop), so many long stop strings
/// cost little per token.
fn held_back(s: &str, stops: &[String]) -> usize {
    let mut best = 0;
    for stop in stops {
        let p = stop.as_bytes();
        if p.len() < 2 {
            continue;
        }
        // Failure function of the stop string.
        let mut fail = vec![0usize; p.len()];
        let mut k = 0;
        for i in 1..p.len() {
            while k > 0 && p[i] != p[k] {
                k = fail[k - 1];
            }
            if p[i] == p[k] {
                k += 1;
            }
            fail[i] = k;
        }
        let text = s.as_bytes();
        let mut q = 0;
        for &c in &text[text.len().saturating_sub(p.len() - 1)..] {
            while q > 0 && (q == p.len() || c != p[q]) {
                q = fail[q - 1];
            }
            if c == p[q] {
                q += 1;
            }
        }
        if q == p.len() {
            q = fail[q - 1];
        }
        // A suffix of valid UTF-8 equal to the stop's first q bytes starts at a character, so q
        // is a character boundary of the stop.
        best = best.max(q);
    }
    best
}

impl Gen {
    pub fn new(sub: Submission, tok: &Tokenizer, stops: Vec<String>, prompt_tokens: usize) -> Self {
        Gen {
            sub,
            dec: tok.stream_decoder(true),
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
            pending_tokens: Vec::new(),
            out: VecDeque::new(),
            completion_tokens: 0,
            prompt_tokens,
            cached_tokens: 0,
            done: false,
            stats: crate::ops::ReqStats::current(),
        }
    }

    /// Prompt tokens and how many of them the prefix cache supplied, once the engine has admitted
    /// the sequence (always so after the first piece).
    pub fn prompt_usage(&self) -> (usize, usize) {
        (self.prompt_tokens, self.sub.cached.get().copied().unwrap_or(self.cached_tokens))
    }

    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            cached_tokens: self.cached_tokens,
        }
    }

    /// Releases pending text, except what might still become a stop string (unless `all`).
    fn release(&mut self, all: bool) {
        if let Some((idx, stop)) =
            self.stops.iter().filter_map(|s| self.pending.find(s.as_str()).map(|i| (i, s.clone()))).min_by_key(|x| x.0)
        {
            let text = self.pending[..idx].to_string();
            self.out.push_back(Piece::Text(text, std::mem::take(&mut self.pending_tokens)));
            self.out.push_back(Piece::Done(Finish::StopSequence(stop), self.usage()));
            self.sub.cancel.cancel();
            self.done = true;
            return;
        }
        let keep = if all { 0 } else { held_back(&self.pending, &self.stops) };
        let cut = self.pending.len() - keep;
        if cut > 0 || !self.pending_tokens.is_empty() {
            let text = self.pending[..cut].to_string();
            self.pending.drain(..cut);
            self.out.push_back(Piece::Text(text, std::mem::take(&mut self.pending_tokens)));
        }
    }

    /// The next piece; `None` after `Done` or `Error`.
    pub async fn next(&mut self) -> Option<Piece> {
        loop {
            if let Some(p) = self.out.pop_front() {
                return Some(p);
            }
            if self.done {
                return None;
            }
            match self.sub.events.recv().await {
                Some(Event::Token(t)) => {
                    if self.completion_tokens == 0 {
                        if let Some(st) = &self.stats {
                            st.first_token();
                        }
                    }
                    self.completion_tokens += 1;
                    match self.dec.push(t.id) {
                        Ok(s) => self.pending.push_str(&s),
                        Err(e) => {
                            self.done = true;
                            self.sub.cancel.cancel();
                            return Some(Piece::Error(format!("detokenising: {e}")));
                        }
                    }
                    self.pending_tokens.push(t);
                    self.release(false);
                }
                Some(Event::Done { reason, prompt_tokens, completion_tokens, cached_tokens }) => {
                    self.cached_tokens = cached_tokens;
                    if let Ok(s) = self.dec.finish() {
                        self.pending.push_str(&s);
                    }
                    self.prompt_tokens = prompt_tokens;
                    self.completion_tokens = completion_tokens;
                    if let Some(st) = &self.stats {
                        st.add(prompt_tokens, cached_tokens, completion_tokens);
                    }
                    self.release(true);
                    if !self.done {
                        let f = match reason {
                            FinishReason::Stop => Finish::Stop,
                            FinishReason::Length => Finish::Length,
                            FinishReason::Cancelled => Finish::Cancelled,
                        };
                        self.out.push_back(Piece::Done(f, self.usage()));
                        self.done = true;
                    }
                }
                Some(Event::Error(e)) => {
                    self.done = true;
                    return Some(Piece::Error(e));
                }
                None => {
                    self.done = true;
                    return Some(Piece::Error("the engine stopped".into()));
                }
            }
        }
    }

    /// Runs to completion: all text, all tokens, and how it ended.
    pub async fn collect(mut self) -> Result<(String, Vec<TokenEvent>, Finish, Usage), String> {
        let (mut text, mut toks) = (String::new(), Vec::new());
        while let Some(p) = self.next().await {
            match p {
                Piece::Text(t, k) => {
                    text.push_str(&t);
                    toks.extend(k);
                }
                Piece::Done(f, u) => return Ok((text, toks, f, u)),
                Piece::Error(e) => return Err(e),
            }
        }
        Err("generation ended without a result".into())
    }
}

impl Drop for Gen {
    /// A client that goes away cancels its sequence, which frees its state.
    fn drop(&mut self) {
        if !self.done {
            self.sub.cancel.cancel();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::held_back;

    #[test]
    fn holds_back_possible_stop_prefixes() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        assert_eq!(held_back("abc E", &stops), 1);
        assert_eq!(held_back("abc EN", &stops), 2);
        assert_eq!(held_back("abc\n", &stops), 1);
        assert_eq!(held_back("abc", &stops), 0);
        // Overlapping prefixes, multi-byte characters, repeated patterns.
        let stops = vec!["aab".to_string(), "→x".to_string(), "abab".to_string()];
        assert_eq!(held_back("xaa", &stops), 2);
        assert_eq!(held_back("xaba", &stops), 3);
        assert_eq!(held_back("q→", &stops), "→".len());
        assert_eq!(held_back("", &stops), 0);
    }

    /// The linear scan agrees with the obvious quadratic definition.
    #[test]
    fn held_back_matches_the_definition() {
        fn slow(s: &str, stops: &[String]) -> usize {
            let mut best = 0;
            for stop in stops {
                for (i, _) in stop.char_indices().skip(1) {
                    if i > best && s.ends_with(&stop[..i]) {
                        best = i;
                    }
                }
            }
            best
        }
        let alphabet = ["a", "b", "é", "ab"];
        let mut x: u64 = 1;
        let mut next = |n: usize| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) as usize % n
        };
        for _ in 0..3000 {
            let word = |next: &mut dyn FnMut(usize) -> usize, n: usize| -> String {
                (0..n).map(|_| alphabet[next(alphabet.len())]).collect()
            };
            let n = next(8);
            let s = word(&mut next, n);
            let stops: Vec<String> = (0..1 + next(3))
                .map(|_| {
                    let n = 1 + next(6);
                    word(&mut next, n)
                })
                .collect();
            assert_eq!(held_back(&s, &stops), slow(&s, &stops), "{s:?} {stops:?}");
        }
    }

    /// 64 stops of 1,000 bytes: 100 tokens' checks take well under 200 ms (the quadratic scan
    /// took seconds).
    #[test]
    fn many_long_stops_are_cheap() {
        let stops: Vec<String> = (0..64).map(|i| format!("{i}{}", "ab".repeat(500))).collect();
        let pending = "ab".repeat(600);
        let t = std::time::Instant::now();
        for _ in 0..100 {
            held_back(&pending, &stops);
        }
        assert!(t.elapsed() < std::time::Duration::from_millis(200), "{:?}", t.elapsed());
    }
}
