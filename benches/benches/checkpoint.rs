//! `cargo bench --bench checkpoint`: snapshot pause, write, read and restore of a 1 GiB model (256 Mi
//! parameters with momentum); with `--test` (as CI runs it) a 1 Mi-parameter model.

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--test");
    let dir = std::env::temp_dir().join(format!("gaps-bench-checkpoint-{}", std::process::id()));
    let result = gaps_benches::checkpoint::run(if quick { 1 << 20 } else { 256 << 20 }, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    println!("{}", result?.to_json());
    Ok(())
}
