//! The Criteo display-advertising layout: one sample per line, tab-separated: the label (0 or 1), 13 integer
//! features, 26 categorical features given as 32-bit hexadecimal hashes. An empty field is missing; integers
//! may be negative; a line may end in a tab (an extra empty field); CRLF line ends are accepted. A line that
//! breaks these rules is reported with its number and skipped — never a crash.
//!
//! Also here: a seeded synthetic generator in the same layout (Zipf-distributed ids per field and a planted
//! logistic teacher, so the best achievable AUC is known), and the AUC itself.

use gaps_common::rng::{mix, Rng};
use std::io::{BufRead, Read};

/// Integer features per sample.
pub const NUM_INT: usize = 13;
/// Categorical features per sample.
pub const NUM_CAT: usize = 26;
const FIELDS: usize = 1 + NUM_INT + NUM_CAT;

/// One sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// 0 or 1.
    pub label: u8,
    /// Integer features (0 where missing).
    pub ints: [i64; NUM_INT],
    /// Bit j set when integer feature j is present.
    pub int_present: u16,
    /// Categorical hashes (0 where missing).
    pub cats: [u32; NUM_CAT],
    /// Bit f set when categorical feature f is present.
    pub cat_present: u32,
}

impl Sample {
    /// The feature id of categorical field `f` (None when missing): field and hash packed into one u64, so
    /// equal hashes in different fields are different features.
    pub fn feature_id(&self, f: usize) -> Option<u64> {
        (self.cat_present >> f & 1 == 1).then(|| (f as u64) << 32 | u64::from(self.cats[f]))
    }

    /// Integer feature j transformed as log(1 + x) for x ≥ 0 and −log(1 − x) for x < 0 (0 when missing).
    pub fn log_int(&self, j: usize) -> f32 {
        if self.int_present >> j & 1 == 0 {
            return 0.0;
        }
        let x = self.ints[j] as f64;
        (if x >= 0.0 { (1.0 + x).ln() } else { -(1.0 - x).ln() }) as f32
    }
}

/// Why a line was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason}")]
pub struct LineError {
    /// 1-based line number.
    pub line: u64,
    /// What is wrong.
    pub reason: String,
}

/// Parses one line (without its line end). `line` is only used in errors.
pub fn parse_line(text: &str, line: u64) -> Result<Sample, LineError> {
    let err = |reason: String| LineError { line, reason };
    let text = text.strip_suffix('\r').unwrap_or(text);
    let mut fields: Vec<&str> = text.split('\t').collect();
    if fields.len() == FIELDS + 1 && fields[FIELDS].is_empty() {
        fields.pop(); // a trailing tab
    }
    if fields.len() != FIELDS {
        return Err(err(format!("expected {FIELDS} tab-separated fields, found {}", fields.len())));
    }
    let label = match fields[0] {
        "0" => 0,
        "1" => 1,
        other => return Err(err(format!("label must be 0 or 1, found {other:?}"))),
    };
    let mut s = Sample { label, ints: [0; NUM_INT], int_present: 0, cats: [0; NUM_CAT], cat_present: 0 };
    for j in 0..NUM_INT {
        let f = fields[1 + j];
        if f.is_empty() {
            continue;
        }
        s.ints[j] = f.parse().map_err(|_| err(format!("integer feature {} is not an integer: {f:?}", j + 1)))?;
        s.int_present |= 1 << j;
    }
    for c in 0..NUM_CAT {
        let f = fields[1 + NUM_INT + c];
        if f.is_empty() {
            continue;
        }
        if f.len() > 8 || !f.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(err(format!("categorical feature {} is not a 32-bit hex hash: {f:?}", c + 1)));
        }
        s.cats[c] =
            u32::from_str_radix(f, 16).map_err(|_| err(format!("categorical feature {} is not hex: {f:?}", c + 1)))?;
        s.cat_present |= 1 << c;
    }
    Ok(s)
}

/// Longest line the reader accepts, bytes (a Criteo line is well under 1 KiB). A longer line is skipped
/// and counted as bad without being held in memory.
pub const MAX_LINE_BYTES: usize = 64 << 10;

