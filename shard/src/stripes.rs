//! Reassembly of pushes striped over several connections ([`PushPart`]).
//!
//! A worker cuts a large push to one shard into parts by chunk and sends each on its own connection, so that
//! the packet work of one push is spread over several connection drivers (one QUIC connection is processed
//! by one task, which bounded a bulk push to what one core encrypts or decrypts). The shard must still apply
//! the push exactly once and as one step: the [`Assembler`] holds the parts of `(worker, seq)` until all are
//! there and hands back one whole [`Push`] (chunks in part order, payload laid out as a whole push's), with
//! every part's reply token, so that the caller answers each part with the whole push's reply.
//!
//! Bounds: at most [`MAX_PENDING_PER_WORKER`] incomplete pushes per worker (the oldest is given up when a
//! newer one starts beyond that); parts held longer than the caller's limit are given up by
//! [`Assembler::expire`]. A part sent again (its first connection failed) replaces the held copy. Held
//! payload bytes stay counted by the service's in-flight budget, since every part's request waits for its
//! reply. Sans-IO like the rest of this crate: time is an argument.

use gaps_common::wire::{ErrorCode, Frame, Message, Push, PushPart, MAX_PUSH_PARTS};
use std::collections::HashMap;
use std::time::Duration;

/// Incomplete striped pushes one worker may have at a shard at once.
pub const MAX_PENDING_PER_WORKER: usize = 4;

/// One incomplete push: its parts so far, each with its payload and reply token.
#[derive(Debug)]
struct Pending<R> {
    parts: Vec<Option<(Push, Vec<f32>, R)>>,
    /// When its first part arrived.
    since: Duration,
}

/// What became of an offered part.
#[derive(Debug)]
pub struct Offered<R> {
    /// The whole push when this part completed it (to handle as one request), with every part's token in
    /// part order (then the token of a copy this part replaced): each is answered with the whole reply.
    pub whole: Option<(Frame, Vec<R>)>,
    /// Tokens to answer now with these replies: the offered part when it is refused (malformed, or
    /// inconsistent with the parts held), a held copy it superseded, parts of a push given up for it.
    pub answer_now: Vec<(R, Frame)>,
}

impl<R> Offered<R> {
    fn refused(reply: R, code: ErrorCode, message: String) -> Self {
        Offered { whole: None, answer_now: vec![(reply, refusal(code, message))] }
    }
}

/// Holds the parts of striped pushes until each push is complete.
#[derive(Debug)]
pub struct Assembler<R> {
    pending: HashMap<(u32, u64), Pending<R>>,
}

impl<R> Default for Assembler<R> {
    fn default() -> Self {
        Assembler { pending: HashMap::new() }
    }
}

fn refusal(code: ErrorCode, message: String) -> Frame {
    Frame::new(Message::error(code, message))
}

/// The fields every part of one push must agree on.
fn same_push(a: &Push, b: &Push) -> bool {
    a.epoch == b.epoch
        && a.worker == b.worker
        && a.seq == b.seq
        && a.step == b.step
        && a.compute_ms == b.compute_ms
        && a.decisions == b.decisions
}

impl<R> Assembler<R> {
    /// Incomplete pushes held now.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Payload values held now (all parts of all incomplete pushes).
    pub fn held_values(&self) -> usize {
        self.pending.values().flat_map(|p| p.parts.iter().flatten()).map(|(_, v, _)| v.len()).sum()
    }

