//! A batch is a list of rows `(sequence, position, token)`. Prefill chunks, decode tokens and
//! speculative verify blocks are all just rows: the forward pass has no other mode.

/// One token of one sequence at an absolute position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    pub seq: usize,
    pub pos: usize,
    pub token: u32,
}

/// A run of consecutive rows of one sequence with consecutive positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub seq: usize,
    /// Index of the segment's first row in the batch.
    pub start: usize,
    pub len: usize,
    /// Position of the first row; the sequence's state must hold exactly `pos0` tokens.
    pub pos0: usize,
}

/// Rows plus their segments. Build with [`Batch::new`], which checks the grouping.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub rows: Vec<Row>,
    pub segments: Vec<Segment>,
}

/// Why a batch was rejected.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BatchError {
    #[error("empty batch")]
    Empty,
    #[error("row {row}: sequence {seq} appears in two separate runs of the batch")]
    SplitSequence { row: usize, seq: usize },
    #[error("row {row}: position {found} does not follow position {prev} of sequence {seq}")]
    Gap { row: usize, seq: usize, prev: usize, found: usize },
    #[error("row {row}: token id {token} is outside the vocabulary (size {vocab})")]
    Token { row: usize, token: u32, vocab: usize },
    #[error("sequence {seq}: batch starts at position {found} but the sequence holds {expected} tokens")]
    Position { seq: usize, expected: usize, found: usize },
    #[error("sequence {seq} is not allocated")]
    NoSequence { seq: usize },
    #[error("sequence {seq}: position {pos} exceeds max_position_embeddings {max}")]
    TooLong { seq: usize, pos: usize, max: usize },
}

/// Rows a segment may hold for a batch to be "short": a sequence's new rows and the window and
/// compressor rows it reads then sit in distinct slots of the state's rings (each holds its
/// window or span plus [`crate::MAX_ROLLBACK`] rows), so a backend may write the new rows while
/// the same launch reads the old ones. Part of a recorded step's key ([`crate::Model`]), so
/// that the launches chosen on it suit every batch the step is replayed for.
pub const SHORT_SEGMENT: usize = crate::MAX_ROLLBACK + 1;

impl Batch {
    /// Whether every segment holds at most [`SHORT_SEGMENT`] rows (decode and verify rows).
    pub fn short_segments(&self) -> bool {
        self.segments.iter().all(|s| s.len <= SHORT_SEGMENT)
    }

    /// Groups rows into segments; rows of one sequence must be contiguous with consecutive positions.
    pub fn new(rows: Vec<Row>) -> Result<Self, BatchError> {
        if rows.is_empty() {
            return Err(BatchError::Empty);
        }
        let mut segments: Vec<Segment> = Vec::new();
        for (i, r) in rows.iter().enumerate() {
            match segments.last_mut() {
                Some(s) if s.seq == r.seq => {
                    let prev = s.pos0 + s.len - 1;
                    if r.pos != prev + 1 {
                        return Err(BatchError::Gap { row: i, seq: r.seq, prev, found: r.pos });
                    }
                    s.len += 1;
                }
                _ => {
                    if segments.iter().any(|s| s.seq == r.seq) {
                        return Err(BatchError::SplitSequence { row: i, seq: r.seq });
                    }
                    segments.push(Segment { seq: r.seq, start: i, len: 1, pos0: r.pos });
                }
            }
        }
        Ok(Batch { rows, segments })
    }

    /// A single sequence's chunk of tokens starting at `pos0`.
    pub fn chunk(seq: usize, pos0: usize, tokens: &[u32]) -> Result<Self, BatchError> {
        Self::new(tokens.iter().enumerate().map(|(i, &token)| Row { seq, pos: pos0 + i, token }).collect())
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn tokens(&self) -> Vec<u32> {
        self.rows.iter().map(|r| r.token).collect()
    }

    /// Index of the last row of every segment (where next-token logits are usually wanted).
    pub fn last_rows(&self) -> Vec<usize> {
        self.segments.iter().map(|s| s.start + s.len - 1).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_and_rejects() {
        let b = Batch::new(vec![
            Row { seq: 3, pos: 5, token: 1 },
            Row { seq: 3, pos: 6, token: 2 },
            Row { seq: 1, pos: 0, token: 7 },
        ])
        .unwrap();
        assert_eq!(b.segments.len(), 2);
        assert_eq!(b.last_rows(), vec![1, 2]);
        let gap = Batch::new(vec![Row { seq: 0, pos: 0, token: 0 }, Row { seq: 0, pos: 2, token: 0 }]);
        assert!(matches!(gap, Err(BatchError::Gap { .. })));
        let split = Batch::new(vec![
            Row { seq: 0, pos: 0, token: 0 },
            Row { seq: 1, pos: 0, token: 0 },
            Row { seq: 0, pos: 1, token: 0 },
        ]);
        assert!(matches!(split, Err(BatchError::SplitSequence { .. })));
        assert_eq!(Batch::new(vec![]).unwrap_err(), BatchError::Empty);
    }
}
