//! Fuzz drivers: what the libFuzzer targets in `fuzz_targets/` run on each input, and what the workspace's
//! regression test (`shard/tests/fuzz_regressions.rs`) replays over the committed corpus. Only std,
//! gaps-common, gaps-kernels and gaps-shard are used here, so the test can include this file as a module.
//!
//! The drivers panic (which libFuzzer reports as a crash) only when an invariant breaks: the decoder, the
//! certificate reader or the core panicked, an identity does not read back from its own URI, a reply
//! cannot be encoded, a decoded frame does not re-encode to itself, the push books do not balance, or a
//! checkpoint does not restore to the same state.

use gaps_common::dtype::WireDtype;
use gaps_common::layout::{ChunkId, Layout, SparseSpec, TensorSpec};
use gaps_common::wire::{
    self, ids_to_words, CheckpointAt, CheckpointRequest, Frame, Heartbeat, Leave, Limits, Message, Pull, Push,
    PushChunk, PushPart, Register, RegisterShard, Role, SparsePull, SparsePush, StatsRequest, Step, PROTOCOL_VERSION,
};
use gaps_kernels::Rule;
use gaps_shard::modes::{Mode, ModeConfig};
use gaps_shard::stripes::Assembler;
use gaps_shard::{ShardConfig, ShardCore, SparseSettings};
use std::time::Duration;

const EPOCH: u64 = 3;

/// Limits small enough that a fuzz input cannot make the decoder allocate much.
fn limits() -> Limits {
    Limits { max_payload_bytes: 1 << 16, ..Limits::default() }
}

/// Reads choices from the fuzz input; past its end every choice is 0.
struct Choices<'a> {
    data: &'a [u8],
}

impl<'a> Choices<'a> {
    fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((b, rest)) => {
                self.data = rest;
                *b
            }
            None => 0,
        }
    }

    /// A number below `n` (n ≥ 1) from one or two bytes.
    fn below(&mut self, n: u64) -> u64 {
        let raw = if n <= 256 { u64::from(self.byte()) } else { u64::from(self.byte()) << 8 | u64::from(self.byte()) };
        raw % n.max(1)
    }

    fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }

    fn float(&mut self) -> f32 {
        match self.byte() {
            0 => f32::NAN,
            1 => f32::INFINITY,
            2 => f32::NEG_INFINITY,
            3 => -1e30,
            4 => f32::MIN_POSITIVE / 2.0,
            b => (f32::from(b) - 128.0) / 64.0,
        }
    }

    fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// Certificate identity (`gaps_common::identity`, on the path of every connection's authorization): any
/// bytes give an identity, a validity period or a typed error, never a panic; an identity found is named by
/// one of the certificate's URIs, reads back the same from its own URI, and carries only valid names.
pub fn identity(data: &[u8]) {
    use gaps_common::identity::{identity_of, is_valid_name, san_uris, validity, PeerIdentity, Role};
    let uris = san_uris(data);
    if let Ok(id) = identity_of(data) {
        let uris = uris.expect("an identity is read from the certificate's URIs");
        assert!(uris.iter().any(|u| PeerIdentity::from_uri(u).as_ref() == Some(&id)), "{id} from {uris:?}");
        assert_eq!(PeerIdentity::from_uri(&id.uri()).as_ref(), Some(&id), "{id} reads back");
        assert!(is_valid_name(&id.cluster), "{id}");
        if let Role::Worker(name) = &id.role {
            assert!(is_valid_name(name), "{id}");
        }
    }
    if let Ok((from, to)) = validity(data) {
        // Any order is a period the caller refuses or accepts; only the arithmetic must hold.
        let _ = to.checked_sub(from);
    }
}

/// Bytes read as a backup's copy of a shard (`ShardCore::from_copy`): never a panic; a copy that reads copies
/// back to the same bytes.
fn copy_bytes(data: &[u8]) {
    let cfg = config(Rule::Momentum, Mode::Sync, 0, 1, 0);
    if let Ok(core) = ShardCore::from_copy(cfg, data) {
        let again = core.copy_state().expect("a copy");
        let cfg = config(Rule::Momentum, Mode::Sync, 0, 1, 0);
        let twice = ShardCore::from_copy(cfg, &again).expect("a copy's copy reads").copy_state().expect("a copy");
        assert_eq!(again, twice, "from_copy ∘ copy_state is not stable");
    }
}

