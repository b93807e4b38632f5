//! Checkpoint files of one shard: written atomically with a manifest that holds a checksum, kept up to a
//! count, and found again at start-up (the newest complete and intact one wins; a corrupt or partial one is
//! skipped with a message naming the file).
//!
//! Layout under `--checkpoint-dir DIR`: `DIR/shard-<i>/ckpt-<id>.bin` (the core's snapshot, see
//! `gaps_shard::checkpoint`) and `DIR/shard-<i>/ckpt-<id>.json` (the manifest: format, id, shard, shard
//! count, epoch, byte count, CRC-32 of the snapshot, tensor versions, time written). The manifest is written
//! last: a checkpoint without one is incomplete. Each file is written under a temporary name, flushed to
//! disk, renamed, and the directory is flushed, so a crash at any moment leaves either the old set of
//! checkpoints or the new one, never a torn file under a final name.

use anyhow::{bail, Context, Result};
use gaps_shard::core::CheckpointInfo;
use serde::{Deserialize, Serialize};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use tracing::warn;

/// Where and how a shard keeps its checkpoints.
#[derive(Debug, Clone)]
pub struct CheckpointStore {
    dir: PathBuf,
    keep: usize,
}

/// One complete checkpoint found on disk.
#[derive(Debug, Clone)]
pub struct Found {
    /// The snapshot file.
    pub path: PathBuf,
    /// The snapshot, checksum verified.
    pub bytes: Vec<u8>,
}

/// Writes `bytes` to `path` through a temporary file renamed over it (flushed first); a failed write leaves
/// no temporary file behind.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let written = (|| {
        let mut f = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(bytes).with_context(|| format!("writing {}", tmp.display()))?;
        f.sync_all().with_context(|| format!("flushing {}", tmp.display()))?;
        drop(f);
        fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    })();
    if written.is_err() {
        // A write that failed (disk full, I/O error) leaves no partial file behind to fill the disk further.
        let _ = fs::remove_file(&tmp);
    }
    written
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).with_context(|| format!("flushing the directory {}", dir.display()))
}

impl CheckpointStore {
    /// The store of shard `shard` under `root`, keeping the newest `keep` checkpoints (at least 1).
    pub fn open(root: &Path, shard: u32, keep: usize) -> Result<Self> {
        let dir = root.join(format!("shard-{shard}"));
        fs::create_dir_all(&dir).with_context(|| format!("creating the checkpoint directory {}", dir.display()))?;
        Ok(CheckpointStore { dir, keep: keep.max(1) })
    }

