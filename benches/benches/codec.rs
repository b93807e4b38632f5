//! `cargo bench --bench codec`: a pulled reply decoded into a model buffer through the cache and past it
//! (non-temporal stores), every wire format. With `--test` (as CI runs it) one small pass of each.

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--test");
    let sizes: &[usize] = if quick { &[1 << 16] } else { &[1 << 20, 16 << 20] };
    let results = gaps_benches::codec::run(sizes, std::time::Duration::from_secs(2), quick)?;
    gaps_benches::codec::print(&results, false);
    Ok(())
}
