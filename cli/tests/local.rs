//! `gaps local` end to end: real shard and worker processes on 127.0.0.1, the JSON summary, clean shutdown.

use std::process::Command;

#[test]
fn gaps_local_trains_with_two_shards_and_four_workers_and_applies_every_push_once() {
    let out = Command::new(env!("CARGO_BIN_EXE_gaps"))
        .args(["local", "--servers", "2", "--workers", "4", "--steps", "100", "--json", "--timeout", "120s"])
        .env("GAPS_LOG", "warn")
        .output()
        .expect("run gaps local");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "gaps local failed:\n{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().expect("a JSON line");
    let v: serde_json::Value = serde_json::from_str(line).expect("valid JSON");
    for key in ["servers", "workers", "steps", "pushes_sent", "pushes_applied", "initial_loss", "final_loss", "wall_s"]
    {
        assert!(!v[key].is_null(), "missing {key} in {line}");
    }
    assert_eq!(v["servers"], 2);
    assert_eq!(v["workers"], 4);
    assert_eq!(v["steps"], 400);
    assert_eq!(v["pushes_sent"], v["pushes_applied"], "{line}");
    assert_eq!(v["pushes_applied"], 800, "every step pushes to both shards: {line}");
    let (initial, last) = (v["initial_loss"].as_f64().expect("number"), v["final_loss"].as_f64().expect("number"));
    assert!(last < initial / 2.0, "loss {initial} -> {last}");
}

#[test]
fn gaps_local_refuses_bad_flags_with_a_clear_message() {
    let out = Command::new(env!("CARGO_BIN_EXE_gaps")).args(["local", "--servers", "0"]).output().expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--servers"));
    let out = Command::new(env!("CARGO_BIN_EXE_gaps")).args(["local", "--rule", "adamw"]).output().expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown rule"));
    let out =
        Command::new(env!("CARGO_BIN_EXE_gaps")).args(["local"]).env("GAPS_WORKERS", "many").output().expect("run");
    assert!(!out.status.success(), "environment variables are parsed like flags");
}

/// `gaps bench transport --quick --gaps-only --json` with `more` flags (one round a case).
fn transport_bench(more: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gaps"))
        .args(["bench", "transport", "--quick", "--gaps-only", "--json"])
        .args(more)
        .env("GAPS_LOG", "warn")
        .output()
        .expect("run gaps bench transport")
}

/// The JSON lines of a successful bench run.
fn json_lines(out: &std::process::Output) -> Vec<serde_json::Value> {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect()
}

fn case_names(lines: &[serde_json::Value]) -> Vec<&str> {
    lines.iter().map(|l| l["case"].as_str().expect("a case name")).collect()
}

#[test]
fn the_transport_bench_measures_the_sizes_it_is_given() {
    let bench = |floats: &str| transport_bench(&["--only", "push_pull", "--floats", floats]);
    let lines = json_lines(&bench("64Ki,1000,65536"));
    // Each size once, smallest first; the small size in f32 only, the bulk size in f32 and bfloat16.
    assert_eq!(case_names(&lines), ["push_pull_1shard_1000", "push_pull_1shard_64Ki", "push_pull_1shard_64Ki_bf16"]);
    for bad in ["0", "65Mi", "lots"] {
        let out = bench(bad);
        assert!(!out.status.success(), "--floats {bad} was taken");
        assert!(String::from_utf8_lossy(&out.stderr).contains("--floats"), "{}", String::from_utf8_lossy(&out.stderr));
    }
}

/// `--processes`: the same cases against `gaps server` processes (a dense case and the two sparse ones, one
/// round each), said so in every JSON line; the cases with copies are left out there.
#[test]
fn the_transport_bench_runs_its_shards_as_processes_when_asked() {
    let lines = json_lines(&transport_bench(&["--processes", "--floats", "1000"]));
    assert_eq!(
        case_names(&lines),
        ["push_pull_1shard_1000", "sparse_1shard_4096x16", "sparse_step_1shard_4096x16"],
        "{lines:?}"
    );
    for l in &lines {
        assert_eq!(l["processes"], true, "{l}");
        assert!(l["rounds"].as_u64() >= Some(1) && l["cpu_s_per_gb"].as_f64() > Some(0.0), "{l}");
    }
}

#[test]
fn gaps_certs_writes_a_loadable_cluster_ca_and_certificates() {
    let dir = std::env::temp_dir().join(format!("gaps-certs-test-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_gaps"))
        .args(["certs", "--out", dir.to_str().expect("utf-8 path"), "--san", "ps0.example.net,10.1.2.3"])
        .output()
        .expect("run gaps certs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let tls =
        gaps_transport::tls::TlsMaterial::load(&dir.join("ca.pem"), &dir.join("shard-0.pem"), &dir.join("shard-0.key"))
            .expect("load server material");
    tls.server_config().expect("server config");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join("ca.key")).expect("ca.key").permissions().mode();
        assert_eq!(mode & 0o077, 0, "private keys are readable by the owner only");
    }
    let bad_san = Command::new(env!("CARGO_BIN_EXE_gaps"))
        .args(["certs", "--out", dir.to_str().expect("utf-8 path"), "--san", "not a name!"])
        .output()
        .expect("run gaps certs");
    assert!(!bad_san.status.success(), "an invalid name is refused");
    let _ = std::fs::remove_dir_all(&dir);
}

fn run_local(args: &[&str]) -> serde_json::Value {
    let out =
        Command::new(env!("CARGO_BIN_EXE_gaps")).args(args).env("GAPS_LOG", "warn").output().expect("run gaps local");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "gaps local failed:\n{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().expect("a JSON line");
    // The summary reads back as its own type: every field present and of its type.
    let typed: Result<gaps_cli::local::LocalSummary, _> = serde_json::from_str(line);
    assert!(typed.is_ok(), "the summary does not read back as LocalSummary: {typed:?}\n{line}");
    serde_json::from_str(line).expect("valid JSON")
}

/// `gaps local` on a replicated DLRM cluster — three shard processes, two copies of each shard, two workers —
/// for `steps` steps in `mode`, with `more` flags (kills, restarts, checkpoints) added.
fn run_replicated(steps: &str, mode: &str, more: &[&str]) -> serde_json::Value {
    let mut args = vec!["local", "--model", "dlrm", "--servers", "3", "--workers", "2", "--replicas", "2"];
    args.extend(["--steps", steps, "--mode", mode, "--json", "--timeout", "300s"]);
    args.extend_from_slice(more);
    run_local(&args)
}

