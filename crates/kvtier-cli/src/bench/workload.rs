//! Benchmark workloads a user would recognise, as deterministic token sequences.
//!
//! Invariant: a workload's content depends only on its parameters and seed — never on timing or on the
//! engine configuration — so the same request key gets the same prompt in every configuration of a run
//! (given identical earlier answers), which is what lets the suite compare outputs across configurations.

use serde::Serialize;

/// Multi-round chat: every user shares one system prompt, then asks `rounds` questions; each prompt is
/// the user's whole history (system prompt, earlier questions and the engine's earlier answers).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatParams {
    /// Concurrent users (streams).
    pub users: usize,
    /// Questions each user asks.
    pub rounds: usize,
    /// Tokens of the shared system prompt.
    pub system_tokens: usize,
    /// Tokens of each question.
    pub question_tokens: usize,
    /// Tokens generated per answer.
    pub answer_tokens: u32,
    /// Request arrival rate (requests per second, across users); a user waits for its previous answer.
    pub qps: f64,
}

/// Long-document QA: each document is asked several questions; questions visit the documents
/// round-robin, so a document's KV has usually left a small G1 before its next question.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DocQaParams {
    /// Documents (streams).
    pub docs: usize,
    /// Tokens of each document.
    pub doc_tokens: usize,
    /// Questions asked about each document.
    pub questions_per_doc: usize,
    /// Tokens of each question.
    pub question_tokens: usize,
    /// Tokens generated per answer.
    pub answer_tokens: u32,
    /// Request arrival rate (requests per second, across documents).
    pub qps: f64,
}

/// One workload.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Workload {
    /// Multi-round chat.
    Chat(ChatParams),
    /// Long-document QA.
    DocQa(DocQaParams),
}

impl Workload {
    /// Short name used in tables and file names.
    pub fn name(&self) -> &'static str {
        match self {
            Workload::Chat(_) => "chat",
            Workload::DocQa(_) => "docqa",
        }
    }

    /// Number of requests the workload sends.
    pub fn num_requests(&self) -> usize {
        match self {
            Workload::Chat(p) => p.users * p.rounds,
            Workload::DocQa(p) => p.docs * p.questions_per_doc,
        }
    }

    /// Requests per second.
    pub fn qps(&self) -> f64 {
        match self {
            Workload::Chat(p) => p.qps,
            Workload::DocQa(p) => p.qps,
        }
    }

    /// Longest prompt + answer, in tokens (must fit the model's context).
    pub fn max_sequence_len(&self) -> usize {
        match self {
            Workload::Chat(p) => {
                p.system_tokens + p.rounds * (p.question_tokens + p.answer_tokens as usize)
            }
            Workload::DocQa(p) => p.doc_tokens + p.question_tokens + p.answer_tokens as usize,
        }
    }
}

/// A deterministic stream of token ids in `lo..hi` (xorshift64*; no external RNG so the text never
/// changes with a dependency upgrade).
#[derive(Debug, Clone)]
pub struct TokenRng {
    state: u64,
    lo: u32,
    span: u32,
}

impl TokenRng {
    /// Tokens in `lo..hi` (printable ASCII with the byte-level tokenizer: 32..127).
    pub fn new(seed: u64, lo: u32, hi: u32) -> Self {
        TokenRng {
            state: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            lo,
            span: hi.saturating_sub(lo).max(1),
        }
    }

    /// `n` tokens.
    pub fn take(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.next_token()).collect()
    }

    fn next_token(&mut self) -> u32 {
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        let r = x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32;
        self.lo + (r % u64::from(self.span)) as u32
    }
}

/// Identifies one request within a workload (stable across configurations).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct RequestKey {
    /// User (chat) or document (docqa).
    pub stream: usize,
    /// Round (chat) or question index (docqa).
    pub turn: usize,
}

/// The per-stream content of a workload: what each stream says, independent of the answers.
#[derive(Debug, Clone)]
pub struct Script {
    /// Prefix shared by every request of a stream (system prompt, or the document).
    pub stream_prefix: Vec<Vec<u32>>,
    /// `questions[stream][turn]`.
    pub questions: Vec<Vec<Vec<u32>>>,
    /// Whether a stream's later prompts include its earlier questions and answers (chat) or not (docqa).
    pub carries_history: bool,
    /// Tokens generated per answer.
    pub answer_tokens: u32,
}