/// Frame decoder: any bytes decode to a frame or a typed error, and a decoded frame re-encodes to bytes
/// that decode to the same frame; read as a replication log entry, the same holds.
pub fn frame_decoder(data: &[u8]) {
    log_entry(data);
    // A frame behind a log entry's prefix, so that the entry reader sees real frames too.
    if data.len() > 17 {
        log_entry(&[&[1, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 1][..], data].concat());
    }
    let limits = limits();
    let Ok(frame) = wire::decode_frame(data, &limits) else { return };
    let once = wire::encode_frame(&frame).expect("a decoded frame re-encodes");
    let again = wire::decode_frame(&once, &limits).expect("a re-encoded frame decodes");
    let twice = wire::encode_frame(&again).expect("a re-encoded frame re-encodes");
    assert_eq!(once, twice, "decode ∘ encode is not stable for {frame:?}");
}

/// The same bytes read as a replication log entry (`gaps_shard::replica::LogEntry`, a frame behind an index,
/// a clock and a kind): a typed error or an entry that re-encodes to bytes reading back the same.
fn log_entry(data: &[u8]) {
    use gaps_shard::replica::LogEntry;
    let limits = limits();
    let Ok(entry) = LogEntry::decode(data, &limits) else { return };
    let once = entry.encode().expect("a decoded entry re-encodes");
    let again = LogEntry::decode(&once, &limits).expect("a re-encoded entry decodes");
    assert_eq!(again.encode().expect("re-encodes"), once, "decode ∘ encode is not stable for an entry");
}

const RULES: [Rule; 8] = [
    Rule::Momentum,
    Rule::DanaZero,
    Rule::Adam,
    Rule::DcAsgdAdaptive,
    Rule::Sgd,
    Rule::Nesterov,
    Rule::MultiMomentum,
    Rule::Adagrad,
];
const MODES: [Mode; 5] = [Mode::Async, Mode::Sync, Mode::Gba, Mode::Ssp, Mode::Auto];

fn config(rule: Rule, mode: Mode, shard: u32, num_shards: u32, admit_after: u32) -> ShardConfig {
    let mut gated = TensorSpec::new("g", 9);
    gated.rule.rule = Some("gap-aware".into());
    let layout =
        Layout::with_tables(vec![TensorSpec::new("w", 50), gated], 16, vec![SparseSpec::new("e", 3)]).expect("layout");
    ShardConfig {
        shard,
        num_shards,
        rule,
        lease: Duration::from_secs(5),
        sparse: SparseSettings { admit_after, memory_budget: Some(64 << 10), ..SparseSettings::default() },
        modes: ModeConfig { mode, ..ModeConfig::default() },
        ..gaps_shard::testnet::config(layout, EPOCH)
    }
}