/// Each worker prints one ledger line per step; `gaps local` must read them while the run goes on. Before it
/// did, a run of more than about 500 steps filled the 64 KiB pipe and every worker stalled in `write` forever.
#[test]
fn a_long_run_whose_ledger_outgrows_a_pipe_finishes() {
    let steps = 3000;
    let v = run_local(&[
        "local",
        "--servers",
        "1",
        "--workers",
        "2",
        "--dim",
        "8",
        "--steps",
        "3000",
        "--json",
        "--timeout",
        "90s",
    ]);
    assert_eq!(v["steps"], 2 * steps, "{v}");
    assert_eq!(v["pushes_applied"], 2 * steps, "{v}");
    assert_eq!(v["pushes_lost"], 0, "{v}");
}

/// `--config FILE`: the command's table outranks shared keys; `GAPS_*` variables and flags outrank the file;
/// a bad key stops the binary with the file and the key named, for `gaps` and for the role binaries.
#[test]
fn a_config_file_sets_flags_below_variables_and_flags() {
    let dir = gaps_common::scratch_dir("gaps-config-local").expect("temp dir");
    let file = dir.join("gaps.toml");
    std::fs::write(
        &file,
        "servers = 1\nworkers = 3\nlisten = \"0.0.0.0:7000\"\n[local]\nworkers = 2\nsteps = 40\njson = true\n",
    )
    .expect("write");
    let config = format!("--config={}", file.display());
    let out = Command::new(env!("CARGO_BIN_EXE_gaps"))
        .args(["local", &config, "--steps", "15"])
        .env("GAPS_DIM", "8")
        .output()
        .expect("run gaps local");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().expect("a JSON line")).expect("JSON");
    assert_eq!((v["servers"].as_u64(), v["workers"].as_u64()), (Some(1), Some(2)), "{v}");
    assert_eq!(v["steps"], 2 * 15, "the flag outranks the file: {v}");
    let out = Command::new(env!("CARGO_BIN_EXE_gaps"))
        .args(["local", &config, "--steps", "5"])
        .env("GAPS_WORKERS", "1")
        .output()
        .expect("run gaps local");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().expect("a JSON line")).expect("JSON");
    assert_eq!(v["workers"], 1, "the variable outranks the file: {v}");

    // `gaps server` and `gaps worker` (the role binaries have the same test in their own packages).
    std::fs::write(&file, "[server]\nlisen = \"0.0.0.0:7000\"\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_gaps")).args(["server", &config]).output().expect("run gaps server");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("lisen") && stderr.contains("gaps.toml"), "{stderr}");
    std::fs::write(&file, "[worker]\nsteps = \"lots\"\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_gaps")).args(["worker", &config]).output().expect("run gaps worker");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--steps") && stderr.contains("lots"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dlrm_on_synthetic_data_reaches_the_teachers_auc_within_002() {
    let v = run_local(&[
        "local",
        "--model",
        "dlrm",
        "--data",
        "synthetic",
        "--servers",
        "2",
        "--workers",
        "4",
        "--json",
        "--timeout",
        "300s",
    ]);
    let (auc, teacher) = (v["auc"].as_f64().expect("auc"), v["teacher_auc"].as_f64().expect("teacher_auc"));
    assert!(auc >= teacher - 0.02, "AUC {auc} vs teacher {teacher}");
    assert_eq!(v["pushes_sent"], v["pushes_applied"]);
    assert!(v["table_rows"].as_u64().expect("rows") > 1000);
    assert!(v["samples_per_s"].as_f64().expect("rate") > 0.0);
    assert_eq!(v["bad_lines"], 0);
}

#[test]
fn a_criteo_file_with_bad_lines_trains_and_reports_them() {
    let data = gaps_models::criteo::SyntheticCriteo::new(3);
    let mut lines: Vec<String> =
        (0..6000).map(|i| gaps_models::criteo::SyntheticCriteo::to_line(&data.sample(i).0)).collect();
    lines[10] = "not a sample".into();
    lines[20] = lines[20].replacen('\t', "\t1.5", 1);
    lines[30] = lines[30].split('\t').take(12).collect::<Vec<_>>().join("\t");
    lines[40].push('\t'); // a trailing tab is fine
    let path = std::env::temp_dir().join(format!("gaps-criteo-test-{}.tsv", std::process::id()));
    std::fs::write(&path, lines.join("\r\n")).expect("write");
    let v = run_local(&[
        "local",
        "--model",
        "lr",
        "--data",
        path.to_str().expect("path"),
        "--steps",
        "30",
        "--batch",
        "128",
        "--json",
    ]);
    let _ = std::fs::remove_file(&path);
    assert_eq!(v["bad_lines"], 3, "{v}");
    let auc = v["auc"].as_f64().expect("auc");
    assert!(auc > 0.6, "AUC {auc}");
    assert!(v["teacher_auc"].is_null());
}

// The automatic mode switch on an injected straggler is checked on the virtual clock of
// `gaps_shard::testnet` (shard/tests/testnet.rs): here it hung on how fast this machine ran.

#[test]
fn killed_and_added_workers_leave_the_right_number_at_the_end_and_sync_never_stalls() {
    let v = run_local(&[
        "local",
        "--mode",
        "sync",
        "--lease",
        "1s",
        "--compute-delay",
        "10ms",
        "--kill-worker",
        "2@300ms",
        "--add-worker",
        "600ms",
        "--add-worker",
        "700ms",
        "--steps",
        "80",
        "--json",
        "--timeout",
        "120s",
    ]);
    assert_eq!(v["workers_final"], 5, "4 started, 1 killed, 2 added: {v}");
    assert!(v["steps_sync"].as_u64().expect("steps") > 0);
    // The killed worker's ledger is counted up to its last finished step; the step it was killed in may
    // have sent pushes nobody saw acknowledged (one step's worth). Nothing is lost, nothing applied twice.
    let (acked, applied, unconfirmed) = (
        v["pushes_acknowledged"].as_u64().expect("acked"),
        v["pushes_applied"].as_u64().expect("applied"),
        v["pushes_unconfirmed"].as_u64().expect("unconfirmed"),
    );
    assert_eq!(v["pushes_lost"], 0, "{v}");
    assert_eq!(unconfirmed, 2, "one killed worker, one step, two shards: {v}");
    assert!(acked <= applied && applied <= acked + unconfirmed, "{v}");
    assert!(v["pushes_sent"].as_u64().expect("sent") >= acked, "{v}");
    assert!(v["lr_multiplier_final"].as_f64().expect("multiplier") > 0.0);
}