impl Script {
    /// Builds the content of `w` with tokens in `lo..hi`.
    pub fn new(w: &Workload, seed: u64, lo: u32, hi: u32) -> Self {
        match w {
            Workload::Chat(p) => {
                let system = TokenRng::new(seed, lo, hi).take(p.system_tokens);
                let questions = (0..p.users)
                    .map(|u| {
                        let mut rng = TokenRng::new(seed ^ (1000 + u as u64), lo, hi);
                        (0..p.rounds).map(|_| rng.take(p.question_tokens)).collect()
                    })
                    .collect();
                Script {
                    stream_prefix: vec![system; p.users],
                    questions,
                    carries_history: true,
                    answer_tokens: p.answer_tokens,
                }
            }
            Workload::DocQa(p) => {
                let docs = (0..p.docs)
                    .map(|d| TokenRng::new(seed ^ (5000 + d as u64), lo, hi).take(p.doc_tokens))
                    .collect();
                let questions = (0..p.docs)
                    .map(|d| {
                        let mut rng = TokenRng::new(seed ^ (9000 + d as u64), lo, hi);
                        (0..p.questions_per_doc)
                            .map(|_| rng.take(p.question_tokens))
                            .collect()
                    })
                    .collect();
                Script {
                    stream_prefix: docs,
                    questions,
                    carries_history: false,
                    answer_tokens: p.answer_tokens,
                }
            }
        }
    }

    /// Number of streams (users or documents).
    pub fn streams(&self) -> usize {
        self.stream_prefix.len()
    }

    /// Turns per stream.
    pub fn turns(&self, stream: usize) -> usize {
        self.questions.get(stream).map_or(0, Vec::len)
    }
}

/// A stream's running conversation.
#[derive(Debug, Clone, Default)]
pub struct History {
    /// The stream's prompt so far (prefix, questions and answers).
    pub tokens: Vec<u32>,
    /// The next turn to ask.
    pub next_turn: usize,
}

impl History {
    /// The prompt for the stream's next turn.
    pub fn prompt(&self, script: &Script, stream: usize) -> Vec<u32> {
        let q = &script.questions[stream][self.next_turn];
        let mut p = if script.carries_history && self.next_turn > 0 {
            self.tokens.clone()
        } else {
            script.stream_prefix[stream].clone()
        };
        p.extend_from_slice(q);
        p
    }

    /// Records the answer to the prompt returned by [`History::prompt`].
    pub fn answered(&mut self, prompt: Vec<u32>, answer: &[u32]) {
        self.tokens = prompt;
        self.tokens.extend_from_slice(answer);
        self.next_turn += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat() -> Workload {
        Workload::Chat(ChatParams {
            users: 2,
            rounds: 3,
            system_tokens: 8,
            question_tokens: 4,
            answer_tokens: 2,
            qps: 10.0,
        })
    }

    #[test]
    fn rng_is_deterministic_and_in_range() {
        let a = TokenRng::new(7, 32, 127).take(1000);
        let b = TokenRng::new(7, 32, 127).take(1000);
        assert_eq!(a, b);
        assert!(a.iter().all(|&t| (32..127).contains(&t)));
        assert_ne!(a, TokenRng::new(8, 32, 127).take(1000));
        // roughly uniform: every value appears
        assert_eq!(
            a.iter().collect::<std::collections::BTreeSet<_>>().len(),
            95
        );
    }

    #[test]
    fn chat_history_grows_and_shares_the_system_prompt() {
        let w = chat();
        let s = Script::new(&w, 1, 32, 127);
        assert_eq!(s.streams(), 2);
        let mut h = History::default();
        let p0 = h.prompt(&s, 0);
        assert_eq!(p0.len(), 12);
        assert_eq!(&p0[..8], &s.stream_prefix[1][..]);
        h.answered(p0.clone(), &[1, 2]);
        let p1 = h.prompt(&s, 0);
        assert_eq!(p1.len(), 12 + 2 + 4);
        assert_eq!(&p1[..12], &p0[..]);
        assert_eq!(&p1[12..14], &[1, 2]);
        assert_eq!(w.max_sequence_len(), 8 + 3 * 6);
        assert_eq!(w.num_requests(), 6);
    }

    #[test]
    fn docqa_prompts_are_doc_plus_question() {
        let w = Workload::DocQa(DocQaParams {
            docs: 3,
            doc_tokens: 10,
            questions_per_doc: 2,
            question_tokens: 3,
            answer_tokens: 2,
            qps: 1.0,
        });
        let s = Script::new(&w, 1, 32, 127);
        let mut h = History::default();
        let p0 = h.prompt(&s, 2);
        h.answered(p0.clone(), &[5, 5]);
        let p1 = h.prompt(&s, 2);
        assert_eq!(p1.len(), 13);
        assert_eq!(&p0[..10], &p1[..10]);
        assert_ne!(&p0[10..], &p1[10..]);
        assert_ne!(s.stream_prefix[0], s.stream_prefix[1]);
    }
}
