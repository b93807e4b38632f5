//! `gaps bench e2e`'s single-process baseline is the yardstick of the cluster's throughput, so it must train
//! the same model the same way: with one worker and one shard, asynchronous training is sequential (pull,
//! step, push, wait for the acknowledgement), and the cluster must end where the baseline ends.

#[test]
fn one_worker_one_shard_ends_where_the_single_process_baseline_ends() {
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_gaps"));
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    let run = runtime.block_on(gaps_cli::e2e::run(exe, &[(1, 1, 1)], 150, None)).expect("bench e2e");
    let (base, cluster) = (&run.baseline, &run.shapes[0]);
    assert_eq!(base.samples, 150 * 256);
    assert!(base.auc > 0.75, "the baseline trains: AUC {}", base.auc);
    // Only the order of floating-point sums may differ (rows summed per shard, chunks per tensor).
    assert!((cluster.auc - base.auc).abs() < 2e-3, "cluster AUC {} vs baseline {}", cluster.auc, base.auc);
    assert!(cluster.samples_per_s > 0.0 && base.samples_per_s > 0.0);
    assert!((cluster.ratio - cluster.samples_per_s / base.samples_per_s).abs() < 1e-9);
}
