//! The native part of the `gaps` Python package (`gaps._gaps`): a blocking facade over the Rust client
//! (`gaps_worker::Client` — routing, retries with the same sequence number, exactly-once, waits for
//! synchronous steps, leases and heartbeats). Every call that touches the network releases the GIL and
//! runs on the client's own tokio runtime. Tensors cross as raw little-endian float32 bytes: `bytes` in
//! (what numpy's buffer hands over under the stable ABI), `bytearray` out (numpy wraps it without a copy);
//! the Python layer (`gaps/__init__.py`) gives them their shapes and checks dtypes.
//!
//! Errors are raised as `NativeError(kind, message)`; the Python layer turns `kind` into the matching
//! `gaps.GapsError` subclass.

use gaps_common::wire::{ErrorCode, Role};
use gaps_models::criteo::{DataSpec, TrainingStream};
use gaps_transport::net::RpcError;
use gaps_transport::tls::TlsMaterial;
use gaps_worker::client::{Client, ClientError, ClientOptions, Snapshot, SparseRows};
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList};
use std::collections::HashMap;

mod data;
mod logs;
use data::*;
use std::sync::Mutex;
use std::time::Duration;

pyo3::create_exception!(_gaps, NativeError, PyException, "An error of the gaps client: args are (kind, message).");

/// A Python dict of `key => value` pairs, each value converted as `PyDict::set_item` converts it (returns
/// early with the error where one fails).
macro_rules! dict {
    ($py:expr, $($key:literal => $value:expr),* $(,)?) => {{
        let d = PyDict::new($py);
        $(d.set_item($key, $value)?;)*
        d
    }};
}

/// A `NativeError` of `kind` (`shape`, `dtype`, `unknown`, `nonfinite`, `unavailable`, `unauthorized`,
/// `order`, `certificate`, `server`, `closed`, `config`).
fn err(kind: &str, message: impl Into<String>) -> PyErr {
    NativeError::new_err((kind.to_string(), message.into()))
}

fn client_err(e: ClientError) -> PyErr {
    let text = e.to_string();
    match &e {
        ClientError::Shape(_) => err("shape", text),
        ClientError::NonFinite(_) => err("nonfinite", text),
        ClientError::JoinTimeout { .. } => err("unavailable", text),
        ClientError::BadMap(_) => err("config", text),
        ClientError::Rpc(RpcError::Remote { code, .. }) => match code {
            ErrorCode::WrongShape => err("shape", text),
            ErrorCode::NonFinite => err("nonfinite", text),
            ErrorCode::Unauthorized => err("unauthorized", text),
            ErrorCode::Busy => err("unavailable", text),
            _ => err("server", text),
        },
        ClientError::Rpc(RpcError::Connection { .. } | RpcError::Timeout { .. }) => err("unavailable", text),
        ClientError::Rpc(RpcError::Identity { .. }) => err("certificate", text),
        ClientError::Rpc(RpcError::Setup(_)) => err("config", text),
        ClientError::Rpc(_) => err("server", text),
    }
}

/// How often a blocked call looks for a signal (Ctrl-C) and hands the client's log records to Python.
const SIGNAL_CHECK: Duration = Duration::from_millis(100);

/// Runs `fut` on `runtime` with the GIL released. Every [`SIGNAL_CHECK`] it takes the GIL back briefly to
/// run Python's signal handlers — so Ctrl-C raises `KeyboardInterrupt` within a fraction of a second even
/// while the client waits minutes for a shard (the call is abandoned: a push in flight was applied once or
/// not at all, and the next push carries the next sequence number) — and to pass the client's log records
/// to the `gaps` logger.
///
/// The pace comes from one process-wide thread ([`signal_ticks`]), not from a tokio timer per call: a
/// timer registered from this (non-runtime) thread wakes the runtime's time driver on every call and back,
/// which cost about 1.1 ms a call on a 2-core machine (a Stats request took 1.4 ms from Python, 0.27 ms
/// without it).
fn block<T: Send>(
    py: Python<'_>,
    runtime: &tokio::runtime::Runtime,
    fut: impl std::future::Future<Output = T> + Send,
) -> PyResult<T> {
    let ticks = signal_ticks();
    let out = py.allow_threads(|| {
        runtime.block_on(async {
            tokio::pin!(fut);
            loop {
                tokio::select! {
                    biased;
                    out = &mut fut => return Ok(out),
                    _ = ticks.notified() => Python::with_gil(|py| {
                        logs::forward(py);
                        py.check_signals()
                    })?,
                }
            }
        })
    });
    logs::forward(py);
    out
}

