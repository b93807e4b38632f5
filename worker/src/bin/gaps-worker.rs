//! `gaps-worker`: one training worker of a gaps cluster.

use clap::Parser;

/// One training worker: joins the cluster through the coordinator, then pulls parameters, computes
/// gradients on its share of the data and pushes them back, asynchronously, over QUIC with mutual TLS.
#[derive(Debug, Parser)]
#[command(name = "gaps-worker", version)]
struct Cli {
    /// Settings from a TOML file; flags and `GAPS_*` variables override it (docs/guide/cluster.md, "Configuration file").
    #[arg(long, env = "GAPS_CONFIG", global = true, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    #[command(flatten)]
    args: gaps_worker::train::WorkerArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    gaps_common::buffers::tune_allocator();
    gaps_transport::init_logging("info");
    let matches = gaps_transport::config_file::parse_args(<Cli as clap::CommandFactory>::command());
    let cli = <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let summary = gaps_worker::train::run(&cli.args).await?;
    if cli.args.json {
        println!("{}", summary.to_json());
    }
    Ok(())
}
