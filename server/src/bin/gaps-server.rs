//! `gaps-server`: one shard of a gaps parameter server.

use clap::Parser;

/// One shard of a gaps parameter server. Shard 0 is also the coordinator; every other shard joins it at
/// start-up. Clients must present a certificate signed by the cluster CA (`gaps certs` makes them).
#[derive(Debug, Parser)]
#[command(name = "gaps-server", version)]
struct Cli {
    /// Settings from a TOML file; flags and `GAPS_*` variables override it (docs/guide/cluster.md, "Configuration file").
    #[arg(long, env = "GAPS_CONFIG", global = true, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    #[command(flatten)]
    args: gaps_server::cli::ServerArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    gaps_common::buffers::tune_allocator();
    gaps_transport::init_logging("info");
    let matches = gaps_transport::config_file::parse_args(<Cli as clap::CommandFactory>::command());
    let cli = <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    gaps_server::cli::run(&cli.args).await
}
