//! The coordinator's dealer journal (async mode): one line per change of the data dealer
//! ([`gaps_shard::dealer::DealerOp`]) in `dealer.journal` beside its checkpoints. A coordinator restored from
//! a checkpoint in async mode — where the other shards keep what was trained since — makes the changes made
//! after its checkpoint again, so the splits finished since are not dealt a second time in the same data
//! epoch. (In sync, gba and auto the whole cluster goes back to a checkpoint, and so does the dealer: no
//! journal.)
//!
//! The file starts with `gaps-dealer-journal 1 FINGERPRINT` (the cut of the data it belongs to); each change
//! is appended as the core's thread makes it (a write per change, no fsync: a killed process loses nothing
//! written, a machine crash at most the last changes, whose splits are then dealt again as without a
//! journal). At start the journal is rewritten from the checkpoint on (older changes are in it), so it grows
//! by one short line per split dealt between restarts.

use gaps_shard::dealer::DealerOp;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The journal's file name in the coordinator's checkpoint folder.
pub const FILE: &str = "dealer.journal";

fn header(fingerprint: u64) -> String {
    format!("gaps-dealer-journal 1 {fingerprint:016x}")
}

/// The journal's path in `dir`.
pub fn path(dir: &Path) -> PathBuf {
    dir.join(FILE)
}

/// The changes recorded in `dir`'s journal for the cut `fingerprint`, in order; none when there is no
/// journal. Reading stops at the first line that is not a change (a line torn by a crash is the last one);
/// a journal of other data, or not a journal, is an error saying so.
pub fn read(dir: &Path, fingerprint: u64) -> Result<Vec<DealerOp>, String> {
    let path = path(dir);
    let text = match std::fs::read(&path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("reading {}: {e}", path.display())),
    };
    let mut lines = text.lines();
    match lines.next() {
        Some(first) if first == header(fingerprint) => {}
        Some(first) if first.starts_with("gaps-dealer-journal ") => {
            return Err(format!("{} belongs to another cut of the data ({first})", path.display()))
        }
        _ => return Err(format!("{} is not a dealer journal", path.display())),
    }
    Ok(lines.map_while(DealerOp::parse).collect())
}

/// `changes` as journal lines, each ended by a newline.
fn lines(changes: &[DealerOp]) -> String {
    let mut text = String::with_capacity(32 * changes.len());
    for c in changes {
        text.push_str(&c.to_line());
        text.push('\n');
    }
    text
}

/// Writes a new journal of `changes` for the cut `fingerprint` in `dir` (a temporary file renamed over the
/// old one), and returns it open for appending.
pub fn rewrite(dir: &Path, fingerprint: u64, changes: &[DealerOp]) -> anyhow::Result<std::fs::File> {
    let path = path(dir);
    let text = format!("{}\n{}", header(fingerprint), lines(changes));
    crate::checkpoint::write_atomically(&path, text.as_bytes())?;
    Ok(std::fs::OpenOptions::new().append(true).open(&path)?)
}

/// Appends `changes` to an open journal (one write).
pub fn append(file: &mut std::fs::File, changes: &[DealerOp]) -> std::io::Result<()> {
    file.write_all(lines(changes).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_journal_reads_back_its_changes_and_stops_at_a_torn_line() {
        let dir = gaps_common::scratch_dir("gaps-journal-test").expect("dir");
        assert_eq!(read(&dir, 7), Ok(Vec::new()), "no journal: nothing to replay");
        let changes = [
            DealerOp::Deal { op: 1, worker: 0, finished: None, grant: Some(5) },
            DealerOp::Deal { op: 2, worker: 0, finished: Some(5), grant: None },
            DealerOp::GiveBack { op: 3, worker: 2 },
        ];
        let mut f = rewrite(&dir, 7, &changes[..2]).expect("rewrite");
        append(&mut f, &changes[2..]).expect("append");
        assert_eq!(read(&dir, 7).expect("read"), changes.to_vec());
        assert!(read(&dir, 8).expect_err("another cut").contains("another cut"));
        // A crash tore the last line.
        f.write_all(b"deal 4 1 -").expect("torn");
        assert_eq!(read(&dir, 7).expect("read").len(), 3);
        std::fs::write(path(&dir), "not a journal\n").expect("write");
        assert!(read(&dir, 7).expect_err("garbage").contains("not a dealer journal"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