/// Streams samples from a reader, one line at a time, counting and remembering bad lines.
#[derive(Debug)]
pub struct CriteoReader<R> {
    input: R,
    line: u64,
    bytes: Vec<u8>,
    /// Lines rejected so far.
    pub bad_lines: u64,
    /// The first rejected lines with their reasons (at most 20 kept).
    pub first_errors: Vec<LineError>,
}

impl<R: BufRead> CriteoReader<R> {
    /// A reader over `input`.
    pub fn new(input: R) -> Self {
        CriteoReader { input, line: 0, bytes: Vec::new(), bad_lines: 0, first_errors: Vec::new() }
    }

    /// The next good sample with its 1-based line number; bad lines (including lines that are not UTF-8)
    /// are counted and skipped. A read error of the input itself ends the stream and is recorded.
    pub fn next_sample(&mut self) -> Option<(u64, Sample)> {
        loop {
            self.bytes.clear();
            self.line += 1;
            let limit = MAX_LINE_BYTES as u64 + 1;
            match (&mut self.input).take(limit).read_until(b'\n', &mut self.bytes) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(e) => {
                    self.reject(LineError { line: self.line, reason: format!("reading the input failed: {e}") });
                    return None;
                }
            }
            if self.bytes.len() > MAX_LINE_BYTES && self.bytes.last() != Some(&b'\n') {
                let line = self.line;
                self.bytes = Vec::new();
                if let Err(e) = self.skip_rest_of_line() {
                    self.reject(LineError { line, reason: format!("reading the input failed: {e}") });
                    return None;
                }
                self.reject(LineError { line, reason: format!("longer than {MAX_LINE_BYTES} bytes") });
                continue;
            }
            let raw = self.bytes.strip_suffix(b"\n").unwrap_or(&self.bytes);
            let text = match std::str::from_utf8(raw) {
                Ok(t) => t,
                Err(_) => {
                    let line = self.line;
                    self.reject(LineError { line, reason: "not UTF-8 text".into() });
                    continue;
                }
            };
            if text.is_empty() || text == "\r" {
                continue; // blank lines are not samples
            }
            match parse_line(text, self.line) {
                Ok(s) => return Some((self.line, s)),
                Err(e) => self.reject(e),
            }
        }
    }

    /// Consumes the input up to and including the next newline without keeping it.
    fn skip_rest_of_line(&mut self) -> std::io::Result<()> {
        loop {
            let buf = self.input.fill_buf()?;
            if buf.is_empty() {
                return Ok(());
            }
            match buf.iter().position(|b| *b == b'\n') {
                Some(end) => {
                    self.input.consume(end + 1);
                    return Ok(());
                }
                None => {
                    let n = buf.len();
                    self.input.consume(n);
                }
            }
        }
    }

    fn reject(&mut self, e: LineError) {
        self.bad_lines += 1;
        if self.first_errors.len() < 20 {
            self.first_errors.push(e);
        }
    }
}

/// A seeded synthetic dataset in the Criteo layout. Sample i is a function of (seed, i) alone.
///
/// Categorical field f draws a rank from a Zipf(1.2) law over `vocab[f]` values (vocabularies from 8 to
/// 20,000 values), hashed to 32 bits; 4 % of categorical and 10 % of integer fields are missing; integers
/// are log-normal counts (one field can be −1 or −2, as in the real data). The label is drawn from a planted
/// logistic teacher: a bias, one weight per (field, value) and one per log-transformed integer, so the
/// teacher's own AUC on the test split is the best any model can reach.
#[derive(Debug, Clone)]
pub struct SyntheticCriteo {
    seed: u64,
    vocab: [u32; NUM_CAT],
    /// Cumulative Zipf weights per field (normalised), for inverse-CDF sampling.
    cdf: Vec<Vec<f64>>,
    int_weights: [f32; NUM_INT],
    bias: f32,
    /// The teacher's weight of every (field, rank) — [`Self::cat_weight`] of the rank's value, computed once
    /// where the vocabularies hold at most [`WEIGHTS_HELD`] values, else per sample (the same numbers).
    weights: Option<Vec<Vec<f32>>>,
}

