//! `cargo bench --bench tables`: sparse-table rates and bytes per row (10 M rows; 100 K rows with `--test`).

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--test");
    let r = gaps_benches::tables::run(if quick { 100_000 } else { 10_000_000 }, 16)?;
    println!("{}", r.to_json());
    Ok(())
}
