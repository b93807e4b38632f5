//! Unit tests of the sparse table.

use super::*;

fn table(rule: Rule, admit_after: u32, budget: Option<u64>, eviction: Eviction) -> SparseTable {
    SparseTable::new(TableConfig {
        table: 3,
        dim: 4,
        rule,
        init_std: 0.1,
        adagrad_init: 0.0,
        seed: 9,
        admit_after,
        memory_budget: budget,
        eviction,
    })
    .expect("table")
}

#[test]
fn rows_are_created_once_initialised_deterministically_and_updated() {
    let mut t = table(Rule::Adagrad, 0, None, Eviction::Lru);
    let (mut v, mut ver) = (Vec::new(), Vec::new());
    t.pull(&[5, 7, 5], 0, &mut v, &mut ver);
    assert_eq!(t.rows(), 2);
    assert_eq!(&v[0..4], &v[8..12], "the same id reads the same row");
    assert_ne!(&v[0..4], &v[4..8]);
    let mut other = table(Rule::Adagrad, 0, None, Eviction::Lru);
    let (mut v2, mut ver2) = (Vec::new(), Vec::new());
    other.pull(&[7], 0, &mut v2, &mut ver2);
    assert_eq!(&v[4..8], &v2[..], "initial values depend on (seed, table, id) only");
    let h = Hyper { lr: 0.1, ..Hyper::default() };
    let tau = t.push(&[5, 99], &[0, 0], &[1.0; 8], &[], &h, PushScalars::fresh(0.1, 1), 1).expect("push");
    assert_eq!(tau, 0);
    assert_eq!(t.stats().dropped_updates, 1, "id 99 was never pulled");
    let row = t.row(5).expect("row");
    assert!((row[0] - (v[0] - 0.1 * 1.0 / (1.0 + 1e-8))).abs() < 1e-6);
    let (mut v3, mut ver3) = (Vec::new(), Vec::new());
    t.pull(&[5], 2, &mut v3, &mut ver3);
    assert_eq!(ver3, vec![1]);
    let tau = t.push(&[5], &[0], &[1.0; 4], &[], &h, PushScalars::fresh(0.1, 1), 3).expect("push");
    assert_eq!(tau, 1, "read at version 0, applied at version 1");
}

#[test]
fn adagrad_rows_start_from_the_initial_accumulator() {
    // With 0, a tiny gradient moves a new row by the full η; with 0.1 by η·g/√(0.1 + g²).
    let h = Hyper { lr: 0.1, ..Hyper::default() };
    let g = 1e-3f32;
    for (init, expected_step) in [(0.0f32, 0.1 * g / (g * g).sqrt()), (0.1, 0.1 * g / (0.1 + g * g).sqrt())] {
        let mut t =
            SparseTable::new(TableConfig { adagrad_init: init, ..table(Rule::Adagrad, 0, None, Eviction::Lru).cfg })
                .expect("table");
        let (mut v, mut ver) = (Vec::new(), Vec::new());
        t.pull(&[5], 0, &mut v, &mut ver);
        t.push(&[5], &[0], &[g; 4], &[], &h, PushScalars::fresh(0.1, 1), 1).expect("push");
        let step = v[0] - t.row(5).expect("row")[0];
        assert!((step - expected_step).abs() < 1e-5, "init {init}: step {step} vs {expected_step}");
    }
}

#[test]
fn admission_filter_creates_rows_only_after_enough_sightings() {
    let mut t = table(Rule::Sgd, 3, None, Eviction::Lru);
    let (mut v, mut ver) = (Vec::new(), Vec::new());
    t.pull(&[42], 0, &mut v, &mut ver);
    t.pull(&[42], 0, &mut v, &mut ver);
    assert_eq!(t.rows(), 0);
    assert_eq!(t.stats().not_admitted, 2);
    assert_eq!(&v[0..4], &v[4..8], "not-admitted ids read their initial values");
    t.pull(&[42], 0, &mut v, &mut ver);
    assert_eq!(t.rows(), 1);
    assert_eq!(&v[8..12], &v[0..4]);
}

#[test]
fn eviction_keeps_the_table_under_its_budget_and_the_index_consistent() {
    let budget = 96 * 1024;
    let mut t = table(Rule::Adam, 0, Some(budget), Eviction::Lru);
    let (mut v, mut ver) = (Vec::new(), Vec::new());
    for batch in 0..200u64 {
        v.clear();
        ver.clear();
        let ids: Vec<u64> = (0..50).map(|i| batch * 37 + i * 1_000_003).collect();
        t.pull(&ids, batch as u32, &mut v, &mut ver);
        assert!(t.bytes() <= budget, "{} bytes over the budget of {budget}", t.bytes());
    }
    assert!(t.stats().evicted > 0);
    // Every held row is found through the index, and absent ids are not.
    for r in 0..t.rows() {
        assert_eq!(t.find(t.meta[r].id), Some(r));
    }
    assert_eq!(t.find(u64::MAX), None);
    // Recently used rows survive better than old ones.
    let recent = (0..50).filter(|i| t.row(199 * 37 + i * 1_000_003).is_some()).count();
    let old = (0..50).filter(|i| t.row(i * 1_000_003).is_some()).count();
    assert!(recent > old, "recent {recent} vs old {old}");
}

