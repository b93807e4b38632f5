//! `gaps bench stragglers`: the same DLRM job (2 shards × 4 workers, a file trained two passes, dealt in
//! splits) in sync, gba, async and auto, under three straggler profiles — none, one worker 4× slower, one
//! worker that stalls for a while — through `gaps local` (real processes on loopback). Per run: wall time,
//! its speed-up over sync under the same profile, time to a target held-out AUC (the observer evaluates
//! while training runs), final AUC and log-loss, gradients dropped, mode switches; and beside the measured
//! speed-up, the simulator's prediction for that run's own step-time profile (`gaps sim --profile` on its
//! step log).

use crate::local::{run_with, LocalArgs};
use anyhow::{bail, Context, Result};
use clap::Parser;
use std::path::{Path, PathBuf};

#[derive(Debug, Parser)]
struct Wrapper {
    #[command(flatten)]
    args: LocalArgs,
}

/// Flags of `gaps bench stragglers`.
#[derive(Debug, Clone, clap::Args)]
pub struct StragglerBenchArgs {
    /// The training file (Criteo layout). Default: a synthetic file of `--lines` lines written to a
    /// temporary folder.
    #[arg(long, env = "GAPS_BENCH_DATA")]
    pub data: Option<PathBuf>,
    /// Lines of the default synthetic file.
    #[arg(long, env = "GAPS_BENCH_LINES", default_value_t = 60_000)]
    pub lines: u64,
    /// Passes over the file.
    #[arg(long, env = "GAPS_BENCH_EPOCHS", default_value_t = 2)]
    pub epochs: u64,
    /// Runs per (profile, mode); the table shows means.
    #[arg(long, env = "GAPS_BENCH_RUNS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub runs: u32,
    /// Profiles to run: none, slow (worker 1 4× slower throughout), stall (worker 1 10× slower for the
    /// first 1.5 s).
    #[arg(long, value_delimiter = ',', default_value = "none,slow,stall")]
    pub profiles: Vec<String>,
    /// Modes to run.
    #[arg(long, value_delimiter = ',', default_value = "sync,gba,async,auto")]
    pub modes: Vec<String>,
    /// The held-out AUC whose first reaching is timed (default: 0.99 × sync's final AUC under the same
    /// profile).
    #[arg(long)]
    pub target_auc: Option<f64>,
    /// Seconds between the observer's evaluations during a run.
    #[arg(long, default_value_t = 0.25)]
    pub eval_interval_s: f64,
    /// Print one JSON line per run on stdout.
    #[arg(long)]
    pub json: bool,
    /// Write a plot of held-out AUC against time for every mode of each profile (the first run of each) to
    /// this SVG file.
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

/// One run's results.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StragglerRun {
    /// The straggler profile.
    pub profile: String,
    /// The mode.
    pub mode: String,
    /// Wall seconds of training.
    pub wall_s: f64,
    /// Held-out AUC at the end.
    pub auc: f64,
    /// Held-out log-loss at the end.
    pub logloss: f64,
    /// Seconds from the start of training to the first evaluation at or above the target (None: never).
    pub time_to_target_s: Option<f64>,
    /// Gradients dropped as stale (switches included) and row gradients dropped.
    pub dropped: u64,
    /// Mode switches.
    pub switches: u64,
    /// The simulator's speed-up of this mode over sync for this run's step-time profile.
    pub predicted_speedup: f64,
    /// Samples trained under grants that did not finish.
    pub samples_replayed: u64,
    /// The observer's evaluations: (seconds since training started, AUC, log-loss). Not in the JSON line.
    #[serde(skip)]
    pub timeline: Vec<(f64, f64, f64)>,
}

