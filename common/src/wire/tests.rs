use super::*;

#[test]
fn bytes_travel_in_words_and_come_back_whole() {
    for len in 0..12usize {
        let bytes: Vec<u8> = (0..len as u8).map(|b| b.wrapping_mul(37).wrapping_add(200)).collect();
        let mut words = Vec::new();
        bytes_to_words(&bytes, &mut words);
        assert_eq!(words.len(), len.div_ceil(4));
        assert_eq!(words_to_bytes(&words, len as u64), Some(bytes.clone()));
        assert_eq!(words_to_bytes(&words, len as u64 + 4), None, "more bytes than the words hold");
    }
}
use crate::layout::TensorSpec;

fn samples() -> Vec<Frame> {
    let id = ChunkId { tensor: 1, chunk: 2 };
    let layout = Layout::new(vec![TensorSpec::new("w", 10)], 4).expect("layout");
    vec![
        Frame::new(Message::Register(Register { protocol: 1, role: Role::Worker, name: "w0".into() })),
        Frame::new(Message::RegisterShard(RegisterShard {
            protocol: 1,
            shard: 1,
            num_shards: 2,
            addr: "127.0.0.1:4000".into(),
            layout_fingerprint: 42,
        })),
        Frame::new(Message::ClusterMap(ClusterMap {
            epoch: 9,
            worker_id: Some(3),
            num_shards: 1,
            shards: vec![ShardAddr { index: 0, addr: "127.0.0.1:1".into(), process: 1, epoch: 2, backups: vec![2] }],
            layout,
            lease_ms: 5000,
            token: Some([7; 32]),
            auth_key: None,
            replicas: 2,
            spare: vec![ShardAddr { index: 1, addr: "h:2".into(), process: 1, epoch: 0, backups: vec![] }],
            rule: RuleInfo { name: "gap-aware".into(), momentum: 0.9, weight_decay: 1e-4, sparse: "adagrad".into() },
        })),
        Frame::new(Message::Pull(Pull { epoch: 9, chunks: vec![id] })),
        Frame {
            msg: Message::PullReply(PullReply {
                chunks: vec![ChunkVersion { id, version: 5, len: 3, dtype: WireDtype::F32 }],
            }),
            payload: vec![1.0, -2.5, 3.25],
        },
        Frame {
            msg: Message::PullReply(PullReply {
                chunks: vec![
                    ChunkVersion { id, version: 5, len: 2, dtype: WireDtype::Bf16 },
                    ChunkVersion { id, version: 6, len: 1, dtype: WireDtype::F32 },
                    ChunkVersion { id, version: 7, len: 3, dtype: WireDtype::F16 },
                ],
            }),
            payload: vec![1.0, -2.5, f32::from_bits(0x3f80_0001), 0.25, -65504.0, 6.1035156e-5],
        },
        Frame {
            msg: Message::Push(Push {
                epoch: 9,
                worker: 3,
                seq: 17,
                chunks: vec![
                    PushChunk { id, read_version: 4, len: 2, echo: true, dtype: WireDtype::Bf16 },
                    PushChunk { id, read_version: 4, len: 1, echo: false, dtype: WireDtype::F32 },
                    PushChunk { id, read_version: 4, len: 1, echo: true, dtype: WireDtype::F16 },
                ],
                compute_ms: 12,
                step: 41,
                decisions: ModeDecisions {
                    latest: ModeDecision { number: 3, mode: 2, from_step: 40 },
                    previous: ModeDecision { number: 2, mode: 1, from_step: 30 },
                },
                data: Some(DataTag { grant: 7 << 32 | 5, split: 1 << 32 | 3, samples: 64 }),
            }),
            // Gradients (bf16 ×2, f32, f16), then the echoes (bf16 ×2, f16): all exact in their format.
            payload: vec![0.5, f32::MIN_POSITIVE, 1.1, -3.0, -1.0, 2.0, 0.125],
        },
        Frame::new(Message::Ack(Ack {
            seq: 17,
            duplicate: true,
            max_staleness: 3,
            wait_for_step: 8,
            wait_for_clock: 2,
            decisions: ModeDecisions {
                latest: ModeDecision { number: 2, mode: 1, from_step: 9 },
                previous: ModeDecision::default(),
            },
        })),
        Frame::new(Message::error(ErrorCode::NonFinite, "NaN at 3")),
        Frame::new(Message::Heartbeat(Heartbeat { worker: 3 })),
        Frame::new(Message::HeartbeatAck(HeartbeatAck { epoch: 9, live_workers: 4 })),
        Frame::new(Message::StatsRequest(StatsRequest)),
        Frame::new(Message::CheckpointRequest(CheckpointRequest { id: 0, at: CheckpointAt::Step(9) })),
        Frame::new(Message::CheckpointDone(CheckpointDone {
            id: 7,
            shards: vec![ShardCheckpoint { shard: 1, path: "/ckpt/shard-1/x.bin".into(), step: 4 }],
        })),
        Frame::new(Message::Rollback(Rollback { id: 1 << 40, stage: RollbackStage::Restored })),
        Frame::new(Message::Rollback(Rollback { id: 9, stage: RollbackStage::List })),
        Frame::new(Message::Rollback(Rollback { id: 9, stage: RollbackStage::Apply })),
        Frame::new(Message::RollbackReply(RollbackReply { shard: 2, held: vec![9, 7, 3], step: 41 })),
        Frame::new(Message::SplitRequest(SplitRequest { epoch: 3, worker: 9, finished: Some(1 << 33) })),
        Frame::new(Message::SplitGrant(SplitGrant {
            split: Some(DataSplit {
                grant: 5,
                key: 1 << 32 | 2,
                file: 1,
                first_line: 2001,
                start: 1 << 20,
                end: 3 << 20,
                lines: 1000,
            }),
            files: 2,
            finished_accepted: true,
        })),
        Frame::new(Message::DataStatusRequest(DataStatusRequest { after_grant: 77 })),
        Frame::new(Message::WaitStep(WaitStep { step: 12, clock: 3, max_wait_ms: 250 })),
        Frame {
            msg: Message::Initialize(Initialize {
                epoch: 9,
                worker: 4,
                chunks: vec![InitChunk { id: ChunkId { tensor: 0, chunk: 1 }, len: 3 }],
            }),
            payload: vec![0.5, -1.0, 2.0],
        },
        Frame::new(Message::Initialized(Initialized { taken: 2, kept: 1 })),
        Frame::new(Message::TableScan(TableScan { epoch: 9, table: 1, cursor: 40, max_rows: 100 })),
        Frame {
            msg: Message::TableRows(TableRows { table: 1, count: 1, dim: 2, next: Some(41) }),
            payload: vec![f32::from_bits(7), f32::from_bits(0), 0.5, 0.25],
        },
        Frame {
            msg: Message::TableLoad(TableLoad { epoch: 9, worker: 3, table: 0, count: 1, dim: 1 }),
            payload: vec![f32::from_bits(9), f32::from_bits(1), -2.0],
        },
        Frame::new(Message::TableLoaded(TableLoaded { created: 1, kept: 0 })),
        Frame {
            msg: Message::ReplicaSnapshot(ReplicaSnapshot { shard: 1, index: 40, offset: 8, total: 13, bytes: 5 }),
            payload: {
                let mut w = Vec::new();
                bytes_to_words(&[1, 2, 3, 4, 5], &mut w);
                w
            },
        },
        Frame {
            msg: Message::ReplicaAppend(ReplicaAppend { shard: 0, first: 41, lens: vec![3, 6] }),
            payload: {
                let mut w = Vec::new();
                bytes_to_words(&[9; 9], &mut w);
                w
            },
        },
        Frame::new(Message::ReplicaAck(ReplicaAck { shard: 2, applied: u64::MAX })),
        Frame::new(Message::ReplicaReport(ReplicaReport { shard: 1, process: 2, epoch: 3, in_sync: vec![0, 4] })),
        Frame::new(Message::Promote(Promote { shard: 1, process: 0, epoch: 3, addr: "h:9".into() })),
        Frame::new(Message::ReplicaEpoch(ReplicaEpoch { shard: 1, epoch: 4 })),
        Frame::new(Message::ConfigPrepare(ConfigPrepare {
            ballot: crate::quorum::Ballot { round: 3, proposer: 1 },
            base: CoordinatorConfig { version: 2, serving: 0, addr: "h:1".into(), in_sync: vec![1, 2] },
        })),
        Frame::new(Message::ConfigPromise(ConfigPromise {
            version: 3,
            ballot: crate::quorum::Ballot { round: 3, proposer: 1 },
            accepted: Some((
                crate::quorum::Ballot { round: 2, proposer: 0 },
                CoordinatorConfig { version: 3, serving: 0, addr: "h:1".into(), in_sync: vec![2] },
            )),
        })),
        Frame::new(Message::ConfigAccept(ConfigAccept {
            ballot: crate::quorum::Ballot { round: 4, proposer: 1 },
            base: CoordinatorConfig { version: 2, serving: 0, addr: "h:1".into(), in_sync: vec![1] },
            value: CoordinatorConfig { version: 3, serving: 1, addr: "h:2".into(), in_sync: vec![] },
        })),
        Frame::new(Message::ConfigAccepted(ConfigAccepted {
            version: 3,
            ballot: crate::quorum::Ballot { round: 4, proposer: 1 },
        })),
        Frame::new(Message::ConfigRefused(ConfigRefused {
            promised: crate::quorum::Ballot { round: 9, proposer: 2 },
            chosen: CoordinatorConfig { version: 3, serving: 1, addr: "h:2".into(), in_sync: vec![] },
        })),
        Frame::new(Message::CoordinatorWhere(CoordinatorWhere { known: 3 })),
        Frame::new(Message::CoordinatorAt(CoordinatorAt {
            config: CoordinatorConfig { version: 4, serving: 1, addr: "h:2".into(), in_sync: vec![2] },
            copies: vec![0, 2],
            starting: false,
        })),
        Frame::new(Message::ConfigChosen(CoordinatorConfig {
            version: 4,
            serving: 1,
            addr: "h:2".into(),
            in_sync: vec![2],
        })),
        Frame::new(Message::DataStatus(DataStatus {
            shard: 1,
            counts: vec![GrantCount { grant: 78, split: 4, samples: 900 }],
            next_after: Some(78),
            counts_evicted: 2,
            dealer: Some(DealerStatus {
                data_epoch: 1,
                epochs: 2,
                splits_per_epoch: 60,
                splits_done: 61,
                splits_pending: 1,
                splits_returned: 3,
                samples_replayed: 412,
                finished: false,
                leased: vec![GrantLease { grant: 80, split: 1 << 32 | 7, worker: 2 }],
                completed: vec![(78, 4)],
                abandoned: vec![79],
            }),
        })),
        Frame::new(Message::Stats(Stats {
            shard: 1,
            pushes_applied: 10,
            staleness_max: 7,
            switches: vec![ModeSwitchRecord {
                number: 1,
                from: 1,
                to: 2,
                from_step: 12,
                at_global_step: 11,
                reason: "worker 3 straggles".into(),
            }],
            ..Stats::default()
        })),
        Frame::new(Message::Authenticate(Authenticate { worker: 3, token: [9; 32] })),
        Frame::new(Message::Authenticated(Authenticated { worker: 3 })),
        Frame::new(Message::Leave(Leave { worker: 3 })),
        Frame {
            msg: Message::SparsePull(SparsePull { epoch: 9, table: 1, count: 2, create: true }),
            payload: {
                let mut w = Vec::new();
                ids_to_words(&[7, u64::MAX - 3], &mut w);
                w
            },
        },
        Frame {
            msg: Message::SparsePullReply(SparsePullReply { table: 1, count: 1, dim: 2 }),
            payload: vec![f32::from_bits(5), 0.5, -0.5],
        },
        Frame {
            msg: Message::SparsePush(SparsePush {
                epoch: 9,
                worker: 3,
                seq: 4,
                table: 1,
                count: 1,
                dim: 2,
                echo_read: true,
            }),
            payload: vec![f32::from_bits(7), 0.0, f32::from_bits(1), 0.1, 0.2, 0.5, -0.5],
        },
        // A step: one row's push (ids, version, gradient of 2), a bf16 chunk's gradient, two next ids.
        Frame {
            msg: Message::Step(Step {
                rows: Some(SparsePush { epoch: 9, worker: 3, seq: 5, table: 0, count: 1, dim: 2, echo_read: false }),
                push: Push::new(9, 3, 6, vec![PushChunk { dtype: WireDtype::Bf16, ..PushChunk::f32(id, 4, 3) }]),
                next_rows: Some(SparsePull { epoch: 9, table: 0, count: 2, create: true }),
            }),
            payload: [
                vec![f32::from_bits(7), 0.0, f32::from_bits(2), 0.5, -0.25],
                vec![1.0, -2.0, 0.5],
                vec![f32::from_bits(8), 0.0, f32::from_bits(u32::MAX), f32::from_bits(1)],
            ]
            .concat(),
        },
        // Its answer: the chunk's values in bf16, then one version word and two values per row.
        Frame {
            msg: Message::StepReply(StepReply {
                rows: Some(Ack { seq: 5, ..Ack::default() }),
                push: PushPullReply {
                    ack: Ack { seq: 6, max_staleness: 1, ..Ack::default() },
                    chunks: vec![ChunkVersion { id, version: 5, len: 3, dtype: WireDtype::Bf16 }],
                },
                next_rows: Some(SparsePullReply { table: 0, count: 2, dim: 2 }),
            }),
            payload: vec![1.0, -2.0, 0.5, f32::from_bits(3), f32::from_bits(0), 0.125, -0.125, 4.0, 8.0],
        },
    ]
}

