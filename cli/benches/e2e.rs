//! `cargo bench --bench e2e`: DLRM samples per second through real local clusters of 1×1, 2×2 and 2×4
//! shards × workers, and 2×4 with two copies of each shard. With `--test` (as CI runs it) one tiny 1×1 run
//! and one tiny 2×2 with copies.

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--test");
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_gaps"));
    let (shapes, steps): (&[(u32, u32, u32)], u64) =
        if quick { (&[(1, 1, 1), (2, 2, 2)], 5) } else { (&[(1, 1, 1), (2, 2, 1), (2, 4, 1), (2, 4, 2)], 1200) };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let run = runtime.block_on(gaps_cli::e2e::run(exe, shapes, steps, None))?;
    println!("{}", run.baseline.to_json());
    for r in run.shapes {
        println!("{}", r.to_json());
    }
    Ok(())
}