    /// Takes one part (its payload as read: its chunks' gradients, then their echoes) arriving at `now`.
    pub fn offer(&mut self, part: PushPart, payload: Vec<f32>, reply: R, now: Duration) -> Offered<R> {
        let PushPart { part: index, parts, push } = part;
        if !(2..=MAX_PUSH_PARTS).contains(&parts) || index >= parts {
            let why = format!("push part {index} of {parts}: a push is cut into 2 to {MAX_PUSH_PARTS} parts");
            return Offered::refused(reply, ErrorCode::WrongShape, why);
        }
        let expected: u64 = push.chunks.iter().map(|c| u64::from(c.len) * (1 + u64::from(c.echo))).sum();
        if payload.len() as u64 != expected {
            let why = format!("push part {index} declares {expected} values but carries {}", payload.len());
            return Offered::refused(reply, ErrorCode::WrongShape, why);
        }
        let key = (push.worker, push.seq);
        let mut answer_now = Vec::new();
        if let Some(entry) = self.pending.get(&key) {
            if entry.parts.len() != usize::from(parts) {
                let why = format!("push part {index} says {parts} parts, an earlier part said {}", entry.parts.len());
                return Offered::refused(reply, ErrorCode::WrongShape, why);
            }
            if entry.parts.iter().flatten().next().is_some_and(|(first, _, _)| !same_push(first, &push)) {
                let why = format!("push part {index} of ({}, {}) disagrees with its other parts", key.0, key.1);
                return Offered::refused(reply, ErrorCode::WrongShape, why);
            }
        } else {
            // Beyond the bound, the worker's oldest incomplete push is given up (its client moved on or died).
            loop {
                let mine = self.pending.iter().filter(|(k, _)| k.0 == key.0);
                if mine.clone().count() < MAX_PENDING_PER_WORKER {
                    break;
                }
                let Some(oldest) = mine.min_by_key(|(k, p)| (p.since, k.1)).map(|(k, _)| *k) else { break };
                let why = format!(
                    "worker {} began more than {MAX_PENDING_PER_WORKER} striped pushes without completing them; \
                     push {} was given up",
                    key.0, oldest.1
                );
                if let Some(p) = self.pending.remove(&oldest) {
                    let given_up = p.parts.into_iter().flatten();
                    answer_now.extend(given_up.map(|(_, _, r)| (r, refusal(ErrorCode::Internal, why.clone()))));
                }
            }
            self.pending.insert(key, Pending { parts: (0..parts).map(|_| None).collect(), since: now });
        }
        let Some(entry) = self.pending.get_mut(&key) else { return Offered { whole: None, answer_now } };
        // A part sent again (its first connection failed) replaces the held copy.
        let old = entry.parts[usize::from(index)].replace((push, payload, reply)).map(|(_, _, r)| r);
        if entry.parts.iter().any(Option::is_none) {
            if let Some(r) = old {
                let why =
                    format!("push part {index} of ({}, {}) was sent again; this copy is superseded", key.0, key.1);
                answer_now.push((r, refusal(ErrorCode::Internal, why)));
            }
            return Offered { whole: None, answer_now };
        }
        let Some(done) = self.pending.remove(&key) else { return Offered { whole: None, answer_now } };
        let mut tokens = Vec::with_capacity(done.parts.len() + 1);
        let mut heads = Vec::with_capacity(done.parts.len());
        let mut payloads = Vec::with_capacity(done.parts.len());
        for (head, payload, token) in done.parts.into_iter().flatten() {
            heads.push(head);
            payloads.push(payload);
            tokens.push(token);
        }
        tokens.extend(old);
        Offered { whole: Some((merge(heads, payloads), tokens)), answer_now }
    }

    /// Gives up the incomplete pushes whose first part arrived `limit` or longer before `now`: their tokens
    /// and the error reply to answer them with.
    pub fn expire(&mut self, now: Duration, limit: Duration) -> Vec<(R, Frame)> {
        let old: Vec<(u32, u64)> =
            self.pending.iter().filter(|(_, p)| now.saturating_sub(p.since) >= limit).map(|(k, _)| *k).collect();
        let mut out = Vec::new();
        for key in old {
            if let Some(p) = self.pending.remove(&key) {
                let have = p.parts.iter().flatten().count();
                let why = format!(
                    "push ({}, {}) got {have} of its {} parts within {limit:?}; the others never came",
                    key.0,
                    key.1,
                    p.parts.len()
                );
                for (_, _, r) in p.parts.into_iter().flatten() {
                    out.push((r, refusal(ErrorCode::Internal, why.clone())));
                }
            }
        }
        out
    }
}

