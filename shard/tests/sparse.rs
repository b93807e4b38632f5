//! Sparse tables through ShardCore: routing, validation, exactly-once shared with dense pushes, evaluation
//! reads that create nothing, the memory budget.

mod common;

use gaps_common::layout::{sparse_owner, ChunkId, Layout, SparseSpec, TensorSpec};
use gaps_common::wire::{ids_to_words, ErrorCode, Frame, Message, Push, PushChunk, SparsePull};
use gaps_kernels::Hyper;
use gaps_shard::core::SparseSettings;
use gaps_shard::testnet;
use gaps_shard::{Init, ShardConfig, ShardCore};
use std::time::Duration;

const EPOCH: u64 = 5;
const DIM: u32 = 4;

fn core(shard: u32, num_shards: u32, budget: Option<u64>) -> ShardCore {
    let layout =
        Layout::with_tables(vec![TensorSpec::new("dense", 8)], 8, vec![SparseSpec::new("emb", DIM)]).expect("layout");
    let mut core = ShardCore::new(ShardConfig {
        shard,
        num_shards,
        rule: gaps_kernels::Rule::Sgd,
        hyper: Hyper { lr: 0.1, momentum: 0.0, ..Hyper::default() },
        init: Init { seed: 1, std: 0.0 },
        sparse: SparseSettings { memory_budget: budget, init_std: 0.1, ..SparseSettings::default() },
        ..testnet::config(layout, EPOCH)
    })
    .expect("core");
    if shard != 0 {
        // Adopt the epoch as a joined shard would.
        let mut coordinator = ShardCore::new(ShardConfig { shard: 0, ..core.config().clone() }).expect("coordinator");
        let (reply, _) = coordinator.handle(Frame::new(core.join_request()), Duration::ZERO);
        let Message::ClusterMap(map) = reply.msg else { panic!("join refused") };
        core.joined(&map).expect("joined");
    }
    core
}

fn owned(shard: u32, num_shards: u32, count: usize) -> Vec<u64> {
    (0..u64::MAX).filter(|id| sparse_owner(0, *id, num_shards) == shard).take(count).collect()
}

fn sparse_pull(core: &mut ShardCore, ids: &[u64], create: bool) -> Result<(Vec<u32>, Vec<f32>), ErrorCode> {
    let mut words = Vec::new();
    ids_to_words(ids, &mut words);
    let msg = Message::SparsePull(SparsePull { epoch: EPOCH, table: 0, count: ids.len() as u32, create });
    let (reply, _) = core.handle(Frame { msg, payload: words }, Duration::ZERO);
    match reply.msg {
        Message::SparsePullReply(r) => {
            let (v, rows) = reply.payload.split_at(r.count as usize);
            Ok((v.iter().map(|w| w.to_bits()).collect(), rows.to_vec()))
        }
        Message::Error(e) => Err(e.code),
        other => panic!("unexpected {other:?}"),
    }
}

