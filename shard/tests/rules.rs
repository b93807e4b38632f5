//! Every update rule driven through ShardCore: the look-ahead on pulls, the read echo on pushes, per-worker
//! state only where the rule needs it, staleness reaching the rule.

use gaps_common::layout::{ChunkId, Layout, TensorSpec};
use gaps_common::wire::{ErrorCode, Frame, Message, Pull, Push, PushChunk};
use gaps_kernels::{Hyper, Rule};
use gaps_shard::{Init, ShardConfig, ShardCore};
use std::time::Duration;

const EPOCH: u64 = 9;
const N: u64 = 300;

fn layout() -> Layout {
    Layout::new(vec![TensorSpec::new("x", N)], 64).expect("layout")
}

fn core(rule: Rule, hyper: Hyper) -> ShardCore {
    ShardCore::new(ShardConfig {
        rule,
        hyper,
        init: Init { seed: 11, std: 1.0 },
        lease: Duration::from_secs(60),
        advertise: "127.0.0.1:1".into(),
        epoch: EPOCH,
        threads: 2,
        ..ShardConfig::new(layout())
    })
    .expect("core")
}

fn hyper_for(rule: Rule) -> Hyper {
    let lr = match rule {
        Rule::Adagrad | Rule::Adam | Rule::Nadam | Rule::GapAdam => 0.05,
        _ => 0.02,
    };
    Hyper { lr, momentum: 0.9, weight_decay: 0.0, dc_lambda: 0.5, dc_ms_decay: 0.95 }
}

fn pull(core: &mut ShardCore) -> (Vec<f32>, Vec<u64>) {
    let chunks: Vec<ChunkId> = layout().chunks().collect();
    let (reply, _) = core.handle(Frame::new(Message::Pull(Pull { epoch: EPOCH, chunks })), Duration::ZERO);
    let Message::PullReply(r) = reply.msg else { panic!("pull refused: {:?}", reply.msg) };
    (reply.payload, r.chunks.iter().map(|c| c.version).collect())
}

fn push(core: &mut ShardCore, worker: u32, seq: u64, versions: &[u64], grad: &[f32], read: Option<&[f32]>) -> Message {
    let l = layout();
    let chunks = l
        .chunks()
        .zip(versions)
        .map(|(id, v)| PushChunk {
            echo: read.is_some(),
            ..PushChunk::f32(id, *v, l.chunk_len(id).expect("len") as u32)
        })
        .collect();
    let mut payload = grad.to_vec();
    if let Some(r) = read {
        payload.extend_from_slice(r);
    }
    let msg = Message::Push(Push::new(EPOCH, worker, seq, chunks));
    core.handle(Frame { msg, payload }, Duration::ZERO).0.msg
}

/// ½ Σ h_i x_i² with h spread over [0.1, 1].
fn curvature() -> Vec<f32> {
    (0..N).map(|i| 0.1 + 0.9 * i as f32 / N as f32).collect()
}

fn loss(x: &[f32], h: &[f32]) -> f32 {
    x.iter().zip(h).map(|(x, h)| 0.5 * h * x * x).sum()
}

#[test]
fn every_rule_trains_a_quadratic_with_three_asynchronous_workers() {
    let h = curvature();
    for rule in Rule::ALL {
        let hyper = hyper_for(rule);
        let mut core = core(rule, hyper);
        let layout = rule.layout();
        let workers = 3usize;
        // Each worker computes on the values it last pulled (the look-ahead for DANA), in round-robin
        // order, so every gradient is two updates stale.
        let mut views: Vec<(Vec<f32>, Vec<u64>)> = (0..workers).map(|_| pull(&mut core)).collect();
        let mut slim_momentum = vec![vec![0.0f32; N as usize]; workers];
        let initial = loss(&pull(&mut core).0, &h);
        let mut seqs = vec![0u64; workers];
        for step in 0..600 {
            let w = step % workers;
            let (x, versions) = &views[w];
            let mut g: Vec<f32> = x.iter().zip(&h).map(|(x, h)| h * x).collect();
            if layout.worker_momentum {
                gaps_kernels::slim_worker_step(&hyper, x, &mut slim_momentum[w], &mut g);
            }
            seqs[w] += 1;
            let read = layout.needs_read.then_some(x.as_slice());
            let reply = push(&mut core, w as u32, seqs[w], versions, &g, read);
            assert!(matches!(reply, Message::Ack(a) if !a.duplicate), "{rule}: {reply:?}");
            views[w] = pull(&mut core);
        }
        let chunks: Vec<ChunkId> = layout_chunks();
        let final_values: Vec<f32> =
            chunks.iter().flat_map(|id| core.chunk_values(*id).expect("chunk").to_vec()).collect();
        let last = loss(&final_values, &h);
        assert!(last.is_finite() && last < initial / 10.0, "{rule}: loss {initial} -> {last}");
        // Per-worker state exists exactly for the rules that need it, one plane per worker.
        let expected = layout.worker_planes * workers * N as usize;
        assert_eq!(core.worker_state_floats(), expected, "{rule}: per-worker state");
        assert_eq!(core.stats().staleness_max, 2, "{rule}: round-robin over 3 workers");
    }
}

fn layout_chunks() -> Vec<ChunkId> {
    layout().chunks().collect()
}

