//! `cargo bench --bench transport`: the transport bench as a bench target. With `--test` (as CI runs it)
//! it does one small round per case so the code path is exercised without timing anything.

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--test");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let results = runtime.block_on(gaps_benches::transport::run(&gaps_benches::transport::TransportOptions::new(
        quick,
        std::time::Duration::from_secs(3),
    )))?;
    gaps_benches::transport::print(&results, true);
    Ok(())
}