/// Most (field, value) weights a [`SyntheticCriteo`] computes ahead (16 MiB); larger vocabularies compute a
/// value's weight each time it is drawn.
const WEIGHTS_HELD: u64 = 1 << 22;

/// The largest field's vocabulary of [`SyntheticCriteo::new`].
pub const SYNTHETIC_MAX_VOCAB: u32 = 20_000;
/// The Zipf exponent of [`SyntheticCriteo::new`].
pub const SYNTHETIC_ZIPF: f64 = 1.2;
/// The largest vocabulary [`SyntheticCriteo::with_vocab`] accepts (the Criteo Kaggle data's largest field
/// has about 10 M values).
pub const SYNTHETIC_VOCAB_LIMIT: u32 = 1 << 25;

impl SyntheticCriteo {
    /// The dataset of `seed` (vocabularies from 8 to 20,000 values).
    pub fn new(seed: u64) -> Self {
        Self::with_vocab(seed, SYNTHETIC_MAX_VOCAB, SYNTHETIC_ZIPF)
    }

    /// [`Self::new`]`(seed)`, made once per process and shared (the last seed asked for is kept): readers
    /// made per dealt split would otherwise build its tables again for every split.
    pub fn shared(seed: u64) -> std::sync::Arc<Self> {
        static LAST: std::sync::Mutex<Option<(u64, std::sync::Arc<SyntheticCriteo>)>> = std::sync::Mutex::new(None);
        let mut last = LAST.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match &*last {
            Some((s, data)) if *s == seed => data.clone(),
            _ => {
                let data = std::sync::Arc::new(Self::new(seed));
                *last = Some((seed, data.clone()));
                data
            }
        }
    }

    /// The dataset of `seed` with field vocabularies growing geometrically from 8 to `max_vocab` values
    /// (clamped to 8..=[`SYNTHETIC_VOCAB_LIMIT`]), each value's rank drawn from a Zipf law of exponent `zipf`
    /// (clamped to 1.01..=3): with a few million values and an exponent near 1 the fields hold millions of
    /// ids and most of the large fields' values are seen once or never, as in real click logs.
    pub fn with_vocab(seed: u64, max_vocab: u32, zipf: f64) -> Self {
        let max_vocab = max_vocab.clamp(8, SYNTHETIC_VOCAB_LIMIT);
        let zipf = if zipf.is_finite() { zipf.clamp(1.01, 3.0) } else { SYNTHETIC_ZIPF };
        let mut rng = Rng::new(mix(seed, 0xc417));
        let mut vocab = [0u32; NUM_CAT];
        for (f, v) in vocab.iter_mut().enumerate() {
            // From 8 to max_vocab values, a few fields large.
            let ratio = f64::from(max_vocab) / 8.0;
            *v = (8.0 * ratio.powf(f as f64 / (NUM_CAT - 1) as f64)).round() as u32;
        }
        let cdf = vocab
            .iter()
            .map(|&n| {
                let mut acc = 0.0;
                let mut c: Vec<f64> = (1..=n)
                    .map(|k| {
                        acc += (k as f64).powf(-zipf);
                        acc
                    })
                    .collect();
                let total = acc;
                c.iter_mut().for_each(|x| *x /= total);
                c
            })
            .collect();
        let mut int_weights = [0f32; NUM_INT];
        int_weights.iter_mut().for_each(|w| *w = (rng.normal() * 0.15) as f32);
        let mut data = SyntheticCriteo { seed, vocab, cdf, int_weights, bias: -1.0, weights: None };
        if vocab.iter().map(|v| u64::from(*v)).sum::<u64>() <= WEIGHTS_HELD {
            let of = |f: usize| (0..vocab[f]).map(|rank| data.cat_weight(f, data.category(f, rank))).collect();
            data.weights = Some((0..NUM_CAT).map(of).collect());
        }
        data
    }

    fn category(&self, f: usize, rank: u32) -> u32 {
        (mix(self.seed ^ 0xfeed, (f as u64) << 32 | u64::from(rank)) & 0xffff_ffff) as u32
    }

