//! gaps-flags: the flag groups several commands share — the dense rules' hyper-parameters
//! ([`HyperArgs`]: `gaps-server`, `gaps local`, `gaps sim`), the embedding tables' settings ([`TableArgs`])
//! and the training modes' ([`ModeArgs`]) (`gaps-server`, `gaps local`) — each declared once, with its
//! defaults, its `GAPS_*` variables and the settings it makes. Their grammars (sizes, durations, stragglers,
//! kills) are [`gaps_common::config`]'s; the config file they may come from is `gaps-setup`'s.

use anyhow::{Context, Result};
use gaps_common::config::{parse_bytes, parse_duration};
use gaps_kernels::{Hyper, Rule};
use gaps_shard::sparse::Eviction;
use gaps_shard::{ModeConfig, SparseSettings};
use std::time::Duration;

/// Hyper-parameters of the dense rules beyond the rule and η (shared by `gaps-server` and `gaps local`).
#[derive(Debug, Clone, clap::Args)]
pub struct HyperArgs {
    /// Momentum γ.
    #[arg(long, env = "GAPS_MOMENTUM", default_value_t = 0.9)]
    pub momentum: f32,
    /// L2 weight decay.
    #[arg(long, env = "GAPS_WEIGHT_DECAY", default_value_t = 0.0)]
    pub weight_decay: f32,
    /// DC-ASGD / DANA-DC λ (constant form), or λ0 of dc-asgd-adaptive.
    #[arg(long, env = "GAPS_DC_LAMBDA", default_value_t = 2.0)]
    pub dc_lambda: f32,
    /// Decay m of dc-asgd-adaptive's running mean square of gradients.
    #[arg(long, env = "GAPS_DC_MS_DECAY", default_value_t = 0.95)]
    pub dc_ms_decay: f32,
}

impl Default for HyperArgs {
    /// The flags' defaults.
    fn default() -> Self {
        HyperArgs { momentum: 0.9, weight_decay: 0.0, dc_lambda: 2.0, dc_ms_decay: 0.95 }
    }
}

impl HyperArgs {
    /// The rule's hyper-parameters with learning rate `lr`, validated.
    pub fn hyper(&self, lr: f32) -> Result<Hyper> {
        let hyper = Hyper {
            lr,
            momentum: self.momentum,
            weight_decay: self.weight_decay,
            dc_lambda: self.dc_lambda,
            dc_ms_decay: self.dc_ms_decay,
        };
        hyper.validate()?;
        Ok(hyper)
    }

    /// The same settings as `gaps-server` flags.
    pub fn to_flags(&self) -> Vec<String> {
        vec![
            format!("--momentum={}", self.momentum),
            format!("--weight-decay={}", self.weight_decay),
            format!("--dc-lambda={}", self.dc_lambda),
            format!("--dc-ms-decay={}", self.dc_ms_decay),
        ]
    }
}

/// Flags of the sparse embedding tables (shared by `gaps-server` and `gaps local`).
#[derive(Debug, Clone, clap::Args)]
pub struct TableArgs {
    /// Update rule of embedding rows (one without per-worker state).
    #[arg(long, env = "GAPS_SPARSE_RULE", default_value = "adagrad")]
    pub sparse_rule: Rule,
    /// Learning rate of embedding rows.
    #[arg(long, env = "GAPS_SPARSE_LR", default_value_t = 0.05)]
    pub sparse_lr: f32,
    /// L2 regularization λ of embedding rows, applied lazily: a row's update adds λ·row to its gradient
    /// each time a batch touches it (untouched rows cost nothing). Off by default: on a 500,000-line
    /// synthetic file λ of 1e-4 to 1e-2 did not reduce overfitting (docs/guide/models.md, "Real-data defaults").
    #[arg(long, env = "GAPS_SPARSE_WEIGHT_DECAY", default_value_t = DEFAULT_SPARSE_WEIGHT_DECAY)]
    pub sparse_weight_decay: f32,
    /// Standard deviation of the embedding initializer.
    #[arg(long, env = "GAPS_EMBEDDING_INIT_STD", default_value_t = 0.01)]
    pub embedding_init_std: f32,
    /// Adagrad's accumulator of a new embedding row (default 0; `gaps local` uses 0.1 when it passes over
    /// a data file more than once). With 0 a row's first update moves it by the full learning rate whatever
    /// its gradient: fastest in one pass, but rows of rarely seen ids memorize their few samples and
    /// further passes overfit; 0.1 (TensorFlow's default) keeps early steps proportional to the gradient.
    #[arg(long, env = "GAPS_SPARSE_ADAGRAD_INIT")]
    pub sparse_adagrad_init: Option<f32>,
    /// Create an embedding row only after its id was seen this many times recently (0: at once; at most
    /// 255; the counts halve every 8 Mi sightings).
    #[arg(long, env = "GAPS_ADMIT_AFTER", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=i64::from(gaps_shard::sparse::MAX_ADMIT_AFTER)))]
    pub admit_after: u32,
    /// Memory budget of this shard's embedding tables, e.g. 2GiB (default: a quarter of the memory this
    /// process may use — the machine's, or its container's limit — said at start-up); beyond it the least
    /// recently used rows are evicted.
    #[arg(long, env = "GAPS_TABLE_MEMORY", value_parser = parse_bytes)]
    pub table_memory: Option<u64>,
    /// Evict embedding rows idle this long (TTL); the budget is enforced by LRU either way.
    #[arg(long, env = "GAPS_TABLE_TTL", value_parser = parse_duration)]
    pub table_ttl: Option<Duration>,
}

