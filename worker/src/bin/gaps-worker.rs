//! `gaps-worker`: one training worker of a gaps cluster.

use clap::Parser;

/// One training worker: joins the cluster through the coordinator, then pulls parameters, computes
/// gradients on its share of the data and pushes them back, asynchronously, over QUIC with mutual TLS.
#[derive(Debug, Parser)]
#[command(name = "gaps-worker", version)]
struct Cli {
    #[command(flatten)]
    config: gaps_setup::ConfigArg,
    #[command(flatten)]
    args: gaps_worker::train::WorkerArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli: Cli = gaps_setup::start("info");
    let summary = gaps_worker::train::run(&cli.args).await?;
    if cli.args.json {
        println!("{}", summary.to_json());
    }
    Ok(())
}