/// One request chosen by the input: usually well-formed enough to reach deep into the core, often not.
fn request(c: &mut Choices<'_>, layout: &Layout, chunks: &[ChunkId]) -> Option<Frame> {
    let epoch = if c.below(16) == 0 { EPOCH + c.below(3) - 1 } else { EPOCH };
    let worker = c.below(4) as u32;
    let some_chunks = |c: &mut Choices<'_>| -> Vec<ChunkId> {
        let n = c.below(chunks.len() as u64 + 2) as usize;
        (0..n)
            .map(|_| match c.below(chunks.len() as u64 + 1) as usize {
                i if i < chunks.len() => chunks[i],
                _ => ChunkId { tensor: c.below(4) as u32, chunk: c.below(6) as u32 },
            })
            .collect()
    };
    Some(match c.below(13) {
        0 => Frame::new(Message::Pull(Pull { epoch, chunks: some_chunks(c) })),
        // 2: the push as a push-pull (answered with the pushed chunks' values).
        kind @ (1 | 2) => {
            let ids = some_chunks(c);
            let push_chunks: Vec<PushChunk> = ids
                .iter()
                // Every field drawn in this order (the committed corpus decodes by it).
                .map(|id| PushChunk {
                    id: *id,
                    read_version: c.below(6),
                    len: match layout.chunk_len(*id) {
                        Ok(n) if c.below(12) != 0 => n as u32,
                        _ => c.below(20) as u32,
                    },
                    echo: if c.below(12) == 0 { c.below(2) == 0 } else { id.tensor == 1 },
                    dtype: [WireDtype::F32, WireDtype::Bf16, WireDtype::F16][c.below(3) as usize],
                })
                .collect();
            let declared: usize = push_chunks.iter().map(|p| p.len as usize * (1 + usize::from(p.echo))).sum();
            let carried = if c.below(12) == 0 { c.below(declared as u64 + 3) as usize } else { declared };
            let payload = (0..carried).map(|_| c.float()).collect();
            let seq = c.below(64);
            let compute_ms = c.below(64) as u32;
            let push = Push { compute_ms, ..Push::new(epoch, worker, seq, push_chunks) };
            Frame { msg: if kind == 2 { Message::PushPull(push) } else { Message::Push(push) }, payload }
        }
        3 => {
            let count = c.below(6) as u32;
            let ids: Vec<u64> = (0..count).map(|_| c.below(12)).collect();
            let mut payload = Vec::new();
            ids_to_words(&ids, &mut payload);
            if c.below(10) == 0 {
                payload.pop();
            }
            let msg = SparsePull { epoch, table: c.below(2) as u32, count, create: c.below(2) == 0 };
            Frame { msg: Message::SparsePull(msg), payload }
        }
        4 => {
            let count = c.below(5) as u32;
            let dim = if c.below(10) == 0 { 4 } else { 3 };
            let echo_read = c.below(10) == 0;
            let ids: Vec<u64> = (0..count).map(|_| c.below(12)).collect();
            let mut payload = Vec::new();
            ids_to_words(&ids, &mut payload);
            payload.extend((0..count).map(|_| f32::from_bits(c.below(5) as u32)));
            payload.extend((0..count * dim * (1 + u32::from(echo_read))).map(|_| c.float()));
            let (seq, table) = (c.below(64), c.below(2) as u32);
            let msg = SparsePush { epoch, worker, seq, table, count, dim, echo_read };
            Frame { msg: Message::SparsePush(msg), payload }
        }
        5 => Frame::new(Message::Register(Register {
            protocol: if c.below(10) == 0 { 1 } else { PROTOCOL_VERSION },
            role: if c.below(3) == 0 { Role::Observer } else { Role::Worker },
            name: "f".into(),
        })),
        6 => Frame::new(Message::Heartbeat(Heartbeat { worker })),
        7 => Frame::new(Message::Leave(Leave { worker })),
        8 => Frame::new(Message::StatsRequest(StatsRequest)),
        9 => Frame::new(Message::RegisterShard(RegisterShard {
            protocol: PROTOCOL_VERSION,
            shard: c.below(3) as u32,
            num_shards: 1 + c.below(2) as u32,
            addr: "peer".into(),
            layout_fingerprint: if c.below(2) == 0 { layout.fingerprint() } else { c.below(1 << 16) },
        })),
        10 => Frame::new(Message::CheckpointRequest(CheckpointRequest {
            id: c.below(3),
            at: match c.below(3) {
                0 => CheckpointAt::Now,
                1 => CheckpointAt::Quiescent,
                _ => CheckpointAt::Step(c.below(8)),
            },
        })),
        // A worker's step made of requests drawn as above: a row push, a dense push, a row pull, where the
        // draws give those (any other kind leaves that part out; no dense push, no step).
        11 => {
            let (rows, push, next) =
                (request(c, layout, chunks), request(c, layout, chunks), request(c, layout, chunks));
            let Some(Frame { msg: Message::Push(push) | Message::PushPull(push), payload: pushed }) = push else {
                return None;
            };
            let (rows, rows_payload) = match rows {
                Some(Frame { msg: Message::SparsePush(r), payload }) => (Some(r), payload),
                _ => (None, Vec::new()),
            };
            let (next_rows, ids) = match next {
                Some(Frame { msg: Message::SparsePull(n), payload }) => (Some(n), payload),
                _ => (None, Vec::new()),
            };
            Frame { msg: Message::Step(Step { rows, push, next_rows }), payload: [rows_payload, pushed, ids].concat() }
        }
        // Raw bytes through the decoder: whatever decodes is handled like any other request.
        _ => {
            let len = c.below(96) as usize;
            return wire::decode_frame(c.bytes(len), &limits()).ok();
        }
    })
}

/// Every reply must encode and decode.
fn check_reply(reply: &Frame) {
    let bytes = wire::encode_frame(reply).unwrap_or_else(|e| panic!("a reply that cannot be sent: {e}"));
    wire::decode_frame(&bytes, &Limits { max_payload_bytes: u64::MAX, ..Limits::default() })
        .unwrap_or_else(|e| panic!("a reply that does not decode: {e}"));
}