    /// The teacher's weight for value `hash` of field `f`: larger for fields with small vocabularies.
    fn cat_weight(&self, f: usize, hash: u32) -> f32 {
        let mut rng = Rng::new(mix(self.seed ^ 0x7eac, (f as u64) << 32 | u64::from(hash)));
        let scale = if f % 3 == 0 { 0.6 } else { 0.25 };
        (rng.normal() * scale) as f32
    }

    /// Sample `index` and the teacher's click probability for it.
    pub fn sample(&self, index: u64) -> (Sample, f32) {
        let mut rng = Rng::new(mix(self.seed, index));
        let mut s = Sample { label: 0, ints: [0; NUM_INT], int_present: 0, cats: [0; NUM_CAT], cat_present: 0 };
        let mut logit = self.bias;
        for j in 0..NUM_INT {
            if rng.uniform() < 0.10 {
                continue;
            }
            let mut x = (rng.normal() * 1.5 + 1.0).exp().floor() as i64;
            if j == 1 && rng.uniform() < 0.05 {
                x = -1 - rng.below(2) as i64;
            }
            s.ints[j] = x;
            s.int_present |= 1 << j;
            logit += self.int_weights[j] * s.log_int(j);
        }
        for f in 0..NUM_CAT {
            if rng.uniform() < 0.04 {
                continue;
            }
            let u = rng.uniform();
            let rank = self.cdf[f].partition_point(|c| *c < u).min(self.vocab[f] as usize - 1) as u32;
            let hash = self.category(f, rank);
            s.cats[f] = hash;
            s.cat_present |= 1 << f;
            logit += match &self.weights {
                Some(weights) => weights[f][rank as usize],
                None => self.cat_weight(f, hash),
            };
        }
        let p = 1.0 / (1.0 + (-logit).exp());
        s.label = u8::from(rng.uniform() < f64::from(p));
        (s, p)
    }

    /// The sample as a Criteo TSV line (for writing files and testing the reader).
    pub fn to_line(s: &Sample) -> String {
        let mut out = s.label.to_string();
        for j in 0..NUM_INT {
            out.push('\t');
            if s.int_present >> j & 1 == 1 {
                out.push_str(&s.ints[j].to_string());
            }
        }
        for f in 0..NUM_CAT {
            out.push('\t');
            if s.cat_present >> f & 1 == 1 {
                out.push_str(&format!("{:08x}", s.cats[f]));
            }
        }
        out
    }
}

/// Area under the ROC curve of `scores` for binary `labels` (ties count one half). 0.5 when a class is absent.
pub fn auc(scores: &[f32], labels: &[u8]) -> f64 {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|a, b| scores[*a].total_cmp(&scores[*b]));
    let positives = labels.iter().filter(|l| **l == 1).count() as f64;
    let negatives = labels.len() as f64 - positives;
    if positives == 0.0 || negatives == 0.0 {
        return 0.5;
    }
    // Sum of the (average) ranks of the positives.
    let (mut rank_sum, mut i) = (0.0f64, 0usize);
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && scores[order[j + 1]] == scores[order[i]] {
            j += 1;
        }
        let average_rank = (i + j) as f64 / 2.0 + 1.0;
        rank_sum += order[i..=j].iter().filter(|k| labels[**k] == 1).count() as f64 * average_rank;
        i = j + 1;
    }
    (rank_sum - positives * (positives + 1.0) / 2.0) / (positives * negatives)
}

/// Where training samples come from: the synthetic generator, or a Criteo-layout file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSpec {
    /// `SyntheticCriteo` of a seed.
    Synthetic {
        /// Seed.
        seed: u64,
    },
    /// One or more TSV files, read in this order (never empty).
    Files(Vec<std::path::PathBuf>),
}

impl std::str::FromStr for DataSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "synthetic" => Ok(DataSpec::Synthetic { seed: 1 }),
            "" => Err("--data needs `synthetic` or one or more file paths separated by commas".into()),
            list => {
                let paths: Vec<std::path::PathBuf> = list.split(',').map(|p| p.trim().into()).collect();
                if paths.iter().any(|p| p.as_os_str().is_empty()) {
                    return Err(format!("--data {list:?}: an empty file name in the list"));
                }
                Ok(DataSpec::Files(paths))
            }
        }
    }
}