#[test]
fn a_killed_shard_restarts_from_its_checkpoint_and_training_finishes() {
    let v = run_local(&[
        "local",
        "--servers",
        "2",
        "--workers",
        "2",
        "--steps",
        "250",
        "--compute-delay",
        "10ms",
        "--checkpoint-every",
        "500ms",
        "--kill-shard",
        "1@1200ms",
        "--restart-shard",
        "1@2200ms",
        "--json",
    ]);
    assert_eq!(v["shard_restarts"], 1, "{v}");
    assert!(v["restored_version"].as_u64().expect("version") > 0, "{v}");
    assert!(v["checkpoints_written"].as_u64().expect("count") >= 2, "{v}");
    let (acked, applied, lost) = (
        v["pushes_acknowledged"].as_u64().expect("acked"),
        v["pushes_applied"].as_u64().expect("applied"),
        v["pushes_lost"].as_u64().expect("lost"),
    );
    // No push is applied twice: the shards never apply more than the workers saw acknowledged; what a crash
    // lost is at most what one checkpoint interval held.
    assert!(applied <= acked, "{v}");
    assert_eq!(v["pushes_applied_twice"], 0, "{v}");
    // Lost is counted per worker and shard from the shards' ledgers, independently of the totals.
    assert_eq!(applied + lost, acked, "{v}");
    assert!(lost < acked / 4, "{v}");
    let (initial, last) = (v["initial_loss"].as_f64().expect("loss"), v["final_loss"].as_f64().expect("loss"));
    assert!(last < initial / 2.0, "{v}");
}

#[test]
fn workers_give_up_on_a_dead_shard_after_the_shard_down_timeout_and_name_it() {
    let started = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_gaps"))
        .args(["local", "--servers", "2", "--workers", "1", "--steps", "2000", "--compute-delay", "10ms"])
        .args(["--kill-shard", "1@800ms", "--shard-down-timeout", "2s", "--timeout", "60s"])
        .env("GAPS_LOG", "warn")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run gaps local");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a worker cannot finish without shard 1:\n{stderr}");
    assert!(stderr.contains("shard 1 stayed unreachable"), "{stderr}");
    assert!(started.elapsed() < std::time::Duration::from_secs(40), "took {:?}", started.elapsed());
}

/// A real cluster trains while both shards (the coordinator too) are SIGKILLed and restarted from their
/// checkpoints and a worker is SIGKILLed and another added, at times drawn from `seed`. Checks the job
/// finishes, the books balance (no push applied twice, every acknowledged push applied or counted lost),
/// and returns the final loss with the schedule.
fn chaos(seed: u64, steps: u64, mode: &str) -> (f64, Vec<String>) {
    use gaps_shard::testnet::Fault;
    let at = |at: &std::time::Duration| at.as_millis();
    let schedule: Vec<String> = gaps_shard::testnet::chaos_schedule(seed)
        .iter()
        .map(|(t, fault)| match fault {
            Fault::KillShard(i) => format!("--kill-shard={i}@{}ms", at(t)),
            Fault::RestartShard(i) => format!("--restart-shard={i}@{}ms", at(t)),
            Fault::KillWorker(w) => format!("--kill-worker={w}@{}ms", at(t)),
            Fault::AddWorker => format!("--add-worker={}ms", at(t)),
            other => panic!("the chaos schedule has no {other:?}"),
        })
        .collect();
    let steps = steps.to_string();
    let mut args = vec!["local", "--servers", "2", "--workers", "4", "--steps", &steps, "--compute-delay", "10ms"];
    args.extend(["--mode", mode, "--checkpoint-every", "500ms", "--json", "--timeout", "300s"]);
    args.extend(schedule.iter().map(String::as_str));
    let v = run_local(&args);
    assert_eq!(v["shard_restarts"], 2, "{schedule:?}: {v}");
    assert_eq!(v["workers_final"], 4, "{schedule:?}: {v}");
    assert!(v["restored_version"].as_u64().expect("version") > 0, "{schedule:?}: {v}");
    let (acked, applied, lost, unconfirmed) = (
        v["pushes_acknowledged"].as_u64().expect("acked"),
        v["pushes_applied"].as_u64().expect("applied"),
        v["pushes_lost"].as_u64().expect("lost"),
        v["pushes_unconfirmed"].as_u64().expect("unconfirmed"),
    );
    // No push applied twice (the shards never applied more than was acknowledged, plus what the killed
    // worker's last step may have sent); every acknowledged push applied or counted as lost.
    assert!(applied <= acked + unconfirmed, "{schedule:?}: {v}");
    assert!(acked <= applied + lost, "{schedule:?}: {v}");
    assert_eq!(v["pushes_applied_twice"], 0, "{schedule:?}: {v}");
    assert!(lost < acked / 4, "at most a checkpoint interval per crash: {schedule:?}: {v}");
    let (initial, last) = (v["initial_loss"].as_f64().expect("loss"), v["final_loss"].as_f64().expect("loss"));
    assert!(last < initial / 2.0, "{schedule:?}: {v}");
    (last, schedule)
}

fn undisturbed(steps: u64, mode: &str) -> f64 {
    let steps = steps.to_string();
    let v = run_local(&[
        "local",
        "--servers",
        "2",
        "--workers",
        "4",
        "--steps",
        &steps,
        "--compute-delay",
        "10ms",
        "--mode",
        mode,
        "--json",
    ]);
    v["final_loss"].as_f64().expect("loss")
}

/// Seeded chaos with real processes killed by SIGKILL (opt-in: `cargo test -p gaps-cli --test local --
/// --ignored stress_`): more seeds, longer jobs, async and sync. The same schedules run on every `cargo test`
/// on the virtual clock (`shard/tests/testnet.rs`, `chaos_over_seeds_and_modes`), where the job's length does
/// not depend on the machine.
#[test]
#[ignore = "stress test, minutes long: run with --ignored"]
fn stress_chaos_over_seeds_and_modes() {
    for mode in ["async", "sync"] {
        let calm = undisturbed(1200, mode);
        for seed in [1, 2, 3] {
            let (last, schedule) = chaos(seed, 1200, mode);
            assert!(last < 1.5 * calm, "{mode} seed {seed}: chaos {last} vs undisturbed {calm}: {schedule:?}");
        }
    }
}