/// Default `--sparse-weight-decay` (docs/guide/models.md, "Real-data defaults": the sweep behind it).
pub const DEFAULT_SPARSE_WEIGHT_DECAY: f32 = 0.0;
/// `--sparse-adagrad-init` of `gaps local` for runs that pass over a data file more than once (docs/guide/models.md,
/// "Real-data defaults").
pub const REPEATED_PASSES_ADAGRAD_INIT: f32 = 0.1;

/// The embedding tables' memory budget when `--table-memory` is not given: a quarter of what this process
/// may use (`buffers::usable_memory`), at least 64 MiB; 1 GiB where that cannot be read.
pub fn default_table_memory() -> u64 {
    gaps_common::buffers::usable_memory().map_or(1 << 30, |m| (m / 4).max(64 << 20))
}

impl TableArgs {
    /// The shard's table settings: `--sparse-lr`, `--sparse-weight-decay`, and the dense rules' other
    /// hyper-parameters (momentum, DC λ).
    pub fn settings(&self, dense: &Hyper) -> Result<SparseSettings> {
        let hyper = Hyper { lr: self.sparse_lr, weight_decay: self.sparse_weight_decay, ..*dense };
        hyper.validate().context("--sparse-lr or --sparse-weight-decay")?;
        let adagrad_init = self.sparse_adagrad_init.unwrap_or(0.0);
        if !(adagrad_init.is_finite() && adagrad_init >= 0.0) {
            anyhow::bail!("--sparse-adagrad-init must be a number ≥ 0, got {adagrad_init}");
        }
        Ok(SparseSettings {
            rule: self.sparse_rule,
            hyper,
            init_std: self.embedding_init_std,
            adagrad_init,
            admit_after: self.admit_after,
            memory_budget: Some(self.table_memory.unwrap_or_else(default_table_memory)),
            eviction: match self.table_ttl {
                Some(ttl) => Eviction::Ttl { ttl_s: ttl.as_secs().clamp(1, u64::from(u32::MAX)) as u32 },
                None => Eviction::Lru,
            },
        })
    }

    /// The same settings as `gaps-server` flags.
    pub fn to_flags(&self) -> Vec<String> {
        let mut flags = vec![
            format!("--sparse-rule={}", self.sparse_rule),
            format!("--sparse-lr={}", self.sparse_lr),
            format!("--sparse-weight-decay={}", self.sparse_weight_decay),
            format!("--embedding-init-std={}", self.embedding_init_std),
            format!("--admit-after={}", self.admit_after),
        ];
        flags.extend(self.sparse_adagrad_init.map(|a| format!("--sparse-adagrad-init={a}")));
        flags.extend(self.table_memory.map(|m| format!("--table-memory={m}")));
        flags.extend(self.table_ttl.map(|t| format!("--table-ttl={}ms", t.as_millis())));
        flags
    }
}

