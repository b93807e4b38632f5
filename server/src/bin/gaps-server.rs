//! `gaps-server`: one shard of a gaps parameter server.

fn main() -> anyhow::Result<()> {
    let args: gaps_server::cli::ServerArgs = gaps_setup::start_program(
        "gaps-server",
        "One shard of a gaps parameter server. Shard 0 is also the coordinator; every other shard joins it at \
         start-up. Clients must present a certificate signed by the cluster CA (`gaps certs` makes them).",
        "info",
    );
    let threads = gaps_transport::runtime::io_threads(args.io_threads as usize, gaps_transport::runtime::IoRole::Shard);
    gaps_transport::runtime::build(threads)?.block_on(gaps_server::cli::run(&args))
}