/// The example in `deploy/config/gaps.toml` is accepted by every role it has a table for, every key of each
/// table is a flag of that role, and its values parse.
#[test]
fn the_example_config_file_is_valid_for_every_role() {
    use clap::{Args, Command as ClapCommand};
    use std::ffi::OsString;
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config/gaps.toml");
    let config =
        || clap::Arg::new("config").long("config").global(true).value_parser(clap::value_parser!(std::path::PathBuf));
    let roles = [
        ("gaps-server", gaps_server::cli::ServerArgs::augment_args(ClapCommand::new("gaps-server").arg(config()))),
        ("gaps-worker", gaps_worker::train::WorkerArgs::augment_args(ClapCommand::new("gaps-worker").arg(config()))),
    ];
    for (name, cmd) in roles {
        let argv: Vec<OsString> = vec![name.into(), format!("--config={}", example.display()).into()];
        let m = gaps_setup::config_file::parse_from(cmd, &argv).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(m.contains_id("cert"), "{name}");
    }
    let local = ClapCommand::new("gaps")
        .arg(config())
        .subcommand(gaps_cli::local::LocalArgs::augment_args(ClapCommand::new("local")));
    let argv: Vec<OsString> = vec!["gaps".into(), "local".into(), format!("--config={}", example.display()).into()];
    let m = gaps_setup::config_file::parse_from(local, &argv).expect("gaps local accepts the example");
    let l = m.subcommand_matches("local").expect("local");
    assert_eq!(l.get_one::<u32>("servers"), Some(&2));
}

/// 4,000 lines of synthetic Criteo-layout data (seed `seed`) in a temporary file.
fn synthetic_file(seed: u64, name: &str) -> std::path::PathBuf {
    let data = gaps_models::criteo::SyntheticCriteo::new(seed);
    let lines: Vec<String> =
        (0..4000).map(|i| gaps_models::criteo::SyntheticCriteo::to_line(&data.sample(i).0)).collect();
    let path = std::env::temp_dir().join(format!("gaps-criteo-{name}-{}.tsv", std::process::id()));
    std::fs::write(&path, lines.join("\n")).expect("write");
    path
}

/// A file of a few thousand lines with default flags: one pass (not a fixed number of steps that would go
/// over it many times), and a held-out log-loss below the best constant predictor's.
#[test]
fn a_small_file_is_trained_one_pass_by_default_and_does_not_overfit() {
    let path = synthetic_file(5, "epochs");
    let file = path.to_str().expect("path");
    let v = run_local(&["local", "--model", "dlrm", "--data", file, "--json"]);
    let twice = run_local(&["local", "--model", "dlrm", "--data", file, "--epochs", "2", "--json"]);
    let fixed = &["--data-sharding", "static"];
    let twice_static =
        run_local(&[&["local", "--model", "dlrm", "--data", file, "--epochs", "2", "--json"][..], fixed].concat());
    // Four asynchronous workers over 16 steps end wherever the interleaving takes them (0.53 to 0.60 seen);
    // one worker and one shard train the same pass in a fixed order.
    let one = run_local(&["local", "--model", "dlrm", "--data", file, "--servers", "1", "--workers", "1", "--json"]);
    let _ = std::fs::remove_file(&path);
    assert_eq!(v["epochs"], 1.0, "{v}");
    assert_eq!(twice["epochs"], 2.0, "{twice}");
    assert_eq!(twice_static["epochs"], 2.0, "{twice_static}");
    // Dealt (the default): 4,000 lines are 4 splits of 1,024 lines (the last 928), 922, 922, 922 and 835
    // training lines (every 10th is held out), 4 batches of 256 each (the last one short): 16 steps a pass,
    // whoever trains them.
    assert_eq!(
        (v["steps"].clone(), v["splits_done"].clone(), v["splits_per_epoch"].clone()),
        (16.into(), 4.into(), 4.into()),
        "{v}"
    );
    assert_eq!((twice["steps"].clone(), twice["splits_done"].clone()), (32.into(), 8.into()), "{twice}");
    assert_eq!(v["data_finished"], true, "{v}");
    // Static shares: line i to worker i mod 4: 800, 1000, 800 and 1000 lines, in batches of 256 that run on
    // from one pass into the next: 7 or 8 steps each for two passes.
    assert_eq!(twice_static["steps"], 7 + 8 + 7 + 8, "{twice_static}");
    assert_eq!(twice_static["data_sharding"], "static", "{twice_static}");
    assert_eq!(one["epochs"], 1.0, "{one}");
    let (loss, constant) = (one["logloss"].as_f64().expect("logloss"), one["constant_logloss"].as_f64().expect("c"));
    assert!(loss < constant, "held-out log-loss {loss} is not below the constant predictor's {constant}: {one}");
}

/// Many passes over a small file with --eval-every: the held-out curve turns up, the worker stops after
/// --patience evaluations without improvement, and the curve is in the JSON.
#[test]
fn early_stopping_ends_an_overfitting_run_on_the_held_out_curve() {
    let path = synthetic_file(6, "early");
    let file = path.to_str().expect("path");
    let args = ["--model", "dlrm", "--data", file, "--servers", "1", "--workers", "1", "--epochs", "40"];
    let v = run_local(&[&["local"], &args[..], &["--eval-every", "7", "--patience", "2", "--json"]].concat());
    let _ = std::fs::remove_file(&path);
    // 3,600 training lines in batches of 256: 15 steps a pass, 40 passes are 563 steps.
    assert_eq!(v["stopped_early"], 1, "{v}");
    let steps = v["steps"].as_u64().expect("steps");
    assert!(steps < 563, "ran {steps} steps: {v}");
    let curve = v["heldout_curve"].as_array().expect("curve");
    assert_eq!(curve.len() as u64, steps / 7, "one point every 7 steps: {v}");
    let losses: Vec<f64> = curve.iter().map(|p| p["logloss"].as_f64().expect("logloss")).collect();
    // The best as early stopping counts it: a gain under 1e-4 (relative) is no improvement.
    let mut at = 0;
    for (i, l) in losses.iter().enumerate() {
        if *l < losses[at] * (1.0 - 1e-4) {
            at = i;
        }
    }
    let best = losses[at];
    // It stopped two evaluations after its best, and the best beats the constant predictor.
    assert_eq!(at + 3, losses.len(), "{losses:?}");
    assert!(best < v["constant_logloss"].as_f64().expect("constant"), "{v}");
}