/// In a file, every line whose number is a multiple of this is held out for evaluation.
pub const HOLD_OUT_EVERY: u64 = 10;
/// First index of the synthetic evaluation range (training streams never reach it).
pub const SYNTHETIC_EVAL_BASE: u64 = 1 << 62;

/// One worker's endless stream of training samples. A file is read line by line, again from the start at
/// its end; the worker takes the lines whose number is `part` modulo `parts`, except held-out lines.
#[derive(Debug)]
pub struct TrainingStream {
    source: StreamSource,
    /// Bad lines met in the first pass over the file.
    pub bad_lines: u64,
    /// The first bad lines of the first pass, with line numbers and reasons.
    pub first_errors: Vec<LineError>,
    passes: u64,
    /// Training lines this worker used in the current pass over the file.
    used_this_pass: u64,
    /// Stop after this many passes over a file (None: start over at the end, forever).
    epochs: Option<u64>,
    /// The last pass ended: only empty batches from now on.
    finished: bool,
    /// Training lines of this worker in one pass (known after the first).
    lines_per_pass: u64,
    /// Bad lines of the files of the first pass read to their end.
    bad_in_done_files: u64,
}

#[derive(Debug)]
enum StreamSource {
    Synthetic {
        data: Box<SyntheticCriteo>,
        next: u64,
    },
    File {
        paths: Vec<std::path::PathBuf>,
        /// The file being read.
        current: usize,
        reader: CriteoReader<std::io::BufReader<std::fs::File>>,
        part: u64,
        parts: u64,
    },
}

fn open(path: &std::path::Path) -> Result<CriteoReader<std::io::BufReader<std::fs::File>>, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("opening {}: {e}", path.display()))?;
    Ok(CriteoReader::new(std::io::BufReader::with_capacity(1 << 20, file)))
}

impl TrainingStream {
    /// The stream of worker `part` of `parts` (for synthetic data, `part` picks a disjoint index range).
    pub fn new(spec: &DataSpec, part: u64, parts: u64) -> Result<Self, String> {
        let source = match spec {
            DataSpec::Synthetic { seed } => {
                StreamSource::Synthetic { data: Box::new(SyntheticCriteo::new(*seed)), next: part << 40 }
            }
            DataSpec::Files(paths) => {
                let first = paths.first().ok_or("--data names no file")?;
                StreamSource::File { paths: paths.clone(), current: 0, reader: open(first)?, part, parts: parts.max(1) }
            }
        };
        Ok(TrainingStream {
            source,
            bad_lines: 0,
            first_errors: Vec::new(),
            passes: 0,
            used_this_pass: 0,
            epochs: None,
            finished: false,
            lines_per_pass: 0,
            bad_in_done_files: 0,
        })
    }

    /// Ends the stream after `epochs` complete passes over a file: the batch that reaches the end of the
    /// last pass is short, the next ones are empty. Synthetic data has no passes; it is refused.
    pub fn with_epochs(mut self, epochs: Option<u64>) -> Result<Self, String> {
        if epochs.is_some() && matches!(self.source, StreamSource::Synthetic { .. }) {
            return Err("--epochs counts passes over a data file; synthetic data has no end (use --steps)".into());
        }
        if epochs == Some(0) {
            return Err("--epochs must be at least 1".into());
        }
        self.epochs = epochs;
        Ok(self)
    }

    /// Complete passes over the file so far.
    pub fn passes(&self) -> u64 {
        self.passes
    }

    /// The passes so far as a fraction: complete passes plus the share of the current one, once the first
    /// pass told how many lines a pass has (synthetic data: 0).
    pub fn epochs_done(&self) -> f64 {
        match (self.passes, self.lines_per_pass) {
            (0, _) | (_, 0) => self.passes as f64,
            (p, n) => p as f64 + self.used_this_pass as f64 / n as f64,
        }
    }

