//! `cargo bench --bench kernels`: the kernel bench as a bench target. With `--test` (as CI runs it) one
//! small pass per rule, so every rule and the baseline run without timing anything. Both paths: the rules'
//! loops (`update`) and a push and a pull through the host-resident executor (`server`).

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--test");
    let sizes: &[usize] = if quick { &[1 << 16] } else { &[1 << 20, 16 << 20, 64 << 20] };
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let window = std::time::Duration::from_millis(500);
    let mut results = gaps_benches::kernels::run_cpu(sizes, threads, window, quick)?;
    results.extend(gaps_benches::kernels::run_server_host(sizes, threads, window, quick)?);
    gaps_benches::kernels::print(&results, true);
    Ok(())
}