/// Notified every [`SIGNAL_CHECK`] by a thread started on first use in this process (it only sleeps and
/// notifies). A child made by `fork` has no such thread (threads do not survive a fork) and may have copied
/// the notifier mid-notification: it starts its own thread with a fresh notifier.
fn signal_ticks() -> &'static tokio::sync::Notify {
    static TICKS: std::sync::Mutex<Option<(u32, &'static tokio::sync::Notify)>> = std::sync::Mutex::new(None);
    let pid = std::process::id();
    let mut ticks = TICKS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((owner, notify)) = *ticks {
        if owner == pid {
            return notify;
        }
    }
    let notify: &'static tokio::sync::Notify = Box::leak(Box::new(tokio::sync::Notify::new()));
    let spawned = std::thread::Builder::new().name("gaps-signal-ticks".into()).spawn(move || loop {
        std::thread::sleep(SIGNAL_CHECK);
        notify.notify_waiters();
    });
    if let Err(e) = spawned {
        // No ticks: calls still finish, only Ctrl-C waits for them.
        eprintln!("gaps: no signal-check thread ({e}); Ctrl-C takes effect when a call returns");
    }
    *ticks = Some((pid, notify));
    notify
}

/// One float32 bytes object per dense tensor of `client`'s layout (layout order) as floats, each checked
/// against its tensor's size; `what` names them in errors ("the gradient" of w).
fn dense_values(client: &Client, what: &str, values: &[Bound<'_, PyBytes>]) -> PyResult<Vec<Vec<f32>>> {
    let layout = client.layout();
    if values.len() != layout.tensors.len() {
        return Err(err("shape", format!("expected {} tensors, got {}", layout.tensors.len(), values.len())));
    }
    values
        .iter()
        .zip(&layout.tensors)
        .map(|(v, spec)| floats(&format!("{what} of {}", spec.name), v.as_bytes(), spec.len as usize))
        .collect()
}

/// The floats in `bytes` (little-endian float32), checked against `expected` elements.
fn floats(what: &str, bytes: &[u8], expected: usize) -> PyResult<Vec<f32>> {
    if bytes.len() != expected * 4 {
        return Err(err("shape", format!("{what}: expected {expected} float32 values, got {} bytes", bytes.len())));
    }
    // One copy (a memcpy on little-endian hosts), whatever the bytes' alignment.
    let mut out = vec![0f32; expected];
    bytemuck::cast_slice_mut::<f32, u8>(&mut out).copy_from_slice(bytes);
    if cfg!(target_endian = "big") {
        out.iter_mut().for_each(|v| *v = f32::from_bits(u32::from_le(v.to_bits())));
    }
    Ok(out)
}

fn to_bytearray<'py>(py: Python<'py>, values: &[f32]) -> Bound<'py, PyByteArray> {
    PyByteArray::new(py, bytemuck::cast_slice(values))
}

/// Row pulls remembered per table for the pushes that refer to them (a prefetch may pull the next
/// batch's rows before the current batch's are pushed).
const REMEMBERED_PULLS: usize = 4;

fn poisoned<T>(_: T) -> PyErr {
    err("server", "a lock of the client was poisoned by an earlier panic")
}

/// One worker (or observer) connected to a gaps cluster. Safe to use from several Python threads (a
/// prefetching thread beside the training loop): every method takes `&self`.
#[pyclass(module = "gaps._gaps")]
struct NativeClient {
    runtime: tokio::runtime::Runtime,
    client: Mutex<Option<Client>>,
    heartbeats: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The last dense pull: the next push's gradients were computed on it.
    last: Mutex<Option<Snapshot>>,
    /// Recent row pulls per table, newest last: a push of rows refers to the pull of the same ids.
    rows: Mutex<HashMap<u32, Vec<SparseRows>>>,
    /// Row pulls kept under a token until a step's merged push takes them (`pull_rows_tagged`,
    /// `push_rows_merged`), at most [`TAGGED_PULLS`], the oldest forgotten first.
    tagged: Mutex<Tagged>,
    next_token: std::sync::atomic::AtomicU64,
}