#[test]
fn every_message_round_trips() {
    let frames = samples();
    let kinds: std::collections::BTreeSet<u8> = frames.iter().map(|f| f.msg.kind()).collect();
    assert_eq!(kinds.len(), 49, "one sample per kind");
    for f in frames {
        let bytes = encode_frame(&f).expect("encode");
        let back = decode_frame(&bytes, &Limits::default()).expect("decode");
        // Compare payloads bit for bit: id and version words need not be valid floats.
        assert_eq!(back.msg, f.msg);
        let bits = |p: &[f32]| p.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back.payload), bits(&f.payload));
    }
    let mut w = Vec::new();
    ids_to_words(&[0, 1, u64::MAX, 0x1234_5678_9abc_def0], &mut w);
    assert_eq!(words_to_ids(&w), vec![0, 1, u64::MAX, 0x1234_5678_9abc_def0]);
}

#[test]
fn sixteen_bit_sections_halve_the_bytes_and_round_to_nearest() {
    let id = ChunkId { tensor: 0, chunk: 0 };
    let values = vec![1.0 + 1.0 / 128.0 + 1.0 / 512.0, 0.1, -7.3];
    for (dtype, width) in [(WireDtype::F32, 4), (WireDtype::Bf16, 2), (WireDtype::F16, 2)] {
        let msg = Message::PullReply(PullReply { chunks: vec![ChunkVersion { id, version: 1, len: 3, dtype }] });
        assert_eq!(msg.payload_bytes(), 3 * width);
        let bytes = encode_frame(&Frame { msg: msg.clone(), payload: values.clone() }).expect("encode");
        let back = decode_frame(&bytes, &Limits::default()).expect("decode");
        let mut want = values.clone();
        crate::dtype::round_trip(dtype, &mut want);
        assert_eq!(back.payload, want, "{dtype}");
    }
}

