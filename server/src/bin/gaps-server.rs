//! `gaps-server`: one shard of a gaps parameter server.

fn main() -> anyhow::Result<()> {
    let args: gaps_server::cli::ServerArgs = gaps_setup::start_program(
        "gaps-server",
        "One shard of a gaps parameter server. Shard 0 is also the coordinator; every other shard joins it at \
         start-up. Clients must present a certificate signed by the cluster CA (`gaps certs` makes them).",
        "info",
    );
    gaps_transport::runtime::build(args.runtime_threads())?.block_on(gaps_server::cli::run(&args))
}