    /// The next `n` samples.
    pub fn next_batch(&mut self, n: usize) -> Result<Vec<Sample>, String> {
        let mut out = Vec::with_capacity(n);
        if self.finished {
            return Ok(out);
        }
        match &mut self.source {
            StreamSource::Synthetic { data, next } => {
                for _ in 0..n {
                    out.push(data.sample(*next).0);
                    *next += 1;
                }
            }
            StreamSource::File { paths, current, reader, part, parts } => {
                while out.len() < n {
                    match reader.next_sample() {
                        Some((line, s)) => {
                            if line % HOLD_OUT_EVERY != 0 && line % *parts == *part {
                                out.push(s);
                                self.used_this_pass += 1;
                            }
                        }
                        None if *current + 1 < paths.len() => {
                            // The next file of the list; bad lines add up over the files of the first pass.
                            if self.passes == 0 {
                                self.bad_in_done_files += reader.bad_lines;
                                let room = 20usize.saturating_sub(self.first_errors.len());
                                self.first_errors.extend(reader.first_errors.iter().take(room).cloned());
                            }
                            *current += 1;
                            *reader = open(&paths[*current])?;
                        }
                        None => {
                            if self.passes == 0 {
                                self.bad_in_done_files += reader.bad_lines;
                                self.bad_lines = self.bad_in_done_files;
                                let room = 20usize.saturating_sub(self.first_errors.len());
                                self.first_errors.extend(reader.first_errors.iter().take(room).cloned());
                                self.lines_per_pass = self.used_this_pass;
                            }
                            self.passes += 1;
                            // Only a pass that yielded nothing at all means the file has nothing for us (a
                            // batch may well start exactly at the end of a pass).
                            if self.used_this_pass == 0 {
                                return Err(format!(
                                    "{} has no usable training lines for worker {part} of {parts} ({} bad lines)",
                                    names(paths),
                                    self.bad_lines
                                ));
                            }
                            self.used_this_pass = 0;
                            if self.epochs.is_some_and(|e| self.passes >= e) {
                                self.finished = true;
                                break;
                            }
                            *current = 0;
                            *reader = open(&paths[0])?;
                        }
                    }
                }
                if self.passes == 0 {
                    self.bad_lines = self.bad_in_done_files + reader.bad_lines;
                }
            }
        }
        Ok(out)
    }
}

/// The training samples of one dealt split (dynamic data sharding): the lines of a byte range of a file,
/// numbered from the split's first line, held-out lines skipped (the same every-10th rule as a whole
/// file); or a range of synthetic sample indices.
#[derive(Debug)]
pub struct SplitSamples {
    source: SplitSource,
    /// Samples handed out so far.
    pub used: u64,
}

#[derive(Debug)]
enum SplitSource {
    File { path: std::path::PathBuf, reader: CriteoReader<std::io::BufReader<std::io::Take<std::fs::File>>>, end: u64 },
    Synthetic { data: std::sync::Arc<SyntheticCriteo>, next: u64, end: u64 },
}

impl SplitSamples {
    /// Lines `first_line..` in bytes `[start, end)` of `path`. A file that is gone, or shorter than `end`, is
    /// an error naming it.
    pub fn file(path: &std::path::Path, first_line: u64, start: u64, end: u64) -> Result<Self, String> {
        use std::io::{Read as _, Seek as _};
        let mut file =
            std::fs::File::open(path).map_err(|e| format!("opening the data file {}: {e}", path.display()))?;
        let len = file.metadata().map_err(|e| format!("reading the data file {}: {e}", path.display()))?.len();
        if len < end || start > end {
            return Err(shrank(path, start, end, len));
        }
        file.seek(std::io::SeekFrom::Start(start))
            .map_err(|e| format!("reading the data file {}: {e}", path.display()))?;
        let mut reader = CriteoReader::new(std::io::BufReader::with_capacity(1 << 18, file.take(end - start)));
        reader.line = first_line.saturating_sub(1);
        Ok(SplitSamples { source: SplitSource::File { path: path.to_path_buf(), reader, end }, used: 0 })
    }