#[test]
fn payloads_decode_the_same_from_pieces_of_any_size() {
    let frames = samples();
    let mut rng = crate::rng::Rng::new(11);
    for f in frames.iter().filter(|f| f.msg.payload_elems() > 0) {
        let bytes = encode_frame(f).expect("encode");
        let whole = decode_frame(&bytes, &Limits::default()).expect("decode").payload;
        let payload = &bytes[bytes.len() - f.msg.payload_bytes() as usize..];
        for _ in 0..200 {
            let mut dec = PayloadDecoder::new(&f.msg);
            let mut out = Vec::new();
            let mut rest = payload;
            while !rest.is_empty() {
                let n = 1 + (rng.uniform() * 5.0) as usize;
                let (piece, tail) = rest.split_at(n.min(rest.len()));
                dec.feed(piece, &mut |dtype, run| crate::dtype::decode_extend(dtype, run, &mut out));
                rest = tail;
            }
            assert!(dec.is_done());
            let bits = |p: &[f32]| p.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out), bits(&whole));
        }
        // Bytes past the payload are ignored.
        let mut dec = PayloadDecoder::new(&f.msg);
        let mut count = 0;
        dec.feed(&[payload, &[1, 2, 3]].concat(), &mut |dtype, run| count += run.len() / dtype.bytes());
        assert_eq!(count as u64, f.msg.payload_elems());
    }
}