/// The `gaps local` flags of one run.
fn local_args(data: &Path, epochs: u64, mode: &str, profile: &str, step_log: &Path, every: f64) -> Result<LocalArgs> {
    let mut argv: Vec<String> = ["local", "--model", "dlrm", "--servers", "2", "--workers", "4", "--json"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    argv.extend([
        format!("--data={}", data.display()),
        format!("--epochs={epochs}"),
        format!("--mode={mode}"),
        format!("--step-log={}", step_log.display()),
        format!("--eval-interval={}ms", (every * 1000.0).round() as u64),
        "--eval-samples=5000".into(),
        // The same emulated compute per step in every profile, so that only the straggler differs.
        "--compute-delay=10ms".into(),
    ]);
    match profile {
        "none" => {}
        "slow" => argv.push("--straggler=1:4".into()),
        "stall" => argv.push("--straggler=1:10:1500ms".into()),
        other => bail!("unknown straggler profile {other:?}: use none, slow or stall"),
    }
    Ok(Wrapper::try_parse_from(&argv).context("building the local-cluster flags")?.args)
}

/// The simulator's wall time for `mode` replaying the step log `profile` with 4 workers.
fn simulated_wall(profile: &Path, mode: &str) -> Result<f64> {
    let mut args = gaps_sim::SimArgs::defaults();
    args.workers = 4;
    args.epochs = 1;
    args.profile = Some(profile.to_path_buf());
    args.mode = match mode {
        "sync" => gaps_sim::SimMode::Sync,
        "gba" => gaps_sim::SimMode::Gba,
        "async" => gaps_sim::SimMode::Async,
        "auto" => gaps_sim::SimMode::Auto,
        other => bail!("unknown mode {other:?}"),
    };
    Ok(gaps_sim::run(&args).with_context(|| format!("simulating {mode} on {}", profile.display()))?.sim_wall_time)
}

/// Runs every (profile, mode) `runs` times.
pub async fn run(args: &StragglerBenchArgs, exe: &Path) -> Result<Vec<StragglerRun>> {
    let dir = std::env::temp_dir().join(format!("gaps-bench-stragglers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let data = match &args.data {
        Some(d) => d.clone(),
        None => {
            let path = dir.join("train.tsv");
            let synthetic = gaps_models::criteo::SyntheticCriteo::new(1);
            let mut text = String::new();
            for i in 0..args.lines {
                text.push_str(&gaps_models::criteo::SyntheticCriteo::to_line(&synthetic.sample(i).0));
                text.push('\n');
            }
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
            path
        }
    };
    let mut out = Vec::new();
    for profile in &args.profiles {
        let mut rows: Vec<StragglerRun> = Vec::new();
        for mode in &args.modes {
            for run in 0..args.runs {
                let log = dir.join(format!("steps-{profile}-{mode}-{run}.csv"));
                let local = local_args(&data, args.epochs, mode, profile, &log, args.eval_interval_s)?;
                eprintln!("[gaps bench stragglers] {profile} / {mode} (run {})", run + 1);
                let report = run_with(&local, exe).await?;
                let ctr = report.ctr.context("a DLRM run reports its held-out AUC")?;
                let predicted = simulated_wall(&log, "sync")? / simulated_wall(&log, mode)?.max(1e-12);
                rows.push(StragglerRun {
                    profile: profile.clone(),
                    mode: mode.clone(),
                    wall_s: report.counters.wall_s,
                    auc: ctr.auc,
                    logloss: ctr.logloss,
                    time_to_target_s: None,
                    dropped: report.counters.dropped_stale + ctr.rows_dropped_stale,
                    switches: report.counters.mode_switches,
                    predicted_speedup: predicted,
                    samples_replayed: report.data.as_ref().map_or(0, |d| d.samples_replayed),
                    timeline: ctr.timeline,
                });
            }
        }
        let sync_auc = mean(rows.iter().filter(|r| r.mode == "sync").map(|r| r.auc));
        let target = args.target_auc.unwrap_or(0.99 * sync_auc.unwrap_or(0.0));
        for row in &mut rows {
            row.time_to_target_s = row.timeline.iter().find(|(_, auc, _)| *auc >= target).map(|(t, _, _)| *t);
        }
        out.extend(rows);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(out)
}

fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let v: Vec<f64> = values.collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// The table: per profile and mode, means over runs.
pub fn table(runs: &[StragglerRun], target: Option<f64>) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "{:<8} {:<6} {:>8} {:>9} {:>10} {:>10} {:>7} {:>8} {:>8} {:>9}\n",
        "profile", "mode", "wall s", "speed-up", "predicted", "to target", "AUC", "logloss", "dropped", "switches"
    ));
    let mut seen: Vec<(&str, &str)> = Vec::new();
    for r in runs {
        if !seen.contains(&(&r.profile, &r.mode)) {
            seen.push((&r.profile, &r.mode));
        }
    }
    let of =
        |p: &str, m: &str| -> Vec<&StragglerRun> { runs.iter().filter(|r| r.profile == p && r.mode == m).collect() };
    for (profile, mode) in seen {
        let these = of(profile, mode);
        let avg = |f: &dyn Fn(&StragglerRun) -> f64| mean(these.iter().map(|r| f(r))).unwrap_or(f64::NAN);
        let wall = avg(&|r| r.wall_s);
        let sync_wall = mean(of(profile, "sync").iter().map(|r| r.wall_s));
        let speedup = sync_wall.map_or(f64::NAN, |w| w / wall);
        let reached: Vec<f64> = these.iter().filter_map(|r| r.time_to_target_s).collect();
        let to_target = if reached.len() == these.len() {
            format!("{:.2}", reached.iter().sum::<f64>() / these.len().max(1) as f64)
        } else {
            format!("{}/{} never", these.len() - reached.len(), these.len())
        };
        s.push_str(&format!(
            "{:<8} {:<6} {:>8.2} {:>8.2}x {:>9.2}x {:>10} {:>7.4} {:>8.4} {:>8.0} {:>9.1}\n",
            profile,
            mode,
            wall,
            speedup,
            avg(&|r| r.predicted_speedup),
            to_target,
            avg(&|r| r.auc),
            avg(&|r| r.logloss),
            avg(&|r| r.dropped as f64),
            avg(&|r| r.switches as f64),
        ));
    }
    if let Some(t) = target {
        s.push_str(&format!("target AUC {t:.4}\n"));
    } else {
        s.push_str("target AUC: 0.99 × sync's final AUC under the same profile\n");
    }
    s
}