/// Tagged row pulls by token, with the bytes they hold (kept as pulls come and go).
#[derive(Default)]
struct Tagged {
    pulls: std::collections::BTreeMap<u64, (u32, SparseRows)>,
    bytes: usize,
}

impl Tagged {
    fn size(rows: &SparseRows) -> usize {
        rows.values.len() * 4 + rows.ids.len() * 12
    }

    fn insert(&mut self, token: u64, table: u32, rows: SparseRows) {
        self.bytes += Self::size(&rows);
        self.pulls.insert(token, (table, rows));
        // Bounded in count and in bytes (lookups whose rows never get a gradient are forgotten oldest first).
        while self.pulls.len() > TAGGED_PULLS || (self.pulls.len() > 1 && self.bytes > TAGGED_BYTES) {
            if let Some((_, (_, old))) = self.pulls.pop_first() {
                self.bytes -= Self::size(&old);
            }
        }
    }

    fn remove(&mut self, token: u64) {
        if let Some((_, old)) = self.pulls.remove(&token) {
            self.bytes -= Self::size(&old);
        }
    }
}

/// Tagged row pulls a client keeps (a step of a model that looks a table up per field holds tens), and the
/// bytes they may hold.
const TAGGED_PULLS: usize = 4096;
const TAGGED_BYTES: usize = 512 << 20;

impl NativeClient {
    /// The gradients of a push (one per dense tensor, layout order, float32 bytes) checked against the
    /// layout, with the client and the snapshot they were computed on (the last pull).
    fn gradient(
        &self,
        grads: Vec<Bound<'_, PyBytes>>,
        compute_seconds: Option<f64>,
    ) -> PyResult<(Client, Vec<Vec<f32>>, Snapshot)> {
        let client = self.worker_client("push")?;
        let snapshot = self.last.lock().map_err(poisoned)?.clone();
        let snapshot = snapshot.ok_or_else(|| err("order", "push needs a pull first (pull_all or pull)"))?;
        let grads = dense_values(&client, "the gradient", &grads)?;
        if let Some(s) = compute_seconds {
            let d = Duration::try_from_secs_f64(s).map_err(|_| err("config", "compute_seconds must be ≥ 0"))?;
            client.report_compute_time(d);
        }
        Ok((client, grads, snapshot))
    }