#[test]
fn every_truncation_is_a_typed_error() {
    for f in samples() {
        let bytes = encode_frame(&f).expect("encode");
        for cut in 0..bytes.len() {
            let err = decode_frame(&bytes[..cut], &Limits::default()).expect_err("truncated frame must fail");
            assert!(matches!(err, WireError::Truncated { .. } | WireError::BadHeader(_)), "cut at {cut}: {err:?}");
        }
    }
}

#[test]
fn over_limit_lengths_are_refused_before_allocation() {
    let mut prefix = [6u8, 0, 0, 0, 0];
    prefix[1..5].copy_from_slice(&(MAX_HEADER_BYTES + 1).to_le_bytes());
    assert!(matches!(parse_prefix(&prefix, &Limits::default()), Err(WireError::HeaderTooLarge { .. })));
    // A push header that declares 2^31 elements in one chunk group: refused by the payload limit.
    let id = ChunkId { tensor: 0, chunk: 0 };
    let push = Message::Push(Push {
        epoch: 1,
        worker: 0,
        seq: 1,
        chunks: vec![PushChunk { id, read_version: 0, len: u32::MAX, echo: false, dtype: WireDtype::F32 }; 2],
        compute_ms: 0,
        step: 0,
        decisions: Default::default(),
        data: None,
    });
    let mut bytes = vec![push.kind(), 0, 0, 0, 0];
    let len = push.encode_body(&mut bytes).expect("encode body");
    bytes[1..5].copy_from_slice(&(len as u32).to_le_bytes());
    let limits = Limits { max_header_bytes: MAX_HEADER_BYTES, max_payload_bytes: 1 << 20 };
    assert!(matches!(decode_frame(&bytes, &limits), Err(WireError::PayloadTooLarge { .. })));
    // A string length prefix far beyond the header limit is a decode error, not an allocation.
    let mut hostile = vec![1u8, 0, 0, 0, 0];
    let body = [1u8, 0, 0, 253, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f];
    hostile.extend_from_slice(&body);
    hostile[1..5].copy_from_slice(&(body.len() as u32).to_le_bytes());
    assert!(matches!(decode_frame(&hostile, &Limits::default()), Err(WireError::BadHeader(_))));
}