/// `gaps synth-data` writes lines the Criteo reader accepts, refuses to overwrite a file, and refuses a
/// Zipf exponent out of range.
#[test]
fn synth_data_writes_a_readable_file_and_refuses_bad_flags() {
    let dir = gaps_common::scratch_dir("gaps-synth").expect("dir");
    let path = dir.join("data.tsv");
    let file = path.to_str().expect("utf-8 path");
    let gen = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_gaps"))
            .args([&["synth-data", "--lines", "500", "--max-vocab", "100000", "--out", file][..], extra].concat())
            .output()
            .expect("run gaps synth-data")
    };
    let ok = gen(&["--zipf", "1.05"]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let text = std::fs::read_to_string(&path).expect("read");
    let mut reader = gaps_models::criteo::CriteoReader::new(std::io::Cursor::new(text.as_bytes()));
    let mut n = 0;
    while reader.next_sample().is_some() {
        n += 1;
    }
    assert_eq!((n, reader.bad_lines), (500, 0));
    let again = gen(&[]);
    assert!(!again.status.success(), "an existing file is not overwritten");
    assert_eq!(std::fs::read_to_string(&path).expect("read"), text);
    std::fs::remove_file(&path).expect("remove");
    let bad = gen(&["--zipf", "0.5"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--zipf"), "{}", String::from_utf8_lossy(&bad.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `gaps local --step-log` writes the workers' times per step; `gaps sim --profile` and `gaps sim sweep
/// --profile` replay them. The straggler's steps sleep at least 3 × 10 ms, the others at least 10 ms.
#[test]
fn a_step_log_of_gaps_local_is_replayed_by_the_simulator() {
    let path = std::env::temp_dir().join(format!("gaps-step-log-{}.csv", std::process::id()));
    let p = path.to_str().expect("utf-8 path");
    let v = run_local(&[
        "local",
        "--workers",
        "2",
        "--steps",
        "30",
        "--straggler",
        "1:3",
        "--step-log",
        p,
        "--json",
        "--timeout",
        "120s",
    ]);
    assert_eq!(v["steps"], 60);
    let text = std::fs::read_to_string(&path).expect("the step log");
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("worker,seconds"));
    let mut by_worker: std::collections::BTreeMap<u64, Vec<f64>> = Default::default();
    for line in lines {
        let (w, s) = line.split_once(',').expect("worker,seconds");
        by_worker.entry(w.parse().expect("worker id")).or_default().push(s.parse().expect("seconds"));
    }
    assert_eq!(by_worker.len(), 2, "{text}");
    assert!(by_worker.values().all(|t| t.len() == 30), "{text}");
    let median = |t: &Vec<f64>| {
        let mut t = t.clone();
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    let mut medians: Vec<f64> = by_worker.values().map(median).collect();
    medians.sort_by(f64::total_cmp);
    assert!(medians[0] >= 0.010 && medians[1] >= 0.030, "medians {medians:?}");

    let out = Command::new(env!("CARGO_BIN_EXE_gaps"))
        .args(["sim", "--profile", p, "--workers", "4", "--mode", "sync", "--epochs", "1", "--json"])
        .output()
        .expect("run gaps sim");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let r: serde_json::Value = serde_json::from_str(stdout.lines().last().expect("JSON")).expect("valid JSON");
    assert_eq!(r["time_unit"], "seconds");
    // 128 rounds of four workers, each round waiting for a replayed straggler step (≥ 30 ms).
    let wall = r["sim_wall_time"].as_f64().expect("number");
    assert!(wall >= 128.0 * 0.030, "{wall}");

    let out = Command::new(env!("CARGO_BIN_EXE_gaps"))
        .args(["sim", "sweep", "--profile", p, "--workers", "2,4", "--modes", "sync,async", "--epochs", "2", "--json"])
        .output()
        .expect("run gaps sim sweep");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("| N | sync | async |") && stdout.contains("N* ≈"), "{stdout}");
    let s: serde_json::Value = serde_json::from_str(stdout.lines().last().expect("JSON")).expect("valid JSON");
    assert_eq!(s["cells"].as_array().map(Vec::len), Some(4), "{s}");
    assert_eq!(s["time_unit"], "seconds");

    // A broken log is refused with its line.
    std::fs::write(&path, "worker,seconds\n0,0.01\n0,fast\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_gaps")).args(["sim", "--profile", p]).output().expect("run gaps sim");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("line 3") && stderr.contains("fast"), "{stderr}");
    let _ = std::fs::remove_file(&path);
}

