//! `cargo bench --bench codec`: a pulled reply's wire bytes decoded into a model buffer of megabytes, as the
//! worker's reader does with each piece quinn hands it — through the cache (`decode_into`) against past it
//! (`decode_into_streaming`, non-temporal stores), paired windows in one run (see `kernels::paired`).

use anyhow::Result;
use gaps_common::dtype::{decode_into, decode_into_streaming, encode_bulk, WireDtype};
use std::time::Duration;

/// One measured (format, size) case.
#[derive(Debug, Clone, PartialEq)]
pub struct CodecResult {
    /// The wire format decoded.
    pub dtype: WireDtype,
    /// Values per decoded reply.
    pub values: usize,
    /// Values per second written past the cache (median window).
    pub streaming_values_per_s: f64,
    /// Values per second written through the cache (median window).
    pub plain_values_per_s: f64,
    /// Streaming ÷ plain, the median of paired windows.
    pub ratio: f64,
}

/// Bytes of wire data per piece handed to the decoder (about one 64 KiB loopback datagram's stream data).
const PIECE: usize = 64 << 10;

/// Decodes `values`-value replies of each format into destinations cycled over at least 96 MB (so each
/// reply lands in memory the caches no longer hold, as a new snapshot does), both ways.
pub fn run(sizes: &[usize], min_time: Duration, quick: bool) -> Result<Vec<CodecResult>> {
    let mut out = Vec::new();
    for &values in sizes {
        let count = (96usize << 20).div_ceil(4 * values).max(2);
        let mut dests: Vec<Vec<f32>> = (0..count).map(|_| vec![0f32; values]).collect();
        for dtype in [WireDtype::F32, WireDtype::Bf16, WireDtype::F16] {
            let width = dtype.bytes();
            let per_piece = PIECE / width;
            let source: Vec<f32> = (0..per_piece).map(|i| (i % 1000) as f32 * 0.01 - 5.0).collect();
            let piece = encode_bulk(dtype, &source);
            let mut turn = 0usize;
            let mut reply = |streaming: bool| -> Result<()> {
                turn = (turn + 1) % count;
                for dst in dests[turn].chunks_mut(per_piece) {
                    let bytes = &piece[..dst.len() * width];
                    let ok = if streaming {
                        decode_into_streaming(dtype, bytes, dst)
                    } else {
                        decode_into(dtype, bytes, dst)
                    };
                    anyhow::ensure!(ok, "piece of {} bytes for {} values", bytes.len(), dst.len());
                }
                Ok(())
            };
            // Both closures borrow the one decoder state in turn.
            let reply = std::cell::RefCell::new(&mut reply);
            let (streaming, plain, ratio) =
                crate::kernels::paired(min_time, quick, &mut || (reply.borrow_mut())(true), &mut || {
                    (reply.borrow_mut())(false)
                })?;
            let per_s = |replies: f64| replies * values as f64;
            out.push(CodecResult {
                dtype,
                values,
                streaming_values_per_s: per_s(streaming),
                plain_values_per_s: per_s(plain),
                ratio,
            });
            // Both ways wrote the same values.
            let (a, b) = dests.split_at_mut(1);
            for (x, y) in a[0].chunks_mut(per_piece).zip(b[0].chunks_mut(per_piece)) {
                let bytes = &piece[..x.len() * width];
                anyhow::ensure!(decode_into_streaming(dtype, bytes, x) && decode_into(dtype, bytes, y), "lengths");
            }
            anyhow::ensure!(a[0] == b[0], "{dtype}: the streaming decode wrote other values");
        }
    }
    Ok(out)
}

/// Prints the results as a table (or JSON lines).
pub fn print(results: &[CodecResult], json: bool) {
    if json {
        for r in results {
            /// One format's JSON line.
            #[derive(serde::Serialize)]
            struct Line {
                dtype: &'static str,
                values: usize,
                streaming_values_per_s: f64,
                plain_values_per_s: f64,
                ratio: f64,
            }
            let line = Line {
                dtype: r.dtype.name(),
                values: r.values,
                streaming_values_per_s: r.streaming_values_per_s,
                plain_values_per_s: r.plain_values_per_s,
                ratio: r.ratio,
            };
            println!("{}", crate::json_line(&line));
        }
        return;
    }
    println!("{:<6} {:>10} {:>14} {:>14} {:>8}", "format", "values", "streaming M/s", "plain M/s", "ratio");
    for r in results {
        println!(
            "{:<6} {:>10} {:>14.0} {:>14.0} {:>8.2}",
            r.dtype.name(),
            r.values,
            r.streaming_values_per_s / 1e6,
            r.plain_values_per_s / 1e6,
            r.ratio
        );
    }
}