#[test]
fn unknown_kind_wrong_count_and_trailing_bytes_are_typed_errors() {
    let mut bytes = encode_frame(&Frame::new(Message::Heartbeat(Heartbeat { worker: 1 }))).expect("encode");
    bytes[0] = 200;
    assert_eq!(decode_frame(&bytes, &Limits::default()), Err(WireError::UnknownKind(200)));
    bytes[0] = 0;
    assert_eq!(decode_frame(&bytes, &Limits::default()), Err(WireError::UnknownKind(0)));

    let id = ChunkId { tensor: 0, chunk: 0 };
    let push = Message::Push(Push {
        epoch: 1,
        worker: 0,
        seq: 1,
        chunks: vec![PushChunk { id, read_version: 0, len: 3, echo: false, dtype: WireDtype::F32 }],
        compute_ms: 0,
        step: 0,
        decisions: Default::default(),
        data: None,
    });
    assert!(matches!(
        encode_frame(&Frame { msg: push.clone(), payload: vec![1.0; 2] }),
        Err(WireError::ElementCountMismatch { expected: 3, got: 2 })
    ));
    let mut ok = encode_frame(&Frame { msg: push, payload: vec![1.0; 3] }).expect("encode");
    ok.extend_from_slice(&[0, 0, 0, 0]);
    assert_eq!(decode_frame(&ok, &Limits::default()), Err(WireError::TrailingBytes(4)));
    // A header with garbage after the message is refused.
    let mut hb = encode_frame(&Frame::new(Message::Heartbeat(Heartbeat { worker: 1 }))).expect("encode");
    hb.push(7);
    let len = u32::from_le_bytes([hb[1], hb[2], hb[3], hb[4]]) + 1;
    hb[1..5].copy_from_slice(&len.to_le_bytes());
    assert!(matches!(decode_frame(&hb, &Limits::default()), Err(WireError::BadHeader(_))));
}

