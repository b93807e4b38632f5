//! The byte format of a shard snapshot: everything [`crate::ShardCore`] needs to continue exactly, written by
//! [`crate::ShardCore::checkpoint`] and read by [`crate::ShardCore::restore`].
//!
//! Layout: the magic `GAPSSHRD`, a format version (u32), the header — a derived struct,
//! [`crate::core::CheckpointInfo`], as JSON after its u64 byte count (format 7 on; fixed places before) —
//! then the state's fields in a fixed order, all little-endian: integers as fixed-width words, float slices
//! as a u64 element count followed by the raw f32 bytes, strings as a u64 byte count and UTF-8. Beyond the
//! header there is no self-description: the version names the order, and a reader refuses any other
//! version with a clear message. Every length is checked against
//! the bytes that remain before anything is allocated, so a truncated or corrupt file is an error, never a
//! panic or a huge allocation. Integrity (a checksum per file) is the caller's; this module only parses.

/// The format written by this version of gaps; a snapshot of a format outside
/// [`OLDEST_FORMAT_VERSION`]`..=FORMAT_VERSION` is refused.
pub const FORMAT_VERSION: u32 = 7;
/// The oldest format this version still reads (format 2 lacks the data dealer and the per-grant sample
/// counts of format 3, formats 2 and 3 the per-worker push ledgers of format 4, formats before 6 the
/// coordinator's replica sets; they restore empty; formats before 7 hold the header at fixed places).
pub const OLDEST_FORMAT_VERSION: u32 = 2;
const MAGIC: &[u8; 8] = b"GAPSSHRD";

/// Why a snapshot could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointError {
    /// Not a gaps shard snapshot.
    #[error("not a gaps shard checkpoint (bad magic)")]
    Magic,
    /// Written by an incompatible version.
    #[error("checkpoint format {found} is not supported by this gaps (formats {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION}); restore it with the version that wrote it")]
    Version {
        /// The version in the file.
        found: u32,
    },
    /// The bytes end early or announce more than they hold.
    #[error("checkpoint is truncated or corrupt: {0}")]
    Corrupt(String),
    /// A valid snapshot of another shard or model.
    #[error("checkpoint does not match this shard: {0}")]
    Mismatch(String),
}

/// Appends fields.
#[derive(Debug, Default)]
pub(crate) struct Writer {
    pub(crate) buf: Vec<u8>,
}

impl Writer {
    /// A writer over `buf` (cleared, its memory kept) that reserves `capacity` bytes up front: a snapshot's
    /// size is known ahead, so the copy is made once without reallocations, and a buffer reused from the
    /// previous checkpoint is already mapped (first-touch page faults cost several times the copy itself).
    pub(crate) fn reusing(mut buf: Vec<u8>, capacity: usize) -> Self {
        buf.clear();
        buf.reserve(capacity + 64);
        let mut w = Writer { buf };
        w.buf.extend_from_slice(MAGIC);
        w.u32(FORMAT_VERSION);
        w
    }

    pub(crate) fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }

    pub(crate) fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub(crate) fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub(crate) fn f64(&mut self, v: f64) {
        self.u64(v.to_bits());
    }

    pub(crate) fn f32s(&mut self, v: &[f32]) {
        self.u64(v.len() as u64);
        self.buf.extend_from_slice(&gaps_common::wire::f32s_to_le_bytes(v));
    }

    pub(crate) fn u32s(&mut self, v: &[u32]) {
        self.u32s_of(v.iter().copied());
    }

    pub(crate) fn u64s(&mut self, v: &[u64]) {
        self.u64s_of(v.iter().copied());
    }

    /// [`Self::u32s`] of what an iterator of known length yields (a field of each of a table's rows).
    pub(crate) fn u32s_of(&mut self, v: impl ExactSizeIterator<Item = u32>) {
        self.u64(v.len() as u64);
        v.for_each(|x| self.u32(x));
    }

    /// [`Self::u64s`] of what an iterator of known length yields.
    pub(crate) fn u64s_of(&mut self, v: impl ExactSizeIterator<Item = u64>) {
        self.u64(v.len() as u64);
        v.for_each(|x| self.u64(x));
    }

    pub(crate) fn bytes(&mut self, v: &[u8]) {
        self.u64(v.len() as u64);
        self.buf.extend_from_slice(v);
    }

    pub(crate) fn str(&mut self, v: &str) {
        self.bytes(v.as_bytes());
    }
}

