//! The host side of a GPU pull or push: a pull's copies planned as pieces of the page-locked buffer, and
//! large copies into and out of page-locked memory cut into parts on the rayon pool (pure CPU code, tested
//! here without a GPU).

/// Copies `src` into `dst` (equal lengths), a large copy in parts on the rayon pool (at most 8, of at least
/// [`COPY_PART`] floats): one core's copy into or out of page-locked memory runs at a fraction of what the
/// PCIe link moves.
pub(super) fn copy_in_parts(dst: &mut [f32], src: &[f32]) {
    debug_assert_eq!(dst.len(), src.len());
    let n = dst.len().min(src.len());
    let (dst, src) = (&mut dst[..n], &src[..n]);
    let parts = (n / COPY_PART).min(rayon::current_num_threads()).min(8);
    if parts < 2 {
        dst.copy_from_slice(src);
        return;
    }
    use rayon::prelude::*;
    let step = src.len().div_ceil(parts);
    dst.par_chunks_mut(step).zip(src.par_chunks(step)).for_each(|(to, from)| to.copy_from_slice(from));
}

/// A pull's `(offset, len)` copies as pieces of at most `piece` floats (> 0) that fill the page-locked
/// buffer from its start, one after the other: adjacent copies merged into one, a copy longer than what a
/// piece has left split across pieces, empty copies dropped. Each piece lists `(offset, len)` copies.
pub(super) fn pull_pieces(copies: &[(u64, usize)], piece: usize) -> Vec<Vec<(usize, usize)>> {
    let mut runs: Vec<(usize, usize)> = Vec::with_capacity(copies.len());
    for &(offset, len) in copies.iter().filter(|(_, len)| *len > 0) {
        match runs.last_mut() {
            Some((at, n)) if *at + *n == offset as usize => *n += len,
            _ => runs.push((offset as usize, len)),
        }
    }
    let piece = piece.max(1);
    let (mut pieces, mut current, mut filled) = (Vec::new(), Vec::new(), 0);
    for (mut offset, mut len) in runs {
        while len > 0 {
            let n = len.min(piece - filled);
            current.push((offset, n));
            (offset, len, filled) = (offset + n, len - n, filled + n);
            if filled == piece {
                pieces.push(std::mem::take(&mut current));
                filled = 0;
            }
        }
    }
    if !current.is_empty() {
        pieces.push(current);
    }
    pieces
}

/// The smallest part of a copy [`copy_in_parts`] hands to another thread (4 MiB).
const COPY_PART: usize = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::random;

    /// A copy cut into parts ends equal to its source at every length: none, short, exactly one part, and
    /// several parts with a remainder.
    #[test]
    fn a_copy_in_parts_equals_its_source() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().expect("a pool of 4");
        pool.install(|| {
            for n in [0, 5, COPY_PART, 3 * COPY_PART + 7] {
                let src = random(n, n as u64 + 1, -1.0, 1.0);
                let mut dst = vec![f32::NAN; n];
                copy_in_parts(&mut dst, &src);
                assert!(dst.iter().zip(&src).all(|(a, b)| a.to_bits() == b.to_bits()), "{n} floats");
            }
        });
    }

    /// A pull's pieces, followed into a buffer of `piece` floats and copied out after each, give the
    /// copies' floats one after the other, whatever the piece size: adjacent copies merged, long ones split,
    /// empty ones dropped, no piece over its size or empty.
    #[test]
    fn a_pull_in_pieces_reads_every_copy_in_order() {
        let device: Vec<f32> = (0..400).map(|i| i as f32).collect();
        let copies: Vec<(u64, usize)> =
            vec![(0, 10), (10, 30), (40, 0), (100, 7), (107, 50), (20, 5), (300, 99), (399, 1), (0, 0)];
        let expected: Vec<f32> =
            copies.iter().flat_map(|&(at, n)| device[at as usize..at as usize + n].iter().copied()).collect();
        for piece in [1, 3, 7, 40, 64, 1000] {
            let mut host = vec![f32::NAN; piece];
            let mut out = Vec::new();
            let pieces = pull_pieces(&copies, piece);
            for p in &pieces {
                let mut filled = 0;
                for &(at, n) in p {
                    host[filled..filled + n].copy_from_slice(&device[at..at + n]);
                    filled += n;
                }
                assert!(filled > 0 && filled <= piece, "piece {piece}: a piece of {filled}");
                out.extend_from_slice(&host[..filled]);
            }
            assert_eq!(out, expected, "piece {piece}");
            if piece >= 1000 {
                // Merged: [0, 40), [100, 157), [20, 25), [300, 400) in one piece.
                assert_eq!(pieces, vec![vec![(0, 40), (100, 57), (20, 5), (300, 100)]]);
            }
        }
    }
}