    /// The shard's checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn paths(&self, id: u64) -> (PathBuf, PathBuf) {
        (self.dir.join(format!("ckpt-{id:020}.bin")), self.dir.join(format!("ckpt-{id:020}.json")))
    }

    /// Ids of the checkpoints that have a manifest, oldest first.
    fn ids(&self) -> Result<Vec<u64>> {
        let mut ids = Vec::new();
        for entry in fs::read_dir(&self.dir).with_context(|| format!("listing {}", self.dir.display()))? {
            let name = entry?.file_name();
            let name = name.to_string_lossy();
            if let Some(id) = name.strip_prefix("ckpt-").and_then(|n| n.strip_suffix(".json")) {
                if let Ok(id) = id.parse() {
                    ids.push(id);
                }
            }
        }
        ids.sort_unstable();
        Ok(ids)
    }

    /// An id above every checkpoint on disk.
    pub fn next_id(&self) -> Result<u64> {
        Ok(self.ids()?.last().map_or(1, |id| id + 1))
    }

    /// Writes checkpoint `id` (snapshot, then manifest) atomically and drops the oldest beyond `keep`.
    /// `step` is the synchronous/GBA steps applied and `at_step` the step the checkpoint was asked for (a
    /// cluster checkpoint in `sync`: every shard's file has `step` = `at_step`), both recorded in the
    /// manifest.
    /// `cluster`: the coordinator chose the id for every shard (a cluster checkpoint, which a rollback can
    /// return the whole cluster to); the newest `keep` of those and of this shard's own are kept apart, so
    /// that checkpoints a shard takes alone while the coordinator is down never push the last cluster
    /// checkpoints out.
    pub fn write(
        &self,
        info: &CheckpointInfo,
        step: u64,
        at_step: Option<u64>,
        cluster: bool,
        bytes: &[u8],
    ) -> Result<PathBuf> {
        let (bin, manifest) = self.paths(info.id);
        write_atomically(&bin, bytes)?;
        let written = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
        let m = Manifest {
            format: gaps_shard::checkpoint::FORMAT_VERSION,
            id: info.id,
            shard: info.shard,
            num_shards: info.num_shards,
            epoch: info.epoch,
            bytes: bytes.len() as u64,
            crc32: crc32fast::hash(bytes),
            tensor_versions: info.tensor_versions.clone(),
            step,
            at_step,
            cluster,
            written_unix_ms: u64::try_from(written).unwrap_or(u64::MAX),
        };
        let text = serde_json::to_string(&m).context("encoding the manifest")?;
        write_atomically(&manifest, text.as_bytes())?;
        sync_dir(&self.dir)?;
        self.prune()?;
        Ok(bin)
    }

    fn prune(&self) -> Result<()> {
        let (cluster, own): (Vec<u64>, Vec<u64>) = self.ids()?.into_iter().partition(|id| self.is_cluster(*id));
        for ids in [cluster, own] {
            for id in ids.iter().take(ids.len().saturating_sub(self.keep)) {
                let (bin, manifest) = self.paths(*id);
                // The manifest goes first: a checkpoint without one is never used.
                let _ = fs::remove_file(&manifest);
                let _ = fs::remove_file(&bin);
            }
        }
        Ok(())
    }

    /// Whether checkpoint `id`'s manifest says it is a cluster checkpoint.
    fn is_cluster(&self, id: u64) -> bool {
        let (_, manifest) = self.paths(id);
        Manifest::read(&manifest).is_ok_and(|m| m.cluster)
    }

    /// Ids of the complete, intact checkpoints no newer than `max`, newest first, at most `limit` (each one
    /// is read and checked against its manifest).
    pub fn intact_ids(&self, max: u64, limit: usize) -> Result<Vec<u64>> {
        let mut out = Vec::new();
        for id in self.ids()?.into_iter().rev().filter(|id| *id <= max) {
            if out.len() == limit {
                break;
            }
            match self.load(id) {
                Ok(_) => out.push(id),
                Err(e) => warn!(error = format!("{e:#}"), "skipping a damaged checkpoint"),
            }
        }
        Ok(out)
    }

    /// Checkpoint `id` if it is complete and intact.
    pub fn load(&self, id: u64) -> Result<Found> {
        let (bin, manifest) = self.paths(id);
        load_verified(&bin, &manifest).map(|bytes| Found { path: bin, bytes })
    }

    /// The newest complete and intact checkpoint, if any. Damaged ones are reported and skipped.
    pub fn latest(&self) -> Result<Option<Found>> {
        for id in self.ids()?.into_iter().rev() {
            match self.load(id) {
                Ok(found) => return Ok(Some(found)),
                Err(e) => warn!(error = format!("{e:#}"), "skipping a damaged checkpoint"),
            }
        }
        Ok(None)
    }
}

/// The manifest written beside every checkpoint (`ckpt-ID.json`): what the snapshot is and how to check it.
/// Fields added after the first format read as their defaults from older manifests; `bytes` and `crc32`
/// are required.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The snapshot's format (`gaps_shard::checkpoint::FORMAT_VERSION` of the writer).
    #[serde(default)]
    pub format: u32,
    /// The checkpoint's id.
    #[serde(default)]
    pub id: u64,
    /// The shard that wrote it.
    #[serde(default)]
    pub shard: u32,
    /// Shards in its cluster.
    #[serde(default)]
    pub num_shards: u32,
    /// Its cluster epoch.
    #[serde(default)]
    pub epoch: u64,
    /// The snapshot's size in bytes.
    pub bytes: u64,
    /// The snapshot's CRC-32.
    pub crc32: u32,
    /// Updates applied per tensor when it was taken.
    #[serde(default)]
    pub tensor_versions: Vec<u64>,
    /// The cluster step it was taken at (sync modes; 0 otherwise).
    #[serde(default)]
    pub step: u64,
    /// The step the coordinator named for it, if it named one.
    #[serde(default)]
    pub at_step: Option<u64>,
    /// A cluster checkpoint (the coordinator chose its id for every shard).
    #[serde(default)]
    pub cluster: bool,
    /// When it was written, milliseconds since the Unix epoch.
    #[serde(default)]
    pub written_unix_ms: u64,
}