#[test]
fn pushes_must_echo_the_read_parameters_exactly_when_the_rule_needs_them() {
    for rule in Rule::ALL {
        let mut core = core(rule, hyper_for(rule));
        let (x, v) = pull(&mut core);
        let g = vec![0.1f32; N as usize];
        let needs = rule.layout().needs_read;
        let wrong = push(&mut core, 0, 1, &v, &g, (!needs).then_some(x.as_slice()));
        assert!(matches!(&wrong, Message::Error(e) if e.code == ErrorCode::WrongShape), "{rule}: {wrong:?}");
        if needs {
            let mut bad_read = x.clone();
            bad_read[7] = f32::NAN;
            let nan = push(&mut core, 0, 1, &v, &g, Some(&bad_read));
            assert!(matches!(&nan, Message::Error(e) if e.code == ErrorCode::NonFinite), "{rule}: {nan:?}");
        }
        assert_eq!(pull(&mut core), (x.clone(), v.clone()), "{rule}: a refused push changed the shard");
        let ok = push(&mut core, 0, 1, &v, &g, needs.then_some(x.as_slice()));
        assert!(matches!(ok, Message::Ack(_)), "{rule}: {ok:?}");
    }
}

#[test]
fn dana_pulls_return_the_lookahead() {
    let hyper = Hyper { lr: 0.1, momentum: 0.9, ..Hyper::default() };
    let mut core = core(Rule::DanaZero, hyper);
    let (x0, v0) = pull(&mut core);
    let g: Vec<f32> = (0..N).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
    assert!(matches!(push(&mut core, 0, 1, &v0, &g, None), Message::Ack(_)));
    let (x1, _) = pull(&mut core);
    // First push of worker 0: v⁰ = g, S = g, θ = θ0 − ηg; the pull returns θ − ηγS = θ0 − ηg − ηγg.
    for i in 0..N as usize {
        let expected = (x0[i] - 0.1 * g[i]) - 0.1 * 0.9 * g[i];
        assert!((x1[i] - expected).abs() <= 1e-6, "element {i}: {} vs {expected}", x1[i]);
    }
    let master = core.chunk_values(ChunkId { tensor: 0, chunk: 0 }).expect("chunk");
    assert!((master[1] - (x0[1] - 0.1 * g[1])).abs() <= 1e-6, "the master keeps θ");
}

#[test]
fn staleness_reaches_the_staleness_aware_rule() {
    let hyper = Hyper { lr: 0.1, momentum: 0.0, ..Hyper::default() };
    let mut core = core(Rule::StalenessAware, hyper);
    let (_, v0) = pull(&mut core);
    let g = vec![1.0f32; N as usize];
    for seq in 1..=4 {
        let (_, v) = pull(&mut core);
        assert!(matches!(push(&mut core, 1, seq, &v, &g, None), Message::Ack(_)));
    }
    let (before, _) = pull(&mut core);
    // Computed on version 0, applied after four updates: τ = 4, so the step is η·g/4.
    assert!(matches!(push(&mut core, 0, 1, &v0, &g, None), Message::Ack(a) if a.max_staleness == 4));
    let (after, _) = pull(&mut core);
    assert!((before[0] - after[0] - 0.1 / 4.0).abs() < 1e-6, "{} -> {}", before[0], after[0]);
}

#[test]
fn per_worker_state_is_freed_when_a_worker_leaves_or_expires() {
    // On d75cfe4 these planes (a model-sized copy per worker) were never freed: elastic churn leaked them.
    for rule in [Rule::MultiMomentum, Rule::DcAsgdAdaptive, Rule::DanaZero, Rule::DanaDc, Rule::DanaGa] {
        let mut core = core(rule, hyper_for(rule));
        let per_worker = rule.layout().worker_planes * N as usize;
        for (seq, w) in [1u64, 2].into_iter().flat_map(|s| [0u32, 1, 2].map(|w| (s, w))) {
            let (values, versions) = pull(&mut core);
            let g: Vec<f32> = values.iter().map(|v| 0.3 * v + 0.01 * w as f32).collect();
            let read = rule.layout().needs_read.then_some(values.as_slice());
            let reply = push(&mut core, w, seq, &versions, &g, read);
            assert!(matches!(reply, Message::Ack(_)), "{rule}: {reply:?}");
        }
        assert_eq!(core.worker_state_floats(), 3 * per_worker, "{rule}");
        let leave = Message::Leave(gaps_common::wire::Leave { worker: 1 });
        core.handle(Frame::new(leave), Duration::from_secs(1));
        assert_eq!(core.worker_state_floats(), 2 * per_worker, "{rule}: the leaving worker's planes are freed");
        // The others' leases (60 s) run out.
        core.tick(Duration::from_secs(120));
        assert_eq!(core.worker_state_floats(), 0, "{rule}: expired workers' planes are freed");
        if rule.layout().lookahead {
            // Nobody is left to take a momentum step: the look-ahead is θ itself (S back to ~0).
            let (ahead, _) = pull(&mut core);
            let theta = core.chunk_values(ChunkId { tensor: 0, chunk: 0 }).expect("chunk").to_vec();
            for (a, t) in ahead.iter().zip(&theta) {
                assert!((a - t).abs() < 1e-6, "{rule}: look-ahead {a} vs θ {t}");
            }
        }
    }
}
