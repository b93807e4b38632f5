//! `gaps-server`: one shard of a gaps parameter server.

use clap::Parser;

/// One shard of a gaps parameter server. Shard 0 is also the coordinator; every other shard joins it at
/// start-up. Clients must present a certificate signed by the cluster CA (`gaps certs` makes them).
#[derive(Debug, Parser)]
#[command(name = "gaps-server", version)]
struct Cli {
    #[command(flatten)]
    config: gaps_setup::ConfigArg,
    #[command(flatten)]
    args: gaps_server::cli::ServerArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli: Cli = gaps_setup::start("info");
    gaps_server::cli::run(&cli.args).await
}