    /// What `call` asks of the client, waited for with the GIL released (its error as a `NativeError`).
    fn ask<T: Send, F>(&self, py: Python<'_>, call: impl FnOnce(Client) -> F) -> PyResult<T>
    where
        F: std::future::Future<Output = Result<T, ClientError>> + Send,
    {
        let client = self.client()?;
        block(py, &self.runtime, call(client))?.map_err(client_err)
    }

    fn client(&self) -> PyResult<Client> {
        self.client.lock().map_err(poisoned)?.clone().ok_or_else(|| err("closed", "the client is closed"))
    }

    /// The client, which must be a worker's: an observer is refused before anything is sent.
    fn worker_client(&self, what: &str) -> PyResult<Client> {
        let client = self.client()?;
        if client.worker_id().is_none() {
            return Err(err(
                "unauthorized",
                format!("an observer client cannot {what} (it was connected with observer=True)"),
            ));
        }
        Ok(client)
    }

    fn table_index(&self, table: &str) -> PyResult<u32> {
        let client = self.client()?;
        client
            .layout()
            .tables
            .iter()
            .position(|t| t.name == table)
            .map(|i| i as u32)
            .ok_or_else(|| err("unknown", format!("the cluster serves no table {table:?}")))
    }

    fn ids(bytes: &[u8]) -> PyResult<Vec<u64>> {
        if bytes.len() % 8 != 0 {
            return Err(err("shape", "ids must be uint64 values"));
        }
        let mut out = vec![0u64; bytes.len() / 8];
        bytemuck::cast_slice_mut::<u64, u8>(&mut out).copy_from_slice(bytes);
        if cfg!(target_endian = "big") {
            out.iter_mut().for_each(|v| *v = u64::from_le(*v));
        }
        Ok(out)
    }
}

#[pymethods]
impl NativeClient {
    /// Registers with the coordinator and connects to every shard (waiting up to `connect_timeout`).
    #[new]
    #[pyo3(signature = (coordinator, ca, cert, key, name, observer, connect_timeout, rpc_timeout, shard_down_timeout, lanes=1))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        coordinator: String,
        ca: String,
        cert: String,
        key: String,
        name: String,
        observer: bool,
        connect_timeout: f64,
        rpc_timeout: f64,
        shard_down_timeout: f64,
        lanes: usize,
    ) -> PyResult<Self> {
        let seconds = |what: &str, s: f64| {
            Duration::try_from_secs_f64(s)
                .map_err(|_| err("config", format!("{what} must be a positive number of seconds")))
        };
        let tls =
            TlsMaterial::load(ca.as_ref(), cert.as_ref(), key.as_ref()).map_err(|e| err("config", e.to_string()))?;
        let role = if observer { Role::Observer } else { Role::Worker };
        let mut opts = ClientOptions::new(coordinator, tls, role, name);
        opts.connect_timeout = seconds("connect_timeout", connect_timeout)?;
        opts.rpc_timeout = seconds("rpc_timeout", rpc_timeout)?;
        opts.shard_down_timeout = seconds("shard_down_timeout", shard_down_timeout)?;
        if !(1..=64).contains(&lanes) {
            return Err(err("config", format!("lanes must be 1 to 64, not {lanes}")));
        }
        opts.lanes = lanes;
        // A thread a lane, at least one (a `gaps-worker` of one lane has none, but Python computes between
        // the calls for as long as it likes: the connections and heartbeats need a thread of their own);
        // the caller's thread waits beside it.
        let role = gaps_transport::runtime::IoRole::Worker { lanes };
        let threads = gaps_transport::runtime::io_threads(0, role).max(1);
        let runtime = gaps_transport::runtime::build(threads)
            .map_err(|e| err("config", format!("starting the client's runtime: {e}")))?;
        let client = block(py, &runtime, Client::connect(opts))?.map_err(client_err)?;
        let heartbeats = client.worker_id().map(|_| {
            let lease = Duration::from_millis(u64::from(client.map().lease_ms));
            let _guard = runtime.enter();
            client.spawn_heartbeats((lease / 3).max(Duration::from_millis(100)))
        });
        Ok(NativeClient {
            runtime,
            client: Mutex::new(Some(client)),
            heartbeats: Mutex::new(heartbeats),
            last: Mutex::new(None),
            rows: Mutex::new(HashMap::new()),
            tagged: Mutex::new(Tagged::default()),
            next_token: std::sync::atomic::AtomicU64::new(1),
        })
    }

    /// The worker id (None for an observer).
    fn worker_id(&self) -> PyResult<Option<u32>> {
        Ok(self.client()?.worker_id())
    }