/// Flags of the training modes (shared by `gaps-server` and `gaps local`).
#[derive(Debug, Clone, clap::Args)]
pub struct ModeArgs {
    /// Training mode: async, sync (global-batch BSP), gba (global-batch aggregation), ssp (bounded
    /// staleness) or auto (sync without stragglers, gba with them).
    #[arg(long, env = "GAPS_MODE", default_value = "async")]
    pub mode: gaps_shard::modes::Mode,
    /// GBA: gradients more than this many global steps stale are dropped.
    #[arg(long, env = "GAPS_GBA_THRESHOLD", default_value_t = 4)]
    pub gba_threshold: u64,
    /// GBA: a pull during a step reads the step as if applied now with the gradients it has so far, so a
    /// worker does not compute on values missing its own last gradient; false reads the last applied step
    /// (GBA as published). The applied steps are the same either way.
    #[arg(long, env = "GAPS_GBA_LOOKAHEAD", default_value_t = true, action = clap::ArgAction::Set)]
    pub gba_lookahead: bool,
    /// GBA: a push-pull that leaves the step short of gradients waits for the step while the missing ones
    /// are expected from other workers within this fraction of the pusher's own step time (predicted from
    /// their push intervals), so workers of equal speed compute on the applied step; nobody is held for a
    /// worker not due within that window (a straggler rarely is). `--mode gba` only: `auto` runs GBA while
    /// a worker straggles, for speed, and never holds. 0 never holds (GBA as published). At most 1 s.
    #[arg(long, env = "GAPS_GBA_HOLD", default_value_t = 0.5, value_parser = parse_fraction)]
    pub gba_hold: f64,
    /// SSP: pushes a worker may run ahead of the slowest live worker.
    #[arg(long, env = "GAPS_SSP_BOUND", default_value_t = 3)]
    pub ssp_bound: u64,
    /// Steps over which the learning-rate multiplier follows a change of the worker count (default: 8 × the
    /// count ratio when growing, at once when shrinking).
    #[arg(long, env = "GAPS_LR_RAMP_STEPS")]
    pub lr_ramp_steps: Option<u64>,
    /// auto: a worker becomes a straggler (and stops being one) only after this many of its reports in a
    /// row agree; each report is judged on the median of its last 5 step times against the median worker's.
    #[arg(long, env = "GAPS_STRAGGLER_PERSIST", default_value_t = gaps_shard::modes::DEFAULT_STRAGGLER_PERSIST, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub straggler_persist: u32,
    /// auto: the least time spent in a mode before switching again.
    #[arg(long, env = "GAPS_MIN_MODE_TIME", default_value = "2s", value_parser = parse_duration)]
    pub min_mode_time: Duration,
}

/// A fraction in [0, 1].
fn parse_fraction(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        Ok(v) => Err(format!("{v} is not a fraction between 0 and 1")),
        Err(e) => Err(format!("{s:?} is not a number: {e}")),
    }
}

impl ModeArgs {
    /// The shard's mode configuration.
    pub fn config(&self) -> ModeConfig {
        ModeConfig {
            mode: self.mode,
            gba_threshold: self.gba_threshold,
            gba_lookahead: self.gba_lookahead,
            gba_hold: self.gba_hold,
            ssp_bound: self.ssp_bound,
            lr_ramp_steps: self.lr_ramp_steps,
            straggler_persist: self.straggler_persist,
            min_mode_time: self.min_mode_time,
            ..ModeConfig::default()
        }
    }

    /// The same settings as `gaps-server` flags.
    pub fn to_flags(&self) -> Vec<String> {
        let mut flags = vec![
            format!("--mode={}", self.mode),
            format!("--gba-threshold={}", self.gba_threshold),
            format!("--gba-lookahead={}", self.gba_lookahead),
            format!("--gba-hold={}", self.gba_hold),
            format!("--ssp-bound={}", self.ssp_bound),
            format!("--straggler-persist={}", self.straggler_persist),
            format!("--min-mode-time={}ms", self.min_mode_time.as_millis()),
        ];
        flags.extend(self.lr_ramp_steps.map(|t| format!("--lr-ramp-steps={t}")));
        flags
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        hyper: HyperArgs,
    }

    /// `HyperArgs::default()` (what `gaps sim`'s experiments start from) is what the flags default to.
    #[test]
    fn the_default_hyper_parameters_are_the_flags_defaults() {
        let parsed = Cli::try_parse_from(["x"]).expect("no flags").hyper;
        let d = HyperArgs::default();
        let pairs = [
            (parsed.momentum, d.momentum),
            (parsed.weight_decay, d.weight_decay),
            (parsed.dc_lambda, d.dc_lambda),
            (parsed.dc_ms_decay, d.dc_ms_decay),
        ];
        assert!(pairs.iter().all(|(a, b)| a.to_bits() == b.to_bits()), "{parsed:?} / {d:?}");
    }
}