/// Reads fields back, bounds-checked.
#[derive(Debug)]
pub(crate) struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
    format: u32,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Result<Self, CheckpointError> {
        if data.len() < MAGIC.len() + 4 || &data[..MAGIC.len()] != MAGIC {
            return Err(CheckpointError::Magic);
        }
        let mut r = Reader { data, pos: MAGIC.len(), format: 0 };
        let found = r.u32()?;
        if !(OLDEST_FORMAT_VERSION..=FORMAT_VERSION).contains(&found) {
            return Err(CheckpointError::Version { found });
        }
        r.format = found;
        Ok(r)
    }

    /// A reader over a section of a checkpoint of `format` (no magic, no version of its own).
    pub(crate) fn section(data: &'a [u8], format: u32) -> Self {
        Reader { data, pos: 0, format }
    }

    /// Everything not read yet.
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        let out = &self.data[self.pos..];
        self.pos = self.data.len();
        out
    }

    /// The format version of what is read.
    pub(crate) fn format(&self) -> u32 {
        self.format
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], CheckpointError> {
        let end = self.pos.checked_add(n).filter(|e| *e <= self.data.len()).ok_or_else(|| {
            CheckpointError::Corrupt(format!(
                "{what} needs {n} bytes at offset {}, {} left",
                self.pos,
                self.data.len() - self.pos
            ))
        })?;
        let out = &self.data[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    /// A count of elements of `size` bytes each that must fit in what is left.
    fn count(&mut self, size: usize, what: &str) -> Result<usize, CheckpointError> {
        let n = self.u64()?;
        let left = (self.data.len() - self.pos) as u64;
        if n.checked_mul(size as u64).is_none_or(|bytes| bytes > left) {
            return Err(CheckpointError::Corrupt(format!("{what} announces {n} elements, {left} bytes left")));
        }
        Ok(n as usize)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, CheckpointError> {
        Ok(self.take(1, "a byte")?[0])
    }

    pub(crate) fn u32(&mut self) -> Result<u32, CheckpointError> {
        let b = self.take(4, "a u32")?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub(crate) fn u64(&mut self) -> Result<u64, CheckpointError> {
        let b = self.take(8, "a u64")?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    pub(crate) fn f64(&mut self) -> Result<f64, CheckpointError> {
        Ok(f64::from_bits(self.u64()?))
    }

    pub(crate) fn f32s(&mut self, what: &str) -> Result<Vec<f32>, CheckpointError> {
        let n = self.count(4, what)?;
        Ok(gaps_common::wire::le_bytes_to_f32s(self.take(n * 4, what)?))
    }

    pub(crate) fn u32s(&mut self, what: &str) -> Result<Vec<u32>, CheckpointError> {
        let n = self.count(4, what)?;
        (0..n).map(|_| self.u32()).collect()
    }

    pub(crate) fn u64s(&mut self, what: &str) -> Result<Vec<u64>, CheckpointError> {
        let n = self.count(8, what)?;
        (0..n).map(|_| self.u64()).collect()
    }

    pub(crate) fn bytes(&mut self, what: &str) -> Result<Vec<u8>, CheckpointError> {
        let n = self.count(1, what)?;
        Ok(self.take(n, what)?.to_vec())
    }

    pub(crate) fn str(&mut self, what: &str) -> Result<String, CheckpointError> {
        String::from_utf8(self.bytes(what)?).map_err(|_| CheckpointError::Corrupt(format!("{what} is not UTF-8")))
    }

    /// A slice of exactly `n` floats.
    pub(crate) fn f32s_of(&mut self, n: usize, what: &str) -> Result<Vec<f32>, CheckpointError> {
        let v = self.f32s(what)?;
        if v.len() != n {
            return Err(CheckpointError::Mismatch(format!("{what} has {} elements, this shard {n}", v.len())));
        }
        Ok(v)
    }

    /// Whether everything was read.
    pub(crate) fn at_end(&self) -> bool {
        self.pos == self.data.len()
    }

    pub(crate) fn finish(&self) -> Result<(), CheckpointError> {
        if self.pos != self.data.len() {
            return Err(CheckpointError::Corrupt(format!(
                "{} unexpected bytes at the end",
                self.data.len() - self.pos
            )));
        }
        Ok(())
    }
}