/// One whole push from its parts (part order): the chunks in order, the payload every gradient then every
/// echo, as a push sent whole lays it out.
fn merge(heads: Vec<Push>, payloads: Vec<Vec<f32>>) -> Frame {
    let grad_len = |h: &Push| h.chunks.iter().map(|c| c.len as usize).sum::<usize>();
    let total: usize = payloads.iter().map(Vec::len).sum();
    let mut payload = gaps_common::buffers::take(total);
    for (h, p) in heads.iter().zip(&payloads) {
        payload.extend_from_slice(&p[..grad_len(h).min(p.len())]);
    }
    for (h, p) in heads.iter().zip(&payloads) {
        payload.extend_from_slice(&p[grad_len(h).min(p.len())..]);
    }
    payloads.into_iter().for_each(gaps_common::buffers::give);
    let mut heads = heads.into_iter();
    let mut whole = heads.next().expect("at least two parts");
    for h in heads {
        whole.chunks.extend(h.chunks);
    }
    Frame { msg: Message::Push(whole), payload }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gaps_common::dtype::WireDtype;
    use gaps_common::layout::ChunkId;
    use gaps_common::wire::PushChunk;

    fn chunk(c: u32, len: u32, echo: bool) -> PushChunk {
        PushChunk { id: ChunkId { tensor: 0, chunk: c }, read_version: 0, len, echo, dtype: WireDtype::F32 }
    }

    fn push(seq: u64, chunks: Vec<PushChunk>) -> Push {
        Push { epoch: 3, worker: 7, seq, chunks, compute_ms: 5, step: 2, decisions: Default::default(), data: None }
    }

    /// Part `i` of 3 of push `seq`: chunk i of 2 values (grad i.0, i.1; echo 10+i.0, 10+i.1 on chunk 1).
    fn part(seq: u64, i: u16) -> (PushPart, Vec<f32>) {
        let echo = i == 1;
        let f = f32::from(i);
        let mut payload = vec![f, f + 0.5];
        if echo {
            payload.extend([10.0 + f, 10.5 + f]);
        }
        (PushPart { part: i, parts: 3, push: push(seq, vec![chunk(u32::from(i), 2, echo)]) }, payload)
    }

    #[test]
    fn parts_in_any_order_make_one_whole_push_laid_out_as_if_sent_whole() {
        let mut a: Assembler<u32> = Assembler::default();
        for (t, i) in [(0u32, 2u16), (1, 0)] {
            let (p, v) = part(1, i);
            let o = a.offer(p, v, t, Duration::from_secs(1));
            assert!(o.whole.is_none() && o.answer_now.is_empty());
        }
        assert_eq!((a.pending(), a.held_values()), (1, 4));
        let (p, v) = part(1, 1);
        let o = a.offer(p, v, 2, Duration::from_secs(2));
        let (whole, tokens) = o.whole.expect("complete");
        assert_eq!(tokens, vec![1, 2, 0], "part order");
        assert_eq!(whole.msg.payload_elems(), whole.payload.len() as u64);
        let Message::Push(w) = whole.msg else { panic!("a push") };
        assert_eq!(w.chunks.iter().map(|c| c.id.chunk).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!((w.worker, w.seq, w.step, w.compute_ms), (7, 1, 2, 5));
        // Every gradient in chunk order, then the echoes.
        assert_eq!(whole.payload, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 11.0, 11.5]);
        assert_eq!(a.pending(), 0);
    }

    #[test]
    fn a_part_sent_again_replaces_the_held_copy_and_both_get_the_reply() {
        let mut a: Assembler<u32> = Assembler::default();
        let (p, v) = part(4, 0);
        assert!(a.offer(p, v, 10, Duration::ZERO).answer_now.is_empty());
        // Sent again while the others are missing: the old copy's request is answered now (superseded).
        let (p, v) = part(4, 0);
        let o = a.offer(p, v, 11, Duration::ZERO);
        assert_eq!(o.answer_now.len(), 1);
        assert_eq!(o.answer_now[0].0, 10);
        assert!(matches!(o.answer_now[0].1.msg, Message::Error(_)));
        let (p, v) = part(4, 1);
        assert!(a.offer(p, v, 12, Duration::ZERO).whole.is_none());
        let (p, v) = part(4, 2);
        let (_, tokens) = a.offer(p, v, 13, Duration::ZERO).whole.expect("complete");
        assert_eq!(tokens, vec![11, 12, 13]);
    }

    #[test]
    fn malformed_and_inconsistent_parts_are_refused_without_disturbing_the_held_ones() {
        let mut a: Assembler<u32> = Assembler::default();
        let refused = |o: Offered<u32>, token: u32| {
            assert!(o.whole.is_none());
            assert_eq!(o.answer_now.len(), 1);
            assert_eq!(o.answer_now[0].0, token);
            match &o.answer_now[0].1.msg {
                Message::Error(e) => assert_eq!(e.code, ErrorCode::WrongShape, "{}", e.message),
                other => panic!("{other:?}"),
            }
        };
        let (p, v) = part(9, 0);
        assert!(a.offer(p, v, 1, Duration::ZERO).answer_now.is_empty());
        // Index out of range, one part only, too many parts, payload of the wrong length.
        let (mut p, v) = part(9, 1);
        p.part = 3;
        refused(a.offer(p, v, 2, Duration::ZERO), 2);
        let (mut p, v) = part(9, 1);
        p.parts = 1;
        p.part = 0;
        refused(a.offer(p, v, 3, Duration::ZERO), 3);
        let (mut p, v) = part(9, 1);
        p.parts = MAX_PUSH_PARTS + 1;
        refused(a.offer(p, v, 4, Duration::ZERO), 4);
        let (p, mut v) = part(9, 1);
        v.pop();
        refused(a.offer(p, v, 5, Duration::ZERO), 5);
        // A different part count or step than the held part.
        let (mut p, v) = part(9, 1);
        p.parts = 4;
        refused(a.offer(p, v, 6, Duration::ZERO), 6);
        let (mut p, v) = part(9, 1);
        p.push.step = 99;
        refused(a.offer(p, v, 7, Duration::ZERO), 7);
        assert_eq!((a.pending(), a.held_values()), (1, 2), "the held part is untouched");
        for i in 1..3 {
            let (p, v) = part(9, i);
            let o = a.offer(p, v, 8, Duration::ZERO);
            assert_eq!(o.whole.is_some(), i == 2);
        }
    }

    #[test]
    fn incomplete_pushes_are_bounded_per_worker_and_expire() {
        let mut a: Assembler<u32> = Assembler::default();
        for seq in 1..=MAX_PENDING_PER_WORKER as u64 {
            let (p, v) = part(seq, 0);
            assert!(a.offer(p, v, seq as u32, Duration::from_secs(seq)).answer_now.is_empty());
        }
        // One more: the oldest (seq 1) is given up and its part answered.
        let (p, v) = part(100, 0);
        let o = a.offer(p, v, 100, Duration::from_secs(50));
        assert_eq!(o.answer_now.iter().map(|(t, _)| *t).collect::<Vec<_>>(), vec![1]);
        assert_eq!(a.pending(), MAX_PENDING_PER_WORKER);
        // Another worker is not affected by this one's bound.
        let (mut p, v) = part(1, 0);
        p.push.worker = 8;
        assert!(a.offer(p, v, 200, Duration::from_secs(50)).answer_now.is_empty());
        // Everything that waited 30 s or more by t = 40 s is given up: seqs 2..=4 (t = 2..4 s).
        let expired = a.expire(Duration::from_secs(40), Duration::from_secs(30));
        let mut tokens: Vec<u32> = expired.iter().map(|(t, _)| *t).collect();
        tokens.sort_unstable();
        assert_eq!(tokens, vec![2, 3, 4]);
        assert_eq!(a.pending(), 2);
        assert!(a.expire(Duration::from_secs(60), Duration::from_secs(30)).is_empty());
    }
}