/// Held-out AUC against seconds of training, one panel per profile, one line per mode (the first run of
/// each), as an SVG document.
pub fn svg(runs: &[StragglerRun]) -> String {
    let colors = [("sync", "#1f77b4"), ("gba", "#ff7f0e"), ("async", "#2ca02c"), ("auto", "#d62728")];
    let mut profiles: Vec<&str> = Vec::new();
    for r in runs {
        if !profiles.contains(&r.profile.as_str()) {
            profiles.push(&r.profile);
        }
    }
    let (pw, ph, left, top) = (300.0, 220.0, 50.0, 30.0);
    let width = left + profiles.len() as f64 * (pw + 20.0) + 20.0;
    let height = top + ph + 60.0;
    let points = runs.iter().flat_map(|r| r.timeline.iter());
    let t_max = points.clone().map(|p| p.0).fold(1e-9, f64::max);
    let (lo, hi) = points.map(|p| p.1).fold((1.0f64, 0.5f64), |(lo, hi), a| (lo.min(a), hi.max(a)));
    let lo = (lo.max(0.5) * 50.0).floor() / 50.0;
    let hi = (hi * 50.0).ceil() / 50.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"11\">\n"
    );
    for (i, profile) in profiles.iter().enumerate() {
        let x0 = left + i as f64 * (pw + 20.0);
        s.push_str(&format!(
            "<rect x=\"{x0}\" y=\"{top}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#888\"/>\n\
             <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">straggler profile: {profile}</text>\n\
             <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">seconds of training (0 to {t_max:.1})</text>\n",
            x0 + pw / 2.0,
            top - 8.0,
            x0 + pw / 2.0,
            top + ph + 16.0
        ));
        if i == 0 {
            s.push_str(&format!(
                "<text x=\"4\" y=\"{}\">{hi:.2}</text><text x=\"4\" y=\"{}\">{lo:.2}</text>\
                 <text x=\"4\" y=\"{}\">AUC</text>\n",
                top + 10.0,
                top + ph,
                top + ph / 2.0
            ));
        }
        for (mode, color) in colors {
            let Some(run) = runs.iter().find(|r| r.profile == *profile && r.mode == mode) else { continue };
            let pts: Vec<String> = run
                .timeline
                .iter()
                .map(|(t, auc, _)| {
                    let x = x0 + pw * t / t_max;
                    let y = top + ph * (1.0 - ((auc - lo) / (hi - lo).max(1e-9)).clamp(0.0, 1.0));
                    format!("{x:.1},{y:.1}")
                })
                .collect();
            s.push_str(&format!(
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>\n",
                pts.join(" ")
            ));
        }
    }
    for (k, (mode, color)) in colors.iter().enumerate() {
        let x = left + k as f64 * 70.0;
        s.push_str(&format!(
            "<rect x=\"{x}\" y=\"{}\" width=\"12\" height=\"3\" fill=\"{color}\"/><text x=\"{}\" y=\"{}\">{mode}</text>\n",
            top + ph + 32.0,
            x + 16.0,
            top + ph + 36.0
        ));
    }
    s.push_str("</svg>\n");
    s
}

impl StragglerRun {
    /// The JSON line.
    pub fn to_json(&self) -> String {
        crate::reports::line(self)
    }
}