/// A table restored under a smaller budget is trimmed by the first pull even when every id it asks for
/// is held (the batch path creates nothing, but trims as the row-by-row path always did).
#[test]
fn a_pull_of_held_rows_trims_a_table_restored_over_its_budget() {
    let mut big = table(Rule::Adam, 0, None, Eviction::Lru);
    let (mut v, mut ver) = (Vec::new(), Vec::new());
    let ids: Vec<u64> = (0..2000u64).map(|i| i * 1_000_003 + 1).collect();
    big.pull(&ids, 1, &mut v, &mut ver);
    let mut w = crate::checkpoint::Writer::default();
    big.write_to(&mut w);
    let budget = 96 * 1024;
    let mut small = table(Rule::Adam, 0, Some(budget), Eviction::Lru);
    let mut r = crate::checkpoint::Reader::section(&w.buf, crate::checkpoint::FORMAT_VERSION);
    small.read_from(&mut r).expect("restore");
    assert!(small.bytes() > budget, "restored over the budget");
    let held: Vec<u64> = ids[..10].iter().copied().filter(|id| small.row(*id).is_some()).collect();
    assert!(!held.is_empty());
    small.pull(&held, 2, &mut v, &mut ver);
    assert!(small.bytes() <= budget, "{} bytes over the budget of {budget}", small.bytes());
}

#[test]
fn ttl_eviction_removes_idle_rows() {
    let mut t = table(Rule::Sgd, 0, None, Eviction::Ttl { ttl_s: 10 });
    let (mut v, mut ver) = (Vec::new(), Vec::new());
    t.pull(&[1, 2, 3], 0, &mut v, &mut ver);
    t.pull(&[2], 8, &mut v, &mut ver);
    assert_eq!(t.tick(15), 2);
    assert_eq!(t.rows(), 1);
    assert!(t.row(2).is_some());
}

#[test]
fn rules_with_per_worker_state_are_refused() {
    let cfg = |rule| TableConfig {
        table: 0,
        dim: 8,
        rule,
        init_std: 0.0,
        adagrad_init: 0.0,
        seed: 0,
        admit_after: 0,
        memory_budget: None,
        eviction: Eviction::Lru,
    };
    assert!(SparseTable::new(cfg(Rule::DanaZero)).is_err());
    assert!(SparseTable::new(cfg(Rule::MultiMomentum)).is_err());
    assert!(SparseTable::new(cfg(Rule::GapAware)).is_ok());
}

#[test]
fn admission_counts_only_the_flags_range_and_ages() {
    // On d75cfe4 admit-after 300 was accepted and no id could ever reach it: every table stayed empty.
    let err = SparseTable::new(TableConfig { admit_after: 300, ..table(Rule::Adagrad, 0, None, Eviction::Lru).cfg })
        .expect_err("out of range");
    assert!(err.to_string().contains("at most 255"), "{err}");
    let mut s = Sightings::new();
    assert_eq!(s.see(42), 1);
    assert_eq!(s.see(42), 2);
    // Old sightings fade: after one aging period of other traffic, 42 counts half of what it had.
    for _ in 0..Sightings::AGE_PERIOD {
        s.see(7);
    }
    assert_eq!(s.see(42), 2, "1 (halved from 2) + this sighting");
}

#[test]
fn a_budget_that_cannot_hold_a_useful_table_is_refused() {
    // On d75cfe4 `--table-memory 1KiB` was accepted and training ran with 0 rows, silently.
    let err =
        SparseTable::new(TableConfig { memory_budget: Some(1024), ..table(Rule::Adagrad, 0, None, Eviction::Lru).cfg })
            .expect_err("too small");
    assert!(err.to_string().contains("holds 0 rows"), "{err}");
    let row = 4 * 2 * 4 + META_BYTES_PER_ROW;
    let enough = MIN_ROWS_IN_BUDGET * row + INITIAL_INDEX_SLOTS as u64 * 4;
    assert!(SparseTable::new(TableConfig {
        memory_budget: Some(enough),
        ..table(Rule::Adagrad, 0, None, Eviction::Lru).cfg
    })
    .is_ok());
}