struct SliceReader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl ReadExact for SliceReader<'_> {
    async fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), WireError> {
        let end = self.pos + buf.len();
        let src = self
            .bytes
            .get(self.pos..end)
            .ok_or(WireError::Truncated { needed: end as u64, got: self.bytes.len() as u64 })?;
        buf.copy_from_slice(src);
        self.pos = end;
        Ok(())
    }
}

#[test]
fn mode_decisions_keep_the_newest_two_and_name_the_mode_of_a_step() {
    let d = |number, mode, from_step| ModeDecision { number, mode, from_step };
    let mut known = ModeDecisions::start(1);
    assert_eq!(known.in_force(0), Some(d(0, 1, 0)));
    known.merge(&ModeDecisions { latest: d(2, 1, 20), previous: d(1, 2, 10) });
    assert_eq!((known.latest, known.previous), (d(2, 1, 20), d(1, 2, 10)));
    assert_eq!(known.in_force(9), None, "before both: not decided by these two");
    assert_eq!(known.in_force(10).map(|x| x.number), Some(1));
    assert_eq!(known.in_force(25).map(|x| x.number), Some(2));
    // Older news changes nothing; a newer decision pushes the latest back.
    known.merge(&ModeDecisions { latest: d(1, 2, 10), previous: d(0, 1, 0) });
    assert_eq!((known.latest.number, known.previous.number), (2, 1));
    known.push(d(3, 2, 30));
    assert_eq!((known.latest.number, known.previous.number), (3, 2));
    let mut one = ModeDecisions::start(1);
    one.merge(&ModeDecisions { latest: d(4, 2, 40), previous: d(4, 2, 40) });
    assert_eq!((one.latest.number, one.previous.number), (4, 0), "the same decision twice is one");
}

#[test]
fn read_frame_reads_what_decode_frame_reads() {
    let f = samples().swap_remove(5);
    let bytes = encode_frame(&f).expect("encode");
    let mut reader = SliceReader { bytes: &bytes, pos: 0 };
    let got = block_on(read_frame(&mut reader, &Limits::default())).expect("read");
    assert_eq!(got, f);
    let mut short = SliceReader { bytes: &bytes[..bytes.len() - 1], pos: 0 };
    assert!(matches!(block_on(read_frame(&mut short, &Limits::default())), Err(WireError::Truncated { .. })));
}

/// Minimal executor for futures that never wait (the reader above completes synchronously).
fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

#[test]
fn every_kind_is_a_request_or_a_reply_and_comes_back_whole() {
    let (mut requests, mut replies) = (Vec::new(), Vec::new());
    for frame in samples() {
        let msg = frame.msg;
        let debug = format!("{msg:?}");
        let back: Message = match msg.clone().into_request() {
            Ok(r) => {
                assert!(debug.starts_with(&format!("{}(", r.name())), "{} for {debug}", r.name());
                requests.push(r.name());
                r.into()
            }
            Err(r) => {
                assert!(debug.starts_with(&format!("{}(", r.name())), "{} for {debug}", r.name());
                replies.push(r.name());
                (*r).into()
            }
        };
        assert_eq!(back, msg);
    }
    for asks in ["Pull", "Push", "SparsePull", "SparsePush", "Step", "Register", "Promote", "Heartbeat", "StatsRequest"]
    {
        assert!(requests.contains(&asks), "{asks} is a request: {requests:?}");
    }
    for answers in ["PullReply", "SparsePullReply", "StepReply", "Ack", "Error", "Stats", "ClusterMap", "CoordinatorAt"]
    {
        assert!(replies.contains(&answers), "{answers} is a reply: {replies:?}");
    }
}