    /// The cluster's layout: `{"tensors": [{"name", "shape"}], "tables": [{"name", "dim"}], "epoch", "shards"}`.
    fn layout<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let client = self.client()?;
        let layout = client.layout();
        let tensors = PyList::empty(py);
        for t in &layout.tensors {
            tensors.append(dict!(py, "name" => &t.name, "shape" => t.shape.clone()))?;
        }
        let tables = PyList::empty(py);
        for t in &layout.tables {
            tables.append(dict!(py, "name" => &t.name, "dim" => t.dim))?;
        }
        let map = client.map();
        Ok(dict!(py, "tensors" => tensors, "tables" => tables, "epoch" => map.epoch, "shards" => map.num_shards))
    }

    /// Pulls every dense tensor (layout order) as float32 bytes; remembered for the next push.
    fn pull_all<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyByteArray>>> {
        let client = self.client()?;
        let snapshot = block(py, &self.runtime, client.pull())?.map_err(client_err)?;
        let out = snapshot.tensors.iter().map(|t| to_bytearray(py, t)).collect();
        *self.last.lock().map_err(poisoned)? = Some(snapshot);
        Ok(out)
    }

    /// Pushes one gradient per dense tensor (layout order, float32 bytes) computed on the last pull.
    #[pyo3(signature = (grads, compute_seconds=None))]
    fn push(&self, py: Python<'_>, grads: Vec<Bound<'_, PyBytes>>, compute_seconds: Option<f64>) -> PyResult<()> {
        let (client, grads, snapshot) = self.gradient(grads, compute_seconds)?;
        block(py, &self.runtime, client.push(grads, &snapshot))?.map_err(client_err)?;
        Ok(())
    }

    /// `push` then `pull_all`, in one request per shard (each answers the push with the new values):
    /// every dense tensor as float32 bytes, remembered for the next push.
    #[pyo3(signature = (grads, compute_seconds=None))]
    fn push_pull<'py>(
        &self,
        py: Python<'py>,
        grads: Vec<Bound<'_, PyBytes>>,
        compute_seconds: Option<f64>,
    ) -> PyResult<Vec<Bound<'py, PyByteArray>>> {
        let (client, grads, snapshot) = self.gradient(grads, compute_seconds)?;
        let (_, next) = block(py, &self.runtime, client.push_pull(grads, &snapshot))?.map_err(client_err)?;
        let out = next.tensors.iter().map(|t| to_bytearray(py, t)).collect();
        *self.last.lock().map_err(poisoned)? = Some(next);
        Ok(out)
    }

    /// Rows of `table` for `ids` (uint64 bytes): `len(ids) × dim` float32 bytes; created on first use
    /// unless `create` is false. Remembered for the next `push_rows` of the table.
    #[pyo3(signature = (table, ids, create=true))]
    fn pull_rows<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        ids: &[u8],
        create: bool,
    ) -> PyResult<Bound<'py, PyByteArray>> {
        let t = self.table_index(table)?;
        let ids = Self::ids(ids)?;
        let client = self.client()?;
        let rows = block(py, &self.runtime, client.pull_sparse(t, &ids, create))?.map_err(client_err)?;
        let out = to_bytearray(py, &rows.values);
        let mut remembered = self.rows.lock().map_err(poisoned)?;
        let pulls = remembered.entry(t).or_default();
        pulls.retain(|r| r.ids != rows.ids);
        pulls.push(rows);
        if pulls.len() > REMEMBERED_PULLS {
            pulls.remove(0);
        }
        Ok(out)
    }

    /// `pull_rows`, kept under a token (returned with the rows) for a later `push_rows_merged` instead of
    /// being remembered by its ids; with `remember` false nothing is kept (evaluation) and the token is None.
    #[pyo3(signature = (table, ids, create=true, remember=true))]
    fn pull_rows_tagged<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        ids: &[u8],
        create: bool,
        remember: bool,
    ) -> PyResult<(Bound<'py, PyByteArray>, Option<u64>)> {
        let t = self.table_index(table)?;
        let ids = Self::ids(ids)?;
        let client = self.client()?;
        let rows = block(py, &self.runtime, client.pull_sparse(t, &ids, create))?.map_err(client_err)?;
        let out = to_bytearray(py, &rows.values);
        if !remember {
            return Ok((out, None));
        }
        let token = self.next_token.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.tagged.lock().map_err(poisoned)?.insert(token, t, rows);
        Ok((out, Some(token)))
    }

    /// Forgets tagged pulls that will not be pushed.
    fn forget_rows(&self, tokens: Vec<u64>) -> PyResult<()> {
        let mut tagged = self.tagged.lock().map_err(poisoned)?;
        for t in tokens {
            tagged.remove(t);
        }
        Ok(())
    }

    /// One push of a step's row gradients of `table`: `ids` (distinct uint64) with `len(ids) × dim` float32
    /// gradients, each row read in one of the tagged pulls `tokens` (the first that holds it gives the
    /// version the gradient was computed on). The pulls stay tagged until `forget_rows`.
    fn push_rows_merged(
        &self,
        py: Python<'_>,
        table: &str,
        tokens: Vec<u64>,
        ids: &[u8],
        grads: &[u8],
    ) -> PyResult<()> {
        let t = self.table_index(table)?;
        let ids = Self::ids(ids)?;
        let client = self.worker_client("push rows")?;
        let dim = client.layout().tables.get(t as usize).map_or(0, |spec| spec.dim as usize);
        let grads = floats(&format!("the row gradients of {table}"), grads, ids.len() * dim)?;
        // The pulls stay tagged (a second backward over the same forward pushes again; the next step forgets
        // them): the rows are gathered from them under the lock, nothing else is copied.
        let mut rows = SparseRows { ids: Vec::with_capacity(ids.len()), values: Vec::new(), versions: Vec::new(), dim };
        {
            let tagged = self.tagged.lock().map_err(poisoned)?;
            let pulls: Vec<&SparseRows> = tokens
                .iter()
                .filter_map(|k| tagged.pulls.get(k))
                .filter(|(table, _)| *table == t)
                .map(|(_, r)| r)
                .collect();
            let mut at: HashMap<u64, (usize, usize)> = HashMap::new();
            for (p, pull) in pulls.iter().enumerate() {
                for (k, id) in pull.ids.iter().enumerate() {
                    at.entry(*id).or_insert((p, k));
                }
            }
            rows.values.reserve(ids.len() * dim);
            for id in &ids {
                let Some(&(p, k)) = at.get(id) else {
                    return Err(err(
                        "order",
                        format!(
                            "push of {table:?}: row {id} was not read in this step's pulls (or they were forgotten)"
                        ),
                    ));
                };
                rows.ids.push(*id);
                rows.versions.push(pulls[p].versions[k]);
                rows.values.extend_from_slice(&pulls[p].values[k * dim..(k + 1) * dim]);
            }
        }
        if rows.ids.is_empty() {
            return Ok(());
        }
        block(py, &self.runtime, client.push_sparse(t, &rows, &grads))?.map_err(client_err)?;
        Ok(())
    }

    /// Pushes gradients (`len(ids) × dim` float32 bytes) for the rows of `table` last pulled with `ids`.
    fn push_rows(&self, py: Python<'_>, table: &str, ids: &[u8], grads: &[u8]) -> PyResult<()> {
        let t = self.table_index(table)?;
        let ids = Self::ids(ids)?;
        let client = self.worker_client("push rows")?;
        let (rows, grads) = {
            let mut remembered = self.rows.lock().map_err(poisoned)?;
            let pulls = remembered.entry(t).or_default();
            let Some(at) = pulls.iter().rposition(|r| r.ids == ids) else {
                return Err(err(
                    "order",
                    format!(
                        "push_rows({table:?}) needs ids pulled with pull_rows (one of the last {REMEMBERED_PULLS})"
                    ),
                ));
            };
            // Checked and converted before the pull is taken out, so a refused call leaves it usable.
            let grads = floats(&format!("the row gradients of {table}"), grads, pulls[at].values.len())?;
            (pulls.remove(at), grads)
        };
        // Once sent, the pull is used up whatever the outcome: a push interrupted (Ctrl-C) or given up after
        // retries may have been applied, and a retry under a new sequence number could apply it twice. A
        // caller that wants to try again pulls again (the checks above refuse bad input before this point,
        // leaving the pull usable).
        block(py, &self.runtime, client.push_sparse(t, &rows, &grads))?.map_err(client_err)?;
        Ok(())
    }

    /// Per-shard counters: a list of dicts.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.ask(py, |c| async move { c.stats().await })?
            .into_iter()
            .map(|s| {
                let by_worker = PyDict::new(py);
                for w in &s.applied_by_worker {
                    by_worker.set_item(w.worker, w.applied)?;
                }
                Ok(dict!(py, "shard" => s.shard, "pushes_applied" => s.pushes_applied,
                    "pushes_duplicate" => s.pushes_duplicate, "pushes_applied_twice" => s.pushes_applied_twice,
                    "applied_by_worker" => by_worker, "pushes_rejected" => s.pushes_rejected, "pulls" => s.pulls,
                    "table_rows" => s.table_rows, "live_workers" => s.live_workers))
            })
            .collect()
    }

    /// Asks the coordinator's dealer for this worker's next split of the training data, reporting `finished`
    /// (the grant of a split whose every batch was pushed and acknowledged). A dict (`grant`, `key`, `epoch`,
    /// `index`, `file`, `first_line`, `start`, `end`, `lines`, `files`, `finished_accepted`), or None when
    /// every pass is dealt. In async it waits while others still hold splits that could come back.
    #[pyo3(signature = (finished=None))]
    fn next_split<'py>(&self, py: Python<'py>, finished: Option<u64>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let client = self.client()?;
        let grant = block(py, &self.runtime, client.next_split_waiting(finished))?.map_err(client_err)?;
        let Some(s) = grant.split else { return Ok(None) };
        Ok(Some(dict!(py, "grant" => s.grant, "key" => s.key, "epoch" => s.key >> 32, "index" => s.key & 0xffff_ffff,
            "file" => s.file, "first_line" => s.first_line, "start" => s.start, "end" => s.end, "lines" => s.lines,
            "files" => grant.files, "finished_accepted" => grant.finished_accepted)))
    }

    /// Tags the next dense pushes with the split their samples came from (`grant` None: untagged).
    #[pyo3(signature = (grant=None, key=0, samples=0))]
    fn set_data_tag(&self, grant: Option<u64>, key: u64, samples: u32) -> PyResult<()> {
        let tag = grant.map(|grant| gaps_common::wire::DataTag { grant, split: key, samples });
        self.client()?.set_data_tag(tag);
        Ok(())
    }

    /// Every shard's samples per grant and the coordinator's dealer: a list of dicts (`shard`, `counts`: a
    /// list of (grant, key, samples), `dealer`: a dict or None).
    fn data_status<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.ask(py, |c| async move { c.data_status().await })?
            .into_iter()
            .map(|s| {
                let counts: Vec<(u64, u64, u64)> = s.counts.iter().map(|c| (c.grant, c.split, c.samples)).collect();
                let dealer = match s.dealer {
                    Some(dealer) => Some(dict!(py, "data_epoch" => dealer.data_epoch,
                        "splits_per_epoch" => dealer.splits_per_epoch, "splits_done" => dealer.splits_done,
                        "splits_returned" => dealer.splits_returned, "splits_pending" => dealer.splits_pending,
                        "samples_replayed" => dealer.samples_replayed, "finished" => dealer.finished,
                        "completed" => dealer.completed, "abandoned" => dealer.abandoned)),
                    None => None,
                };
                Ok(dict!(py, "shard" => s.shard, "counts" => counts, "dealer" => dealer))
            })
            .collect()
    }

    /// Test hook: the next `n` requests are sent and then their connection is cut before the reply, so the
    /// client must retry them (with the same sequence numbers).
    fn inject_connection_drops(&self, n: u32) -> PyResult<()> {
        self.client()?.inject_connection_drops(n);
        Ok(())
    }

    /// The same round trips as a Python loop of `pull_all` + `push` (zero gradients), `iterations` times,
    /// in Rust without returning to Python: the baseline of the binding's bench. Returns seconds.
    fn bench_dense(&self, py: Python<'_>, iterations: u32) -> PyResult<f64> {
        let client = self.client()?;
        block(py, &self.runtime, async {
            let started = std::time::Instant::now();
            for _ in 0..iterations {
                let snapshot = client.pull().await?;
                let grads = snapshot.tensors.iter().map(|t| vec![0.0; t.len()]).collect();
                client.push(grads, &snapshot).await?;
            }
            Ok(started.elapsed().as_secs_f64())
        })?
        .map_err(client_err)
    }

    /// `pull_rows` + `push_rows` of `ids` (uint64 bytes) on `table`, `iterations` times, in Rust. Seconds.
    fn bench_rows(&self, py: Python<'_>, table: &str, ids: &[u8], iterations: u32) -> PyResult<f64> {
        let t = self.table_index(table)?;
        let ids = Self::ids(ids)?;
        let client = self.client()?;
        block(py, &self.runtime, async {
            let started = std::time::Instant::now();
            for _ in 0..iterations {
                let rows = client.pull_sparse(t, &ids, true).await?;
                let grads = vec![0.0; rows.values.len()];
                client.push_sparse(t, &rows, &grads).await?;
            }
            Ok(started.elapsed().as_secs_f64())
        })?
        .map_err(client_err)
    }

    /// Shard pushes acknowledged so far.
    fn pushes_acknowledged(&self) -> PyResult<u64> {
        Ok(self.client()?.pushes_acknowledged())
    }

    /// Uploads initial values (one float32 bytes per dense tensor, layout order) for the chunks nothing has
    /// touched yet (the first writer wins): (chunks taken, chunks kept).
    fn initialize(&self, py: Python<'_>, values: Vec<Bound<'_, PyBytes>>) -> PyResult<(u32, u32)> {
        let client = self.worker_client("upload initial values")?;
        let values = dense_values(&client, "the initial values", &values)?;
        block(py, &self.runtime, client.initialize(&values))?.map_err(client_err)
    }

    /// True while the cluster trains synchronously (sync, gba) or has not said yet.
    fn synchronous(&self) -> PyResult<bool> {
        Ok(self.client()?.synchronous())
    }

    /// Shards in the cluster.
    fn num_shards(&self) -> PyResult<usize> {
        Ok(self.client()?.map().shards.len())
    }

    /// One page of `table`'s rows on shard `shard` from `cursor`: (ids as uint64 bytes, values as float32
    /// bytes, the next cursor or None).
    #[allow(clippy::type_complexity)]
    fn table_page<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        shard: usize,
        cursor: u64,
        max_rows: u32,
    ) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>, Option<u64>)> {
        let t = self.table_index(table)?;
        let client = self.client()?;
        let (ids, values, next) =
            block(py, &self.runtime, client.table_page(shard, t, cursor, max_rows))?.map_err(client_err)?;
        Ok((PyByteArray::new(py, bytemuck::cast_slice(&ids)), to_bytearray(py, &values), next))
    }

    /// Loads rows (`ids` uint64 bytes, `values` float32 bytes, `len(ids) × dim`) into `table`: a row a
    /// shard holds already keeps its values. (rows created, rows kept).
    fn load_rows(&self, py: Python<'_>, table: &str, ids: &[u8], values: &[u8]) -> PyResult<(u32, u32)> {
        let t = self.table_index(table)?;
        let ids = Self::ids(ids)?;
        let client = self.worker_client("load rows")?;
        let dim = client.layout().tables.get(t as usize).map_or(0, |spec| spec.dim as usize);
        let values = floats(&format!("the rows of {table}"), values, ids.len() * dim)?;
        block(py, &self.runtime, client.load_rows(t, &ids, &values))?.map_err(client_err)
    }

    /// A cluster checkpoint now (the coordinator's certificate only): `{"id", "shards": [{"shard", "path",
    /// "step"}]}`.
    fn checkpoint<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let client = self.client()?;
        let done = block(py, &self.runtime, client.checkpoint())?.map_err(client_err)?;
        let shards = PyList::empty(py);
        for s in &done.shards {
            shards.append(dict!(py, "shard" => s.shard, "path" => &s.path, "step" => s.step))?;
        }
        Ok(dict!(py, "id" => done.id, "shards" => shards))
    }

    /// Leaves the job (a worker) and closes the connections. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        if let Some(h) = self.heartbeats.lock().map_err(poisoned)?.take() {
            h.abort();
        }
        let client = self.client.lock().map_err(poisoned)?.take();
        if let Some(client) = client {
            let left = block(py, &self.runtime, async {
                let left = client.leave().await;
                client.close().await;
                left
            })?;
            left.map_err(client_err)?;
        }
        Ok(())
    }
}

/// The `gaps._gaps` module.
#[pymodule]
fn _gaps(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeClient>()?;
    m.add_class::<CriteoStream>()?;
    m.add_class::<SplitReader>()?;
    m.add_function(wrap_pyfunction!(held_out, m)?)?;
    m.add_function(wrap_pyfunction!(auc, m)?)?;
    m.add("NativeError", m.py().get_type::<NativeError>())?;
    logs::install();
    Ok(())
}
