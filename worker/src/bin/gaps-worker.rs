//! `gaps-worker`: one training worker of a gaps cluster.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: gaps_worker::train::WorkerArgs = gaps_setup::start_program(
        "gaps-worker",
        "One training worker: joins the cluster through the coordinator, then pulls parameters, computes \
         gradients on its share of the data and pushes them back, asynchronously, over QUIC with mutual TLS.",
        "info",
    );
    let summary = gaps_worker::train::run(&args).await?;
    if args.json {
        println!("{}", summary.to_json());
    }
    Ok(())
}