fn sparse_push(
    core: &mut ShardCore,
    seq: u64,
    ids: &[u64],
    versions: &[u32],
    grads: &[f32],
) -> Result<bool, ErrorCode> {
    let frame = common::sparse_push_frame(EPOCH, 1, seq, DIM, ids, versions, grads);
    match core.handle(frame, Duration::ZERO).0.msg {
        Message::Ack(a) => Ok(a.duplicate),
        Message::Error(e) => Err(e.code),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn sparse_rows_are_created_updated_once_and_validated() {
    let mut core = core(0, 1, None);
    let ids = [11u64, 22, 33];
    // An evaluation read creates nothing.
    let (_, initial) = sparse_pull(&mut core, &ids, false).expect("peek");
    assert_eq!(core.stats().table_rows, 0);
    let (versions, rows) = sparse_pull(&mut core, &ids, true).expect("pull");
    assert_eq!(rows, initial, "a row starts at its initial value");
    assert_eq!(core.stats().table_rows, 3);
    let grads = vec![1.0f32; 3 * DIM as usize];
    assert_eq!(sparse_push(&mut core, 1, &ids, &versions, &grads), Ok(false));
    assert_eq!(sparse_push(&mut core, 1, &ids, &versions, &grads), Ok(true), "same seq: acknowledged, not applied");
    let after = core.sparse_row(0, 22).expect("row").to_vec();
    // Adagrad with lr 0.05: the first step moves each value by about lr.
    for (a, b) in after.iter().zip(&rows[4..8]) {
        assert!((b - a - 0.05).abs() < 1e-4, "{b} -> {a}");
    }
    // A dense push from the same worker continues the same sequence: seq 1 is taken.
    let dense = Message::Push(Push::new(
        EPOCH,
        1,
        1,
        vec![PushChunk {
            id: ChunkId { tensor: 0, chunk: 0 },
            read_version: 0,
            len: 8,
            echo: false,
            dtype: gaps_common::dtype::WireDtype::F32,
        }],
    ));
    assert!(
        matches!(core.handle(Frame { msg: dense, payload: vec![0.5; 8] }, Duration::ZERO).0.msg, Message::Ack(a) if a.duplicate)
    );
    // Bad pushes change nothing.
    let before = core.sparse_row(0, 11).expect("row").to_vec();
    let mut nan = grads.clone();
    nan[2] = f32::NAN;
    assert_eq!(sparse_push(&mut core, 2, &ids, &versions, &nan), Err(ErrorCode::NonFinite));
    assert_eq!(
        sparse_push(&mut core, 2, &[11, 11, 22], &versions, &grads),
        Err(ErrorCode::WrongShape),
        "duplicate ids"
    );
    assert_eq!(sparse_push(&mut core, 2, &ids, &versions, &grads[1..]), Err(ErrorCode::WrongShape), "short payload");
    assert_eq!(core.sparse_row(0, 11).expect("row"), &before[..]);
    // An id that was never pulled is skipped and counted, not an error.
    assert_eq!(sparse_push(&mut core, 2, &[999], &[0], &grads[..4]), Ok(false));
    assert_eq!(core.stats().sparse_dropped, 1);
}

#[test]
fn rows_of_other_shards_are_refused() {
    let mut s1 = core(1, 2, None);
    let theirs = owned(0, 2, 1);
    let ours = owned(1, 2, 2);
    assert!(sparse_pull(&mut s1, &ours, true).is_ok());
    assert_eq!(sparse_pull(&mut s1, &[ours[0], theirs[0]], true), Err(ErrorCode::NotOwner));
    assert_eq!(s1.stats().table_rows, 2, "a refused pull creates nothing");
}

#[test]
fn the_memory_budget_holds_across_requests() {
    let budget = 64 * 1024;
    let mut core = core(0, 1, Some(budget));
    for batch in 0..100u64 {
        let ids: Vec<u64> = (0..64).map(|i| batch * 1000 + i).collect();
        sparse_pull(&mut core, &ids, true).expect("pull");
        assert!(core.stats().table_bytes <= budget, "{} > {budget}", core.stats().table_bytes);
    }
    assert!(core.stats().table_evicted > 0);
}

/// Export and import of a table's rows: pages cover every row once; a load creates the rows it carries with
/// their values (version 1), keeps held rows, and refuses foreign ids, repeated ids, NaN and a wrong width
/// whole, before any row is loaded.
#[test]
fn rows_export_in_pages_and_import_only_where_valid() {
    use gaps_common::wire::{words_to_ids, TableLoad, TableScan};
    let mut core = core(0, 2, None);
    let ids = owned(0, 2, 10);
    sparse_pull(&mut core, &ids[..7], true).expect("pull");
    let mut seen = Vec::new();
    let mut cursor = Some(0);
    while let Some(at) = cursor {
        let msg = Message::TableScan(TableScan { epoch: EPOCH, table: 0, cursor: at, max_rows: 3 });
        let (reply, _) = core.handle(Frame::new(msg), Duration::ZERO);
        let Message::TableRows(rows) = reply.msg else { panic!("{:?}", reply.msg) };
        assert!(rows.count <= 3 && rows.dim == DIM);
        seen.extend(words_to_ids(&reply.payload[..2 * rows.count as usize]));
        cursor = rows.next;
    }
    seen.sort_unstable();
    let mut want = ids[..7].to_vec();
    want.sort_unstable();
    assert_eq!(seen, want, "every row once");

    let load = |core: &mut ShardCore, ids: &[u64], values: Vec<f32>, dim: u32| {
        let mut payload = Vec::new();
        ids_to_words(ids, &mut payload);
        payload.extend(values);
        let msg = Message::TableLoad(TableLoad { epoch: EPOCH, worker: 1, table: 0, count: ids.len() as u32, dim });
        core.handle(Frame { msg, payload }, Duration::ZERO).0.msg
    };
    let rows_before = core.stats().table_rows;
    let foreign = owned(1, 2, 1);
    let refused = [
        load(&mut core, &[ids[8], foreign[0]], vec![1.0; 8], DIM),
        load(&mut core, &[ids[8], ids[8]], vec![1.0; 8], DIM),
        load(&mut core, &[ids[8], ids[9]], [vec![1.0; 7], vec![f32::NAN]].concat(), DIM),
        load(&mut core, &[ids[8]], vec![1.0; 3], DIM - 1),
    ];
    for r in &refused {
        assert!(matches!(r, Message::Error(_)), "{r:?}");
    }
    assert_eq!(core.stats().table_rows, rows_before, "a refused load loaded nothing");
    // Two new rows created with their values, one held row kept.
    match load(&mut core, &[ids[8], ids[9], ids[0]], (0..12).map(|v| v as f32).collect(), DIM) {
        Message::TableLoaded(l) => assert_eq!((l.created, l.kept), (2, 1)),
        other => panic!("{other:?}"),
    }
    let (versions, values) = sparse_pull(&mut core, &ids[8..10], false).expect("read");
    assert_eq!(versions, vec![1, 1]);
    assert_eq!(values, (0..8).map(|v| v as f32).collect::<Vec<_>>());
}

/// A push's rows updated together — in place with the constants derived once, for the rules whose constants
/// every row shares — end bit for bit where the same rows pushed one at a time do, for every rule a table
/// takes, rows of 16 floats (the straight-line vector update) and of 5, with ids the table does not hold in
/// the push and reads of every staleness.
#[test]
fn rows_pushed_together_end_bit_for_bit_where_rows_pushed_one_by_one_do() {
    use gaps_kernels::{PushScalars, Rule};
    use gaps_shard::sparse::SparseTable;
    let rules = [
        Rule::Sgd,
        Rule::Momentum,
        Rule::Nesterov,
        Rule::StalenessAware,
        Rule::DcAsgd,
        Rule::GapAware,
        Rule::DanaSlim,
        Rule::Adagrad,
        Rule::Adam,
        Rule::Nadam,
        Rule::GapAdam,
    ];
    for (rule, dim) in rules.into_iter().flat_map(|rule| [(rule, 16usize), (rule, 5)]) {
        let cfg = row_table(rule, dim as u32);
        let mut together = SparseTable::new(cfg.clone()).expect("table");
        let mut alone = SparseTable::new(cfg).expect("table");
        let held: Vec<u64> = (0..300u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1).collect();
        let (mut values, mut versions) = (Vec::new(), Vec::new());
        together.pull(&held, 0, &mut values, &mut versions);
        alone.pull(&held, 0, &mut values, &mut versions);
        let hyper = Hyper { lr: 0.05, momentum: 0.9, weight_decay: 1e-4, ..Hyper::default() };
        let base = PushScalars { lr: 0.05, lr_max: 0.08, staleness: 0, t: 1, workers: 4 };
        let mut rng = gaps_common::rng::Rng::new(5);
        for round in 1..=6u32 {
            // 80 distinct ids: held ones, and a few the table never saw (their gradients are dropped).
            let mut ids: Vec<u64> = Vec::new();
            while ids.len() < 80 {
                let id = if rng.below(10) == 0 { rng.next_u64() << 1 } else { held[rng.below(300) as usize] };
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
            let (mut read, mut read_versions) = (Vec::new(), Vec::new());
            together.peek(&ids, &mut read, &mut read_versions);
            for v in &mut read_versions {
                *v = v.saturating_sub(rng.below(3) as u32);
            }
            let grads: Vec<f32> = (0..ids.len() * dim).map(|_| (rng.below(2001) as f32 - 1000.0) * 1e-3).collect();
            let reads = if rule.layout().needs_read { read } else { Vec::new() };
            let a = together.push(&ids, &read_versions, &grads, &reads, &hyper, base, round).expect("together");
            let mut b = 0;
            for k in 0..ids.len() {
                let echo = if reads.is_empty() { &reads[..] } else { &reads[k * dim..(k + 1) * dim] };
                let one = alone.push(
                    &ids[k..=k],
                    &read_versions[k..=k],
                    &grads[k * dim..(k + 1) * dim],
                    echo,
                    &hyper,
                    base,
                    round,
                );
                b = b.max(one.expect("alone"));
            }
            assert_eq!(a, b, "{rule} dim {dim}: the largest staleness");
        }
        let (mut va, mut vera, mut vb, mut verb) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        together.peek(&held, &mut va, &mut vera);
        alone.peek(&held, &mut vb, &mut verb);
        assert_eq!(vera, verb, "{rule} dim {dim}: versions");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&va), bits(&vb), "{rule} dim {dim}: values");
        assert!(vera.iter().any(|v| *v > 1), "{rule}: rows were updated");
    }
}

/// A push the kernels refuse (an echo a rule does not take, or none where it needs one) changes nothing:
/// no row's values or version, whichever way the rows are updated.
#[test]
fn a_refused_row_push_changes_nothing() {
    use gaps_kernels::{PushScalars, Rule};
    use gaps_shard::sparse::SparseTable;
    for (rule, echo) in [(Rule::Sgd, true), (Rule::DcAsgd, false), (Rule::Adagrad, true)] {
        let cfg = row_table(rule, 16);
        let mut table = SparseTable::new(cfg).expect("table");
        let ids: Vec<u64> = (1..=40u64).collect();
        let (mut before, mut versions) = (Vec::new(), Vec::new());
        table.pull(&ids, 0, &mut before, &mut versions);
        let grads = vec![0.5f32; ids.len() * 16];
        let reads = if echo { before.clone() } else { Vec::new() };
        let hyper = Hyper { lr: 0.05, ..Hyper::default() };
        let base = PushScalars { lr: 0.05, lr_max: 0.05, staleness: 0, t: 1, workers: 1 };
        assert!(table.push(&ids, &versions, &grads, &reads, &hyper, base, 1).is_err(), "{rule}: refused");
        let (mut after, mut versions_after) = (Vec::new(), Vec::new());
        table.peek(&ids, &mut after, &mut versions_after);
        assert_eq!(after, before, "{rule}: values");
        assert_eq!(versions_after, versions, "{rule}: versions");
    }
}

/// A table of `dim`-float rows updated by `rule`, no budget, created on first touch.
fn row_table(rule: gaps_kernels::Rule, dim: u32) -> gaps_shard::sparse::TableConfig {
    gaps_shard::sparse::TableConfig {
        table: 0,
        dim,
        rule,
        init_std: 0.1,
        adagrad_init: 0.1,
        seed: 3,
        admit_after: 0,
        memory_budget: None,
        eviction: gaps_shard::sparse::Eviction::Lru,
    }
}
