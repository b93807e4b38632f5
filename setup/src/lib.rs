//! gaps-setup: what every gaps binary sets up before it runs.
//!
//! - [`config_file`]: `--config FILE`, settings from a TOML file under the flags and `GAPS_*` variables.
//! - [`init_logging`]: the `tracing` subscriber every binary installs (`GAPS_LOG`).
//! - [`certs`]: certificate issuance — the cluster CA and the shard and worker certificates it signs.
//! - [`start`]: the three steps every binary's `main` begins with, and [`ConfigArg`], the flag it reads.
//!
//! The flags' grammars (sizes, durations, stragglers, kills) are [`gaps_common::config`]'s; the flag groups
//! several commands share are `gaps-flags`', flattened where they are used.

pub mod certs;
pub mod config_file;

/// The `--config` flag every binary takes (flatten it into the command's arguments).
#[derive(Debug, Clone, clap::Args)]
pub struct ConfigArg {
    /// Settings from a TOML file; flags and `GAPS_*` variables override it (docs/guide/cluster.md, "Configuration file").
    #[arg(long, env = "GAPS_CONFIG", global = true, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
}

/// Installs the `tracing` subscriber used by every gaps binary: human-readable lines on stderr, filtered
/// by `GAPS_LOG` (default: `default_level`, e.g. `info`).
pub fn init_logging(default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("GAPS_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).try_init();
}

/// A binary's first steps: the allocator tuned for large buffers, logging at `default_level` (unless
/// `GAPS_LOG` says otherwise), and its command line read under the settings of `--config` — exiting with
/// clap's message on a bad flag, an unknown key or a file that does not parse.
pub fn start<C: clap::Parser>(default_level: &str) -> C {
    gaps_common::buffers::tune_allocator();
    init_logging(default_level);
    parse::<C>()
}

/// A program whose command line is [`ConfigArg`] and the flags `A` (`gaps-server`, `gaps-worker`).
#[derive(Debug, clap::Parser)]
pub struct Program<A: clap::Args> {
    #[command(flatten)]
    config: ConfigArg,
    #[command(flatten)]
    args: A,
}

/// [`start`] for a [`Program`] called `name` (what `--help` and `--version` say, with `about`): its flags.
pub fn start_program<A: clap::Args>(name: &'static str, about: &'static str, default_level: &str) -> A {
    use clap::{CommandFactory, FromArgMatches};
    gaps_common::buffers::tune_allocator();
    init_logging(default_level);
    let command = Program::<A>::command().name(name).bin_name(name).about(about).version(env!("CARGO_PKG_VERSION"));
    let matches = config_file::parse_args(command);
    Program::<A>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit()).args
}

/// The command line read under the settings of `--config` (exits with clap's message on an error).
pub fn parse<C: clap::Parser>() -> C {
    let matches = config_file::parse_args(C::command());
    C::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}