/// Cuts `push` into parts by chunk (each part's payload: its gradients, then its echoes, where the whole
/// payload had them), in an order the input picks, sometimes with a part twice, one missing, or one part's
/// count or index wrong.
fn split_push(c: &mut Choices<'_>, push: Push, payload: Vec<f32>) -> Vec<(PushPart, Vec<f32>)> {
    let n = push.chunks.len();
    let parts = (2 + c.below(3) as usize).min(n.max(2));
    let grad_total: usize = push.chunks.iter().map(|p| p.len as usize).sum();
    let (mut grad_at, mut read_at) = (0usize, grad_total);
    let mut out = Vec::new();
    for i in 0..parts {
        let chunks: Vec<PushChunk> =
            push.chunks.iter().skip(i * n / parts).take((i + 1) * n / parts - i * n / parts).copied().collect();
        let grads: usize = chunks.iter().map(|p| p.len as usize).sum();
        let reads: usize = chunks.iter().filter(|p| p.echo).map(|p| p.len as usize).sum();
        let mut mine: Vec<f32> = payload.get(grad_at..grad_at + grads).map(<[f32]>::to_vec).unwrap_or_default();
        mine.extend(payload.get(read_at..read_at + reads).map(<[f32]>::to_vec).unwrap_or_default());
        grad_at += grads;
        read_at += reads;
        let mut part = PushPart { part: i as u16, parts: parts as u16, push: Push { chunks, ..push.clone() } };
        match c.below(24) {
            0 => part.parts = c.below(4) as u16,
            1 => part.part = c.below(6) as u16,
            2 => part.push.step += 1,
            _ => {}
        }
        out.push((part, mine));
    }
    // A few swaps, then perhaps a duplicate or a loss.
    for _ in 0..c.below(4) {
        let (a, b) = (c.below(out.len() as u64) as usize, c.below(out.len() as u64) as usize);
        out.swap(a, b);
    }
    match c.below(8) {
        0 => {
            let again = out[c.below(out.len() as u64) as usize].clone();
            out.push(again);
        }
        1 => {
            out.pop();
        }
        _ => {}
    }
    out
}

/// The core under test and, when asked, a twin whose dense state is resident in host arenas (the executor a
/// GPU shard runs, `gaps_kernels::resident::HostDevice`), fed the same requests: every reply, event and
/// checkpoint must agree bit for bit.
struct Cores {
    core: ShardCore,
    twin: Option<ShardCore>,
}

/// Worker stripes of the twin: the four workers the inputs use and the synchronous step.
const TWIN_STRIPES: u32 = 5;

fn resident(mut core: ShardCore) -> ShardCore {
    core.make_resident(gaps_kernels::resident::HostDevice, TWIN_STRIPES).expect("resident state");
    core
}

impl Cores {
    fn handle(&mut self, frame: Frame, now: Duration) -> Frame {
        let twin = self.twin.as_mut().map(|t| t.handle(frame.clone(), now));
        let (reply, events) = self.core.handle(frame, now);
        if let Some((twin_reply, twin_events)) = twin {
            assert_eq!(twin_reply, reply, "the device-resident state answers differently");
            assert_eq!(twin_events, events, "the device-resident state reports different events");
        }
        reply
    }

    fn tick(&mut self, now: Duration) {
        let events = self.core.tick(now);
        if let Some(t) = self.twin.as_mut() {
            assert_eq!(t.tick(now), events, "the device-resident state expires differently");
        }
    }

    fn checkpoint(&self, id: u64) -> Vec<u8> {
        let bytes = self.core.checkpoint(id).expect("checkpoint");
        if let Some(t) = &self.twin {
            assert!(t.checkpoint(id).expect("resident checkpoint") == bytes, "the device-resident state differs");
        }
        bytes
    }

    fn restore(&mut self, cfg: ShardConfig, bytes: &[u8]) {
        let twin = self.twin.is_some();
        self.core = ShardCore::restore(cfg.clone(), bytes).unwrap_or_else(|e| panic!("restore: {e}"));
        if twin {
            let t = ShardCore::restore(cfg, bytes).unwrap_or_else(|e| panic!("restore: {e}"));
            self.twin = Some(resident(t));
        }
    }
}

/// Shard core: a sequence of requests, ticks, and checkpoint round trips chosen by the input. Nothing may
/// panic, every reply must encode, every push is counted exactly once as applied, duplicate or refused, and
/// a checkpoint restores to a core that checkpoints to the same bytes (and keeps serving). Returns the
/// core's counters.
pub fn shard_core(data: &[u8]) -> wire::Stats {
    // The same bytes as a copy from a primary (a shard certificate's snapshot): a typed error or a core.
    copy_bytes(data);
    drive_shard_core(data, false)
}

