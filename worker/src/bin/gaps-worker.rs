//! `gaps-worker`: one training worker of a gaps cluster.

fn main() -> anyhow::Result<()> {
    let args: gaps_worker::train::WorkerArgs = gaps_setup::start_program(
        "gaps-worker",
        "One training worker: joins the cluster through the coordinator, then pulls parameters, computes \
         gradients on its share of the data and pushes them back, asynchronously, over QUIC with mutual TLS.",
        "info",
    );
    // The training loop runs on this thread (block_on); with one lane (the default) so does the network,
    // between its computations, and with more on the runtime's threads.
    let summary = gaps_transport::runtime::build(args.runtime_threads())?.block_on(gaps_worker::train::run(&args))?;
    if args.json {
        println!("{}", summary.to_json());
    }
    Ok(())
}
