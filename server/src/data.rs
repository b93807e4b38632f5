//! Cuts the training files into the dealer's splits (`--data`, `--split-lines`): one pass over each file
//! counting newlines, a split ending after every `split_lines`-th line. Only bytes are counted here (the
//! server links no data reader); the workers parse the lines of the ranges they are dealt.

use anyhow::{bail, Context, Result};
use gaps_shard::dealer::{FileSplit, SplitTable};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Lines per split when `--split-lines` is not given (docs/stragglers.md, "Splits": 256, 1,024 and 4,096
/// lines measured; a request per split costs nothing measurable, a long split makes the slowest worker's
/// last one the tail of a pass).
pub const DEFAULT_SPLIT_LINES: u64 = 1024;

/// What `--data` names on the coordinator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSource {
    /// Synthetic samples by index (workers generate them from their seed).
    Synthetic,
    /// Criteo-layout files, dealt in this order.
    Files(Vec<PathBuf>),
}

impl std::str::FromStr for DataSource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "" => Err("--data needs `synthetic` or one or more file paths separated by commas".into()),
            "synthetic" => Ok(DataSource::Synthetic),
            list => Ok(DataSource::Files(list.split(',').map(|p| PathBuf::from(p.trim())).collect())),
        }
    }
}

/// The splits of `source` with `split_lines` lines (or samples) each.
pub fn cut(source: &DataSource, split_lines: u64) -> Result<SplitTable> {
    if split_lines == 0 {
        bail!("--split-lines must be at least 1");
    }
    match source {
        DataSource::Synthetic => Ok(SplitTable::Synthetic { samples_per_split: split_lines }),
        DataSource::Files(paths) => {
            if paths.len() > u32::MAX as usize {
                bail!("too many data files");
            }
            let mut splits = Vec::new();
            for (i, path) in paths.iter().enumerate() {
                cut_file(path, i as u32, split_lines, &mut splits)?;
            }
            if splits.len() as u64 > u64::from(u32::MAX) {
                bail!("{} splits are too many: raise --split-lines", splits.len());
            }
            Ok(SplitTable::Files { files: paths.iter().map(|p| p.display().to_string()).collect(), splits })
        }
    }
}

fn cut_file(path: &Path, file: u32, split_lines: u64, out: &mut Vec<FileSplit>) -> Result<()> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening the data file {}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    let (mut offset, mut start, mut lines, mut first_line, mut total) = (0u64, 0u64, 0u64, 1u64, 0u64);
    let mut last_byte = b'\n';
    loop {
        let n = f.read(&mut buf).with_context(|| format!("reading the data file {}", path.display()))?;
        if n == 0 {
            break;
        }
        for (i, b) in buf[..n].iter().enumerate() {
            if *b == b'\n' {
                lines += 1;
                if lines == split_lines {
                    let end = offset + i as u64 + 1;
                    out.push(FileSplit { file, first_line, start, end, lines });
                    (start, first_line, lines) = (end, first_line + split_lines, 0);
                }
            }
        }
        last_byte = buf[n - 1];
        offset += n as u64;
        total = offset;
    }
    // The last line may lack its newline.
    let tail_lines = lines + u64::from(last_byte != b'\n');
    if total > start {
        out.push(FileSplit { file, first_line, start, end: total, lines: tail_lines });
    }
    if total == 0 {
        bail!("the data file {} is empty", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_end_at_line_ends_and_cover_every_byte() {
        let dir = gaps_common::scratch_dir("gaps-cut").expect("dir");
        let a = dir.join("a.tsv");
        std::fs::write(&a, "l1\nline2\nl3\nl4\nl5").expect("write");
        let b = dir.join("b.tsv");
        std::fs::write(&b, "x\ny\n").expect("write");
        let table = cut(&DataSource::Files(vec![a.clone(), b.clone()]), 2).expect("cut");
        let SplitTable::Files { files, splits } = table else { panic!("files") };
        assert_eq!(files.len(), 2);
        let got: Vec<(u32, u64, u64, u64, u64)> =
            splits.iter().map(|s| (s.file, s.first_line, s.start, s.end, s.lines)).collect();
        assert_eq!(got, vec![(0, 1, 0, 9, 2), (0, 3, 9, 15, 2), (0, 5, 15, 17, 1), (1, 1, 0, 4, 2)]);
        let err = cut(&DataSource::Files(vec![dir.join("missing.tsv")]), 2).expect_err("missing");
        assert!(format!("{err:#}").contains("missing.tsv"), "{err:#}");
        std::fs::write(&a, "").expect("write");
        let err = cut(&DataSource::Files(vec![a]), 2).expect_err("empty");
        assert!(format!("{err:#}").contains("empty"), "{err:#}");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!("synthetic".parse::<DataSource>(), Ok(DataSource::Synthetic));
        assert_eq!("x.tsv, y.tsv".parse::<DataSource>(), Ok(DataSource::Files(vec!["x.tsv".into(), "y.tsv".into()])));
    }
}