    /// Synthetic samples `[start, end)` of `data`.
    pub fn synthetic(data: std::sync::Arc<SyntheticCriteo>, start: u64, end: u64) -> Self {
        SplitSamples { source: SplitSource::Synthetic { data, next: start, end: end.max(start) }, used: 0 }
    }

    /// The next (up to) `n` training samples of the split; empty once it is used up. A file that shrank or
    /// vanished while its split was read is an error naming it.
    pub fn next_batch(&mut self, n: usize) -> Result<Vec<Sample>, String> {
        let mut out = Vec::with_capacity(n.min(4096));
        match &mut self.source {
            SplitSource::Synthetic { data, next, end } => {
                while out.len() < n && *next < *end {
                    out.push(data.sample(*next).0);
                    *next += 1;
                }
            }
            SplitSource::File { path, reader, end } => {
                while out.len() < n {
                    match reader.next_sample() {
                        Some((line, s)) if line % HOLD_OUT_EVERY != 0 => out.push(s),
                        Some(_) => {}
                        None => {
                            // The range ended: either where the dealer cut it, or early because the file
                            // lost bytes under us.
                            let len = std::fs::metadata(&*path).map(|m| m.len()).unwrap_or(0);
                            if len < *end {
                                return Err(shrank(path, 0, *end, len));
                            }
                            if let Some(e) = reader.first_errors.iter().find(|e| e.reason.starts_with("reading")) {
                                return Err(format!("reading the data file {}: {}", path.display(), e.reason));
                            }
                            break;
                        }
                    }
                }
            }
        }
        self.used += out.len() as u64;
        Ok(out)
    }

    /// Bad lines met in the split so far.
    pub fn bad_lines(&self) -> u64 {
        match &self.source {
            SplitSource::File { reader, .. } => reader.bad_lines,
            SplitSource::Synthetic { .. } => 0,
        }
    }

    /// The first bad lines of the split, with their line numbers.
    pub fn first_errors(&self) -> &[LineError] {
        match &self.source {
            SplitSource::File { reader, .. } => &reader.first_errors,
            SplitSource::Synthetic { .. } => &[],
        }
    }
}

fn shrank(path: &std::path::Path, start: u64, end: u64, len: u64) -> String {
    format!(
        "the data file {} changed under the run: a dealt split needs bytes {start}..{end}, the file now has {len} \
         (a training file must not shrink or be replaced while a run reads it)",
        path.display()
    )
}

fn names(paths: &[std::path::PathBuf]) -> String {
    paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

/// The held-out evaluation set.
#[derive(Debug, Clone)]
pub struct HeldOut {
    /// The samples.
    pub samples: Vec<Sample>,
    /// The planted teacher's click probability of each sample (synthetic data only).
    pub teacher: Option<Vec<f32>>,
    /// Bad lines met while reading a file.
    pub bad_lines: u64,
}

/// The held-out evaluation samples (at most `n`), with the teacher's probabilities for synthetic data.
pub fn held_out(spec: &DataSpec, n: usize) -> Result<HeldOut, String> {
    match spec {
        DataSpec::Synthetic { seed } => {
            let data = SyntheticCriteo::new(*seed);
            let (samples, probs): (Vec<Sample>, Vec<f32>) =
                (0..n as u64).map(|i| data.sample(SYNTHETIC_EVAL_BASE + i)).unzip();
            Ok(HeldOut { samples, teacher: Some(probs), bad_lines: 0 })
        }
        DataSpec::Files(paths) => {
            let mut out = Vec::new();
            let mut bad_lines = 0;
            for path in paths {
                let mut reader = open(path)?;
                while out.len() < n {
                    match reader.next_sample() {
                        Some((line, s)) if line % HOLD_OUT_EVERY == 0 => out.push(s),
                        Some(_) => {}
                        None => break,
                    }
                }
                bad_lines += reader.bad_lines;
                if out.len() >= n {
                    break;
                }
            }
            if out.is_empty() {
                return Err(format!(
                    "{} has no held-out lines (every {HOLD_OUT_EVERY}th line is held out)",
                    names(paths)
                ));
            }
            Ok(HeldOut { samples: out, teacher: None, bad_lines })
        }
    }
}

#[cfg(test)]
mod tests;