/// [`shard_core`] with a twin core whose dense state is resident in host arenas, checked against the
/// plain core after every request.
pub fn shard_core_resident(data: &[u8]) -> wire::Stats {
    drive_shard_core(data, true)
}

fn drive_shard_core(data: &[u8], twin: bool) -> wire::Stats {
    let mut c = Choices { data };
    let rule = RULES[c.below(RULES.len() as u64) as usize];
    let mode = MODES[c.below(MODES.len() as u64) as usize];
    let (shard, num_shards) = if c.below(4) == 0 { (1, 2) } else { (0, 1) };
    // Admission keeps a 4 MiB sketch per table (10 ms per input to make, copy and compare): one input in 16
    // has it, the rest run 400 times faster.
    let admit_after = if c.below(16) == 0 { 2 } else { 0 };
    let cfg = || config(rule, mode, shard, num_shards, admit_after);
    let core = ShardCore::new(cfg()).expect("core");
    let layout = core.config().layout.clone();
    let chunks: Vec<ChunkId> = layout.chunks().filter(|id| core.chunk_values(*id).is_ok()).collect();
    let twin = twin.then(|| resident(ShardCore::new(cfg()).expect("core")));
    let mut cores = Cores { core, twin };
    let mut pushes = 0u64;
    let mut now_ms = 0u64;
    // Striped pushes go through the assembler as the service's actor runs it; the token is the part index.
    let mut parts: Assembler<u16> = Assembler::default();
    for _ in 0..400 {
        if c.is_empty() {
            break;
        }
        now_ms += c.below(2000);
        let now = Duration::from_millis(now_ms);
        match c.below(64) {
            0..=2 => {
                cores.tick(now);
            }
            4..=6 => {
                // A push cut into parts, offered in an order the input picks (a part may come twice, one may
                // never come, a part may be malformed); a completed push is handled whole, once.
                let Some(Frame { msg: Message::Push(push), payload }) = request(&mut c, &layout, &chunks) else {
                    continue;
                };
                let pieces = split_push(&mut c, push, payload);
                for (part, payload) in pieces {
                    let index = part.part;
                    let (worker, seq) = (part.push.worker, part.push.seq);
                    let offered = if cores.core.push_applied(worker, seq) {
                        pushes += 1;
                        let reply = cores.handle(Frame { msg: Message::PushPart(part), payload }, now);
                        check_reply(&reply);
                        continue;
                    } else {
                        parts.offer(part, payload, index, now)
                    };
                    for (_, reply) in &offered.answer_now {
                        check_reply(reply);
                    }
                    if let Some((whole, tokens)) = offered.whole {
                        assert!(!tokens.is_empty(), "a whole push without parts");
                        pushes += 1;
                        let reply = cores.handle(whole, now);
                        check_reply(&reply);
                    }
                }
                for (_, reply) in parts.expire(now, Duration::from_secs(60)) {
                    check_reply(&reply);
                }
            }
            3 => {
                let bytes = cores.checkpoint(7);
                cores.restore(cfg(), &bytes);
                assert_eq!(cores.checkpoint(7), bytes, "{rule} {mode}: a restored core checkpoints differently");
                // A backup's copy (replicated shards) continues the core exactly: it copies to the same bytes.
                let copy = cores.core.copy_state().expect("a copy");
                let continued =
                    ShardCore::from_copy(cfg(), &copy).unwrap_or_else(|e| panic!("{rule} {mode}: from a copy: {e}"));
                assert_eq!(continued.copy_state().expect("a copy"), copy, "{rule} {mode}: a copy copies differently");
            }
            _ => {
                let Some(frame) = request(&mut c, &layout, &chunks) else { continue };
                pushes += match &frame.msg {
                    Message::Push(_) | Message::PushPull(_) | Message::SparsePush(_) => 1,
                    // A step counts as its pushes.
                    Message::Step(s) => 1 + u64::from(s.rows.is_some()),
                    _ => 0,
                };
                let reply = cores.handle(frame, now);
                check_reply(&reply);
            }
        }
    }
    let s = cores.core.stats();
    assert_eq!(s.pushes_applied + s.pushes_duplicate + s.pushes_rejected, pushes, "{rule} {mode}: {s:?}");
    let bytes = cores.checkpoint(1);
    let restored = ShardCore::restore(cfg(), &bytes).unwrap_or_else(|e| panic!("{rule} {mode}: restore: {e}"));
    assert_eq!(restored.checkpoint(1).expect("checkpoint"), bytes, "{rule} {mode}");
    s
}