/// Hundreds of worker processes started at once on a small machine all join (registration and shard
/// connections are tried again with a jittered backoff) and every push is applied once.
#[test]
fn five_hundred_and_twelve_workers_started_at_once_all_join_and_every_push_is_applied() {
    let out = Command::new(env!("CARGO_BIN_EXE_gaps"))
        .args(["local", "--workers", "512", "--steps", "50", "--json", "--timeout", "600s"])
        .env("GAPS_LOG", "warn")
        .output()
        .expect("run gaps local");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let said: Vec<&str> = stderr.lines().filter(|l| l.contains("Error") || l.starts_with("[gaps local]")).collect();
    assert!(out.status.success(), "gaps local --workers 512 failed:\n{}", said.join("\n"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().expect("a JSON line");
    let v: serde_json::Value = serde_json::from_str(line).expect("valid JSON");
    assert_eq!(v["workers"], 512);
    assert_eq!(v["workers_final"], 512, "{line}");
    assert_eq!(v["pushes_sent"], v["pushes_applied"], "{line}");
    assert_eq!(v["pushes_applied"], 512 * 50 * 2, "{line}");
}

/// Consistent recovery: in `sync` and `gba` a shard killed and restarted from its checkpoint brings the whole
/// cluster back to one cluster checkpoint that every shard holds — every shard reports the same checkpoint
/// and the same step — and the job finishes with no push applied twice (by the shards' own ledgers). (Before, only the killed shard went
/// back, the others stayed steps ahead and the workers gave up on a step that never completed.)
#[test]
fn a_shard_restart_in_sync_or_gba_returns_every_shard_to_the_same_checkpoint_and_step() {
    for (mode, shard) in [("sync", "0"), ("gba", "1")] {
        let out = Command::new(env!("CARGO_BIN_EXE_gaps"))
            .args(["local", "--servers", "2", "--workers", "4", "--steps", "300", "--compute-delay", "10ms"])
            .args(["--checkpoint-every", "500ms", "--mode", mode, "--json", "--keep-dir", "--timeout", "300s"])
            .args(["--kill-shard", &format!("{shard}@1500ms"), "--restart-shard", &format!("{shard}@2500ms")])
            .env("GAPS_LOG", "warn")
            .output()
            .expect("run gaps local");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{mode}, shard {shard}: gaps local failed:\n{stderr}");
        let v: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().expect("JSON")).expect("JSON");
        assert_eq!(v["shard_restarts"], 1, "{mode}: {v}");
        let (acked, applied, unconfirmed) = (
            v["pushes_acknowledged"].as_u64().expect("acked"),
            v["pushes_applied"].as_u64().expect("applied"),
            v["pushes_unconfirmed"].as_u64().expect("unconfirmed"),
        );
        assert!(applied <= acked + unconfirmed, "{mode}: no push applied twice: {v}");
        assert_eq!(v["pushes_applied_twice"], 0, "{mode}: the shards' ledgers saw no push twice: {v}");
        // Each shard logs the checkpoint and step it rolled back to.
        let dir = stderr
            .lines()
            .find_map(|l| l.strip_prefix("[gaps local] certificates and logs are in "))
            .expect("the run's folder")
            .trim()
            .to_string();
        let mut back = Vec::new();
        for s in 0..2 {
            let log = std::fs::read_to_string(format!(
                "{dir}/shard-{s}{}.log",
                if s.to_string() == shard { "-restart" } else { "" }
            ))
            .expect("a shard's log");
            let line = log
                .lines()
                .rfind(|l| l.contains("rolled back to a cluster checkpoint"))
                .unwrap_or_else(|| panic!("{mode}: shard {s} did not roll back:\n{log}"));
            let field = |name: &str| -> u64 {
                let at = line.find(&format!("{name}=")).unwrap_or_else(|| panic!("no {name} in {line}"));
                line[at + name.len() + 1..].split_whitespace().next().and_then(|v| v.parse().ok()).expect("a number")
            };
            back.push((field("checkpoint"), field("step")));
        }
        assert_eq!(back[0].0, back[1].0, "{mode}: every shard went back to the same checkpoint: {back:?}");
        // Cluster checkpoints in sync and GBA are taken at one step on every shard.
        assert_eq!(back[0].1, back[1].1, "{mode}: and to the same step: {back:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Dynamic data sharding under faults: a worker SIGKILLed mid-pass and the coordinator (which deals the
/// splits) SIGKILLed and restarted from its checkpoint. Reading the shards' own per-grant sample counts
/// (not the workers' reports) and the file itself: every split of both passes was finished under exactly
/// one grant, whose samples every shard counted exactly once; what was trained under grants that did not
/// finish is what the dealer reports as replayed.
#[test]
fn every_line_is_trained_once_a_pass_through_a_killed_worker_and_a_restarted_coordinator() {
    dealing_through_faults("sync");
}

/// The same in async, where only the coordinator goes back to its checkpoint (the other shard keeps what
/// was trained since): the dealer's journal makes again the changes after the checkpoint, so no split
/// finished since is dealt a second time in its pass. The other shard counted every split's lines exactly
/// once; the restored coordinator at most that (what it had applied since its checkpoint is lost).
#[test]
fn in_async_a_restarted_coordinator_deals_no_finished_split_again() {
    dealing_through_faults("async");
}

fn dealing_through_faults(mode: &str) {
    const LINES: u64 = 8000;
    const SPLIT: u64 = 400;
    let data = gaps_models::criteo::SyntheticCriteo::new(11);
    let bad = [15u64, 1234, 5001, 7999];
    let text: Vec<String> = (1..=LINES)
        .map(|line| {
            if bad.contains(&line) {
                "1\tnot\ta\tsample".to_string()
            } else {
                gaps_models::criteo::SyntheticCriteo::to_line(&data.sample(line).0)
            }
        })
        .collect();
    let dir = gaps_common::scratch_dir(&format!("gaps-dealing-{mode}")).expect("dir");
    let path = dir.join("train.tsv");
    std::fs::write(&path, text.join("\n") + "\n").expect("write");
    let status = dir.join("status.json");
    // In async the coordinator is killed well after a checkpoint, so that splits are finished between the
    // two (what the journal is for).
    let (checkpoint_every, kill, restart) =
        if mode == "async" { ("1s", "0@1900ms", "0@2400ms") } else { ("300ms", "0@1500ms", "0@2000ms") };
    let v = run_local(&[
        "local",
        "--model",
        "dlrm",
        "--data",
        path.to_str().expect("path"),
        "--split-lines",
        &SPLIT.to_string(),
        "--epochs",
        "2",
        "--batch",
        "64",
        "--servers",
        "2",
        "--workers",
        "4",
        "--mode",
        mode,
        "--compute-delay",
        "15ms",
        "--lease",
        "3s",
        "--checkpoint-every",
        checkpoint_every,
        "--kill-worker",
        "3@700ms",
        "--kill-shard",
        kill,
        "--restart-shard",
        restart,
        "--data-status-out",
        status.to_str().expect("path"),
        "--json",
        "--timeout",
        "300s",
    ]);
    let text = std::fs::read_to_string(&status).expect("status file");
    let typed: Result<gaps_cli::local::DataStatusFile, _> = serde_json::from_str(&text);
    assert!(typed.is_ok(), "the data status does not read back as DataStatusFile: {typed:?}");
    let report: serde_json::Value = serde_json::from_str(&text).expect("status JSON");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(v["shard_restarts"], 1, "{v}");
    assert_eq!(v["data_finished"], true, "{v}");
    // The file's own training lines per split: lines k·400+1 ..= (k+1)·400, less every 10th (held out) and
    // the bad ones.
    let splits = LINES / SPLIT;
    let expected =
        |k: u64| (k * SPLIT + 1..=(k + 1) * SPLIT).filter(|l| l % 10 != 0 && !bad.contains(l)).count() as u64;
    let shards = report["shards"].as_array().expect("shards");
    assert_eq!(shards.len(), 2);
    let dealer = &shards[0]["dealer"];
    assert_eq!(dealer["splits_per_epoch"], splits, "{dealer}");
    let counts: Vec<std::collections::BTreeMap<u64, u64>> = shards
        .iter()
        .map(|s| {
            s["counts"]
                .as_array()
                .expect("counts")
                .iter()
                .map(|c| (c[0].as_u64().expect("grant"), c[2].as_u64().expect("samples")))
                .collect()
        })
        .collect();
    let mut finished: std::collections::BTreeMap<u64, Vec<u64>> = std::collections::BTreeMap::new();
    for c in dealer["completed"].as_array().expect("completed") {
        finished.entry(c[1].as_u64().expect("split")).or_default().push(c[0].as_u64().expect("grant"));
    }
    for epoch in 0..2u64 {
        for k in 0..splits {
            let key = epoch << 32 | k;
            let grants = finished.get(&key).cloned().unwrap_or_default();
            assert_eq!(grants.len(), 1, "{mode}: split {k} of pass {epoch} finished under grants {grants:?}: {dealer}");
            for (s, shard) in counts.iter().enumerate() {
                let counted = shard.get(&grants[0]).copied().unwrap_or(0);
                let message = format!("{mode}: shard {s}, split {k} of pass {epoch} (grant {})", grants[0]);
                if mode == "async" && s == 0 {
                    assert!(counted <= expected(k), "{message}: {counted} > {}", expected(k));
                } else {
                    assert_eq!(counted, expected(k), "{message}");
                }
            }
        }
    }
    assert_eq!(finished.values().map(Vec::len).sum::<usize>() as u64, 2 * splits, "{dealer}");
    // Nothing was trained under a grant the dealer does not know (in async a coordinator restored without
    // its journal would not know the grants dealt after its checkpoint, which the other shard counted).
    let known: std::collections::BTreeSet<u64> = finished
        .values()
        .flatten()
        .copied()
        .chain(dealer["abandoned"].as_array().expect("abandoned").iter().map(|g| g.as_u64().expect("grant")))
        .collect();
    for (s, shard) in counts.iter().enumerate() {
        let unknown: Vec<&u64> = shard.keys().filter(|g| !known.contains(g)).collect();
        assert!(
            unknown.is_empty(),
            "{mode}: shard {s} counted samples under grants {unknown:?} the dealer does not know"
        );
    }
    // The killed worker held a split, and the coordinator's restart gave back those on loan at its
    // checkpoint: what was trained under them is the replay the dealer reports.
    assert!(dealer["splits_returned"].as_u64().expect("returned") >= 1, "{dealer}");
    let replayed: u64 = dealer["abandoned"]
        .as_array()
        .expect("abandoned")
        .iter()
        .map(|g| counts[0].get(&g.as_u64().expect("grant")).copied().unwrap_or(0))
        .sum();
    assert_eq!(replayed, dealer["samples_replayed"].as_u64().expect("replayed"), "{dealer}");
    assert_eq!(v["samples_replayed"], dealer["samples_replayed"], "{v}");
}

/// `gaps bench stragglers` on a small file: a row per (profile, mode) with a wall time, an AUC, a
/// simulated speed-up, and an SVG of the AUC curves.
#[test]
fn the_straggler_bench_runs_every_mode_and_predicts_its_speed_up() {
    let dir = gaps_common::scratch_dir("gaps-bench-stragglers-test").expect("dir");
    let svg = dir.join("curves.svg");
    let out = Command::new(env!("CARGO_BIN_EXE_gaps"))
        .args([
            "bench",
            "stragglers",
            "--lines",
            "3000",
            "--epochs",
            "1",
            "--profiles",
            "slow",
            "--modes",
            "sync,async",
        ])
        .args(["--json", "--svg", svg.to_str().expect("path")])
        .env("GAPS_LOG", "warn")
        .output()
        .expect("run the bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let rows: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for r in &rows {
        assert_eq!(r["profile"], "slow");
        assert!(r["wall_s"].as_f64().expect("wall") > 0.0, "{r}");
        assert!(r["auc"].as_f64().expect("auc") > 0.6, "{r}");
        assert!(r["predicted_speedup"].as_f64().expect("predicted") > 0.0, "{r}");
    }
    // The simulator replays a 4x straggler: async is predicted well ahead of sync.
    let asyncrow = rows.iter().find(|r| r["mode"] == "async").expect("async");
    assert!(asyncrow["predicted_speedup"].as_f64().expect("predicted") > 1.5, "{asyncrow}");
    assert!(stderr.contains("speed-up") && stderr.contains("predicted"), "{stderr}");
    let plot = std::fs::read_to_string(&svg).expect("svg");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(plot.starts_with("<svg") && plot.matches("<polyline").count() == 2, "{plot}");
}

/// One shard process killed and started again, its shard taken over once (timed), then served by the
/// processes `serving` (per shard), with process `spare` left a spare.
fn one_takeover(v: &serde_json::Value, serving: [u32; 3], spare: u32) {
    assert_eq!(v["failovers"], 1, "{v}");
    let took = v["failover_s"][0].as_f64().expect("a fail-over time");
    assert!(took > 0.0 && took < 60.0, "{v}");
    assert_eq!(v["serving"], serde_json::json!(serving), "{v}");
    assert_eq!(v["spare_processes"], serde_json::json!([spare]), "{v}");
    assert_eq!(v["shard_restarts"], 1, "{v}");
}

/// Every acknowledged push applied exactly once.
fn nothing_lost_or_applied_twice(v: &serde_json::Value) {
    assert_eq!(v["pushes_lost"], 0, "{v}");
    assert_eq!(v["pushes_applied_twice"], 0, "{v}");
    assert_eq!(v["pushes_applied"], v["pushes_acknowledged"], "{v}");
}

/// Issue 34: with `--replicas 2`, shard 1's process SIGKILLed mid-run is taken over by its backup (process
/// 2), and started again empty it comes back as a spare that keeps a copy of shard 1; the summary says who
/// serves what, counts the take-over, and nothing acknowledged is lost or applied twice. (Whether the spare's
/// copy caught up before the run ended depends on the machine's speed, so only its place is checked.)
#[test]
fn a_killed_replicated_shard_is_taken_over_and_the_summary_says_so() {
    let v = run_replicated("400", "async", &["--kill-shard", "1@1s", "--restart-shard", "1@2.5s"]);
    // The take-over was seen: the backup asks after 1 s of silence, the coordinator probes for 0.5 s.
    one_takeover(&v, [0, 2, 2], 1);
    let in_sync = &v["backups_in_sync"];
    // Shard 0's backups are those a majority chose last: process 1's copy, once the spare caught up again.
    let shard0 = in_sync[0].as_array().expect("shard 0's backups, chosen by a majority");
    assert!(shard0.iter().all(|p| p == 1), "{v}");
    // Shard 2's copy lives on process 0 throughout; shard 1's backup can only be the spare.
    assert_eq!(in_sync[2], serde_json::json!([0]), "{v}");
    let shard1 = in_sync[1].as_array().expect("shard 1's backups");
    assert!(shard1.iter().all(|p| p == 1), "{v}");
    // Each shard's serving process reports how far its in-sync backups fell behind at most (how far depends
    // on timing: only that every shard reports it).
    let lag = v["replica_lag_peak"].as_array().expect("replica_lag_peak");
    assert_eq!(lag.len(), 3, "{v}");
    assert!(lag.iter().all(|l| l.as_u64().is_some()), "{v}");
    // Re-replication, per shard as its serving process copied it: shard 2's process copied it to process 0
    // once (a snapshot, then the log until it caught up); every copy listed took a snapshot of some bytes.
    let copies = v["rereplication"].as_array().expect("rereplication");
    assert_eq!(copies.len(), 3, "{v}");
    let shard2 = copies[2].as_array().expect("shard 2's copies");
    assert!(shard2.iter().any(|c| c["backup"] == 0 && c["live"] == true), "{v}");
    for c in copies.iter().flat_map(|s| s.as_array().expect("copies").iter()) {
        assert!(c["snapshots"].as_u64() >= Some(1) && c["bytes"].as_u64() > Some(0), "{c}");
        assert!(c["pause_peak_s"].as_f64().is_some_and(|p| p > 0.0), "{c}");
    }
    nothing_lost_or_applied_twice(&v);
}

/// Every shard process of a replicated cluster killed at once and started again, no takeover before (every
/// copy lost): the processes settle who serves shard 0 while each waits to join (starting processes say they
/// hold no copy; process 0, which backs up shard 2, drops itself from its restored tables' in-sync sets, so
/// process 2 does not wait for that lost copy), and training finishes from the shards' checkpoints, nothing
/// applied twice. (Async: each shard restores its own checkpoint.)
#[test]
fn a_replicated_cluster_killed_whole_starts_again_from_its_checkpoints() {
    let v = run_replicated(
        "200",
        "async",
        &["--checkpoint-every", "300ms", "--kill-shard", "0@1s,1@1s,2@1s", "--restart-shard", "0@1.5s,1@1.5s,2@1.5s"],
    );
    assert_eq!(v["shard_restarts"], 3, "{v}");
    // Each process serves its own shard again — on its own endpoint, or, where it joined before the process
    // its restored tables listed as its backup in sync (and waited as a spare until that one said it holds
    // nothing), on an endpoint of its own: `spare_processes` depends on the order of the joins.
    assert_eq!(v["serving"], serde_json::json!([0, 1, 2]), "{v}");
    // Every shard is copied again, a spare's copies included (they go to its own endpoint).
    let in_sync = v["backups_in_sync"].as_array().expect("backups in sync").clone();
    assert!(in_sync.iter().all(|b| b.as_array().is_some_and(|b| !b.is_empty())), "{v}");
    assert_eq!(v["pushes_applied_twice"], 0, "{v}");
    assert_eq!(v["steps"], 400, "{v}");
}

/// Shards taken over, then every shard process of the replicated cluster killed at once and started again
/// (every copy lost): process 1, which took shard 0 over, serves it again from its checkpoint at a new address
/// once a majority of the starting processes chose so (each says it holds no copy); process 0, which took
/// shard 2 over after process 2 was killed and started again at once (process 2 then waited for it as a
/// spare), has shard 2 granted back and serves it again; processes 0 and 2 come back as spares. Training
/// finishes from the checkpoints, nothing applied twice. (Async: each shard restores its own checkpoint; the
/// same in sync went through the cluster rollback in every sitting here, but a whole-cluster restart in sync
/// failed once under CI's load, so it is not asserted yet.)
#[test]
fn a_replicated_cluster_killed_whole_after_takeovers_serves_them_again_from_its_checkpoints() {
    let v = run_replicated(
        "800",
        "async",
        &[
            "--checkpoint-every",
            "300ms",
            "--kill-shard",
            "0@1s,2@4s,0@7.5s,1@7.5s,2@7.5s",
            "--restart-shard",
            "0@2.5s,2@4.1s,0@8s,1@8s,2@8s",
        ],
    );
    assert_eq!(v["shard_restarts"], 5, "{v}");
    assert_eq!(v["serving"], serde_json::json!([1, 1, 0]), "{v}");
    // Process 1 may be listed too: joining before process 2 did, its shard still listed a backup in sync,
    // so it waited as a spare and had shard 1 granted back on an endpoint of its own.
    let spare = v["spare_processes"].as_array().expect("spare processes").clone();
    assert!(spare.contains(&0.into()) && spare.contains(&2.into()), "{v}");
    assert_eq!(v["pushes_applied_twice"], 0, "{v}");
    assert_eq!(v["steps"], 1600, "{v}");
}

/// The coordinator's process (shard 0) killed with SIGKILL: a majority of the other two chooses its backup,
/// process 1, to serve shard 0; workers find it and finish; process 0, started again, learns so from
/// process 1 and comes back as a spare keeping a copy of shard 0 — nothing acknowledged lost or applied
/// twice, and the summary says who serves what.
#[test]
fn a_killed_coordinator_is_taken_over_by_a_majoritys_choice_and_the_summary_says_so() {
    let v = run_replicated("400", "sync", &["--kill-shard", "0@1s", "--restart-shard", "0@2.5s"]);
    one_takeover(&v, [1, 1, 2], 0);
    // Shard 0's only other copy can be the spare's; shard 1's backup (process 2) stayed up throughout.
    let shard0 = v["backups_in_sync"][0].as_array().expect("shard 0's backups");
    assert!(shard0.iter().all(|p| p == 0), "{v}");
    assert_eq!(v["backups_in_sync"][1], serde_json::json!([2]), "{v}");
    nothing_lost_or_applied_twice(&v);
}