impl Manifest {
    /// Reads and parses a manifest file.
    pub fn read(path: &Path) -> Result<Manifest> {
        let text = fs::read_to_string(path).with_context(|| format!("reading the manifest {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("the manifest {} is not a valid manifest", path.display()))
    }
}

/// Reads a snapshot and checks it against its manifest (size and CRC-32).
pub fn load_verified(bin: &Path, manifest: &Path) -> Result<Vec<u8>> {
    let m = Manifest::read(manifest)?;
    let (size, crc) = (m.bytes, m.crc32);
    let bytes = fs::read(bin).with_context(|| format!("reading the checkpoint {}", bin.display()))?;
    if bytes.len() as u64 != size {
        bail!("the checkpoint {} has {} bytes, its manifest says {size}", bin.display(), bytes.len());
    }
    if crc32fast::hash(&bytes) != crc {
        bail!("the checkpoint {} does not match its checksum: the file is corrupt", bin.display());
    }
    Ok(bytes)
}

/// Loads the checkpoint a user named: a `.bin` or `.json` file of a checkpoint (its sibling is found).
pub fn load_path(path: &Path) -> Result<Vec<u8>> {
    let (bin, manifest) = (path.with_extension("bin"), path.with_extension("json"));
    load_verified(&bin, &manifest)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A manifest reads back as its type; one from before a field existed reads with that field's default;
    /// one without its size or checksum, or not JSON, is refused with the file's name, and so is its
    /// checkpoint.
    #[test]
    fn manifests_read_back_typed_and_incomplete_ones_are_refused() {
        let dir = gaps_common::scratch_dir("gaps-ckpt-manifest").expect("dir");
        let (bin, json) = (dir.join("ckpt-7.bin"), dir.join("ckpt-7.json"));
        fs::write(&bin, b"snapshot").expect("bin");
        let crc = crc32fast::hash(b"snapshot");
        fs::write(&json, format!("{{\"bytes\":8,\"crc32\":{crc},\"id\":7,\"shard\":1}}")).expect("old manifest");
        let m = Manifest::read(&json).expect("an older manifest reads");
        assert_eq!((m.id, m.shard, m.cluster, m.at_step, m.format), (7, 1, false, None, 0));
        assert_eq!(load_verified(&bin, &json).expect("verified"), b"snapshot");
        for bad in ["{\"bytes\":8}", "{\"crc32\":1}", "not json", "{\"bytes\":\"8\",\"crc32\":1}"] {
            fs::write(&json, bad).expect("bad manifest");
            let e = format!("{:#}", load_verified(&bin, &json).expect_err(bad));
            assert!(e.contains("ckpt-7.json"), "{bad}: {e}");
        }
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failed_write_leaves_no_temporary_file() {
        let dir = gaps_common::scratch_dir("gaps-ckpt-tmp").expect("dir");
        // The destination is a non-empty directory, so the final rename fails after the data was written.
        let path = dir.join("ckpt-1.bin");
        fs::create_dir_all(path.join("in-the-way")).expect("obstacle");
        assert!(write_atomically(&path, &[7u8; 4096]).is_err());
        assert!(!path.with_extension("tmp").exists(), "the temporary file was removed");
        let ok = dir.join("ckpt-2.bin");
        write_atomically(&ok, b"state").expect("a write that can succeed");
        assert_eq!(fs::read(&ok).expect("read"), b"state");
        assert!(!ok.with_extension("tmp").exists());
        let _ = fs::remove_dir_all(&dir);
    }
}
