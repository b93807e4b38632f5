//! Prometheus metrics of a shard: handles registered once at start-up, served as text on `/metrics` by a
//! small hyper HTTP/1.1 service, beside the health endpoints a cluster manager probes: `/healthz` (the
//! process is alive and, once serving, its core answers within [`HEALTH_TIMEOUT`]) and `/readyz` (it has
//! restored, joined the coordinator and serves).

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics::{Counter, Gauge, Histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use tracing::{debug, warn};

/// How long `/healthz` waits for the core to answer.
pub const HEALTH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Asks the core to answer; resolves to true when it did.
pub type CoreProbe = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = bool> + Send>> + Send + Sync>;

enum HealthState {
    Starting(String),
    Serving(CoreProbe),
    Stopping,
}

/// What `/healthz` and `/readyz` report; the service fills it in as it starts and stops.
pub struct Health {
    state: Mutex<HealthState>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health").finish_non_exhaustive()
    }
}

impl Default for Health {
    fn default() -> Self {
        Health { state: Mutex::new(HealthState::Starting("starting".into())) }
    }
}

impl Health {
    /// Still starting: `what` it is doing (restoring, joining the coordinator…).
    pub fn starting(&self, what: impl Into<String>) {
        if let Ok(mut s) = self.state.lock() {
            *s = HealthState::Starting(what.into());
        }
    }

    /// Serving; `probe` asks the core to answer.
    pub fn serving(&self, probe: CoreProbe) {
        if let Ok(mut s) = self.state.lock() {
            *s = HealthState::Serving(probe);
        }
    }

    /// Shutting down.
    pub fn stopping(&self) {
        if let Ok(mut s) = self.state.lock() {
            *s = HealthState::Stopping;
        }
    }

    /// `(alive, why)` for `/healthz`.
    async fn alive(&self) -> (bool, String) {
        let probe = match self.state.lock().as_deref() {
            Ok(HealthState::Starting(what)) => return (true, format!("alive, {what}\n")),
            Ok(HealthState::Stopping) => return (false, "stopping\n".into()),
            Ok(HealthState::Serving(probe)) => probe.clone(),
            Err(_) => return (false, "health state poisoned\n".into()),
        };
        match tokio::time::timeout(HEALTH_TIMEOUT, probe()).await {
            Ok(true) => (true, "ok\n".into()),
            Ok(false) => (false, "the shard's core thread stopped\n".into()),
            Err(_) => (false, format!("the shard's core did not answer within {HEALTH_TIMEOUT:?}\n")),
        }
    }

    /// `(ready, why)` for `/readyz`.
    fn ready(&self) -> (bool, String) {
        match self.state.lock().as_deref() {
            Ok(HealthState::Serving(_)) => (true, "ready\n".into()),
            Ok(HealthState::Starting(what)) => (false, format!("not ready: {what}\n")),
            Ok(HealthState::Stopping) => (false, "not ready: stopping\n".into()),
            Err(_) => (false, "health state poisoned\n".into()),
        }
    }
}

/// Upper bounds of the RPC latency histogram, seconds.
pub const RPC_SECONDS_BUCKETS: [f64; 14] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0];
/// Upper bounds of the staleness histogram, in updates.
pub const STALENESS_BUCKETS: [f64; 13] =
    [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0];

/// The shard's metric handles.
#[derive(Debug, Clone)]
pub struct ShardMetrics {
    /// Pushes applied.
    pub pushes: Counter,
    /// Retried pushes acknowledged without applying.
    pub push_duplicates: Counter,
    /// Pushes refused with an error.
    pub push_rejected: Counter,
    /// Pulls served.
    pub pulls: Counter,
    /// Frame bytes received (header and payload).
    pub bytes_in: Counter,
    /// Frame bytes sent.
    pub bytes_out: Counter,
    /// Latency of push RPCs, seconds (from the first byte read to the reply written).
    pub rpc_push_seconds: Histogram,
    /// Latency of pull RPCs, seconds.
    pub rpc_pull_seconds: Histogram,
    /// Latency of every other RPC, seconds.
    pub rpc_other_seconds: Histogram,
    /// Staleness τ of each applied push (largest over its chunks).
    pub staleness: Histogram,
    /// Workers holding a lease on this shard.
    pub live_workers: Gauge,
    /// Embedding rows held, and their bytes.
    pub table_rows: Gauge,
    pub table_bytes: Gauge,
    /// The mode in force (0 async, 1 sync, 2 gba, 3 ssp).
    pub mode: Gauge,
    /// Mode switches.
    pub mode_switches: Counter,
    /// Synchronous steps applied.
    pub steps_sync: Counter,
    /// GBA steps applied.
    pub steps_gba: Counter,
    /// Gradients dropped as too stale.
    pub dropped_stale: Counter,
    /// The learning-rate multiplier of the last update.
    pub lr_multiplier: Gauge,
    /// Requests cut off because their header or payload did not arrive within the request timeout, no
    /// byte came for the stall timeout, or the peer did not take its reply.
    pub requests_timed_out: Counter,
    /// Requests refused as busy: no room in the in-flight budget within the budget wait.
    pub requests_busy: Counter,
    /// Connections refused because the shard already served its maximum (or the peer address its share).
    pub connections_refused: Counter,
    /// Requests and connections refused because the certificate or credential does not allow them.
    pub unauthorized: Counter,
}

impl ShardMetrics {
    /// Copies the core's counters of modes and membership into the exported metrics.
    pub fn observe(&self, stats: &gaps_common::wire::Stats) {
        self.live_workers.set(f64::from(stats.live_workers));
        self.table_rows.set(stats.table_rows as f64);
        self.table_bytes.set(stats.table_bytes as f64);
        self.mode.set(f64::from(stats.mode));
        self.mode_switches.absolute(stats.mode_switches);
        self.steps_sync.absolute(stats.steps_sync);
        self.steps_gba.absolute(stats.steps_gba);
        self.dropped_stale.absolute(stats.dropped_stale);
        self.lr_multiplier.set(f64::from(stats.lr_multiplier_milli) / 1000.0);
    }
}

impl ShardMetrics {
    /// Registers the handles with the installed recorder (no-ops when none is installed).
    pub fn register(shard: u32) -> Self {
        let shard = shard.to_string();
        let rpc =
            |kind: &'static str| metrics::histogram!("gaps_rpc_seconds", "shard" => shard.clone(), "kind" => kind);
        ShardMetrics {
            pushes: metrics::counter!("gaps_pushes_applied_total", "shard" => shard.clone()),
            push_duplicates: metrics::counter!("gaps_push_duplicates_total", "shard" => shard.clone()),
            push_rejected: metrics::counter!("gaps_push_rejected_total", "shard" => shard.clone()),
            pulls: metrics::counter!("gaps_pulls_total", "shard" => shard.clone()),
            bytes_in: metrics::counter!("gaps_bytes_in_total", "shard" => shard.clone()),
            bytes_out: metrics::counter!("gaps_bytes_out_total", "shard" => shard.clone()),
            rpc_push_seconds: rpc("push"),
            rpc_pull_seconds: rpc("pull"),
            rpc_other_seconds: rpc("other"),
            staleness: metrics::histogram!("gaps_staleness_updates", "shard" => shard.clone()),
            live_workers: metrics::gauge!("gaps_live_workers", "shard" => shard.clone()),
            table_rows: metrics::gauge!("gaps_table_rows", "shard" => shard.clone()),
            table_bytes: metrics::gauge!("gaps_table_bytes", "shard" => shard.clone()),
            mode: metrics::gauge!("gaps_mode", "shard" => shard.clone()),
            mode_switches: metrics::counter!("gaps_mode_switches_total", "shard" => shard.clone()),
            steps_sync: metrics::counter!("gaps_steps_sync_total", "shard" => shard.clone()),
            steps_gba: metrics::counter!("gaps_steps_gba_total", "shard" => shard.clone()),
            dropped_stale: metrics::counter!("gaps_dropped_stale_total", "shard" => shard.clone()),
            lr_multiplier: metrics::gauge!("gaps_lr_multiplier", "shard" => shard.clone()),
            requests_timed_out: metrics::counter!("gaps_requests_timed_out_total", "shard" => shard.clone()),
            requests_busy: metrics::counter!("gaps_requests_busy_total", "shard" => shard.clone()),
            connections_refused: metrics::counter!("gaps_connections_refused_total", "shard" => shard.clone()),
            unauthorized: metrics::counter!("gaps_unauthorized_total", "shard" => shard),
        }
    }
}

/// What kind of metric a name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// Goes up and down.
    Gauge,
    /// A distribution in buckets.
    Histogram,
}

/// Every metric a shard exports, with its kind and its help text (the `# HELP` line of `/metrics`).
#[rustfmt::skip]
pub const DESCRIBED: &[(Kind, &str, &str)] = &[
    (Kind::Counter, "gaps_pushes_applied_total", "Gradient pushes applied (each (worker, seq) once)."),
    (Kind::Counter, "gaps_push_duplicates_total", "Retried pushes acknowledged without applying them again."),
    (Kind::Counter, "gaps_push_rejected_total", "Pushes refused with a typed error (nothing applied)."),
    (Kind::Counter, "gaps_pulls_total", "Parameter pulls served."),
    (Kind::Gauge, "gaps_replica_lag_entries", "Log entries the slowest backup of this shard has not applied yet (--replicas)."),
    (Kind::Gauge, "gaps_replica_log_bytes", "Bytes of log entries kept for this shard's backups."),
    (Kind::Gauge, "gaps_replica_live_backups", "Backups of this shard that replies wait for."),
    (Kind::Counter, "gaps_replica_dropped_total", "Backups dropped from the live set (failed, late, or too far behind); each copies a new snapshot."),
    (Kind::Counter, "gaps_replica_snapshots_total", "Snapshots of this shard taken for its backups (the first copy, and one after each drop)."),
    (Kind::Gauge, "gaps_replica_copy_bytes_left", "Bytes of the snapshots being sent to this shard's backups not sent yet (re-replication progress)."),
    (Kind::Counter, "gaps_requests_timed_out_total", "Requests cut off: not whole within the request timeout, stalled, or their reply not taken."),
    (Kind::Counter, "gaps_requests_busy_total", "Requests refused as busy (sent again by the client): no room in the in-flight budget in time."),
    (Kind::Counter, "gaps_connections_refused_total", "Connections refused because the shard already served its maximum."),
    (Kind::Counter, "gaps_unauthorized_total", "Requests and connections refused because the peer's certificate or credential does not allow them."),
    (Kind::Counter, "gaps_bytes_in_total", "Frame bytes received."),
    (Kind::Counter, "gaps_bytes_out_total", "Frame bytes sent."),
    (Kind::Histogram, "gaps_rpc_seconds", "RPC service time in seconds, by kind."),
    (Kind::Histogram, "gaps_staleness_updates", "Staleness of applied pushes, in updates since the read."),
    (Kind::Gauge, "gaps_live_workers", "Workers holding a lease."),
    (Kind::Gauge, "gaps_table_rows", "Embedding rows held by the shard's tables."),
    (Kind::Gauge, "gaps_table_bytes", "Bytes held by the shard's tables (rows, state, index)."),
    (Kind::Gauge, "gaps_mode", "Training mode in force: 0 async, 1 sync, 2 gba, 3 ssp."),
    (Kind::Counter, "gaps_mode_switches_total", "Automatic switches between sync and gba (each logged with its reason)."),
    (Kind::Counter, "gaps_steps_sync_total", "Synchronous global-batch steps applied."),
    (Kind::Counter, "gaps_steps_gba_total", "GBA steps applied."),
    (Kind::Counter, "gaps_dropped_stale_total", "Gradients dropped as too stale (sync: an earlier step; gba: beyond the threshold)."),
    (Kind::Gauge, "gaps_lr_multiplier", "Learning-rate multiplier of the last update (linear scaling by live workers, ramped)."),
];

/// Installs the global Prometheus recorder with explicit buckets. Call once per process, before
/// [`ShardMetrics::register`].
pub fn install_recorder() -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full("gaps_rpc_seconds".into()), &RPC_SECONDS_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full("gaps_staleness_updates".into()), &STALENESS_BUCKETS)?
        .install_recorder()?;
    for &(kind, name, help) in DESCRIBED {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, help),
            Kind::Gauge => metrics::describe_gauge!(name, help),
            Kind::Histogram => metrics::describe_histogram!(name, help),
        }
    }
    Ok(handle)
}

/// Serves `GET /metrics`, `/healthz` and `/readyz` on `addr` over HTTP/1.1 (hyper) until the task is
/// aborted. Returns the bound address. A failed accept (for example, out of file descriptors) is logged
/// and retried after a pause instead of spinning.
pub async fn serve(
    addr: SocketAddr,
    handle: PrometheusHandle,
    health: Arc<Health>,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    warn!(error = %e, "accepting a metrics connection");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let handle = handle.clone();
            let health = health.clone();
            let service = service_fn(move |request: Request<Incoming>| {
                let (handle, health) = (handle.clone(), health.clone());
                async move { Ok::<_, std::convert::Infallible>(respond(&request, &handle, &health).await) }
            });
            tokio::spawn(async move {
                let connection = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(std::time::Duration::from_secs(5))
                    .serve_connection(TokioIo::new(stream), service);
                if let Err(e) = connection.await {
                    debug!(%peer, error = %e, "metrics connection ended");
                }
            });
        }
    });
    Ok((bound, task))
}

/// The reply to one request: the metrics for `GET /metrics`, 200 or 503 with the reason for `GET /healthz`
/// and `GET /readyz`, 404 for other paths, 405 for other methods.
async fn respond(request: &Request<Incoming>, handle: &PrometheusHandle, health: &Health) -> Response<Full<Bytes>> {
    let status = |ok: bool| if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let (status, body) = match (request.method(), request.uri().path()) {
        (&Method::GET, "/metrics") => (StatusCode::OK, handle.render()),
        (&Method::GET, "/healthz") => {
            let (ok, why) = health.alive().await;
            (status(ok), why)
        }
        (&Method::GET, "/readyz") => {
            let (ok, why) = health.ready();
            (status(ok), why)
        }
        (_, "/metrics" | "/healthz" | "/readyz") => {
            (StatusCode::METHOD_NOT_ALLOWED, "only GET is served here\n".to_string())
        }
        _ => (StatusCode::NOT_FOUND, "only GET /metrics, /healthz and /readyz are served here\n".to_string()),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
    response
}

#[cfg(test)]
mod tests {
    /// docs/reference/metrics.md lists every metric the server describes, with its kind and help text.
    #[test]
    fn the_reference_lists_every_metric_as_the_server_describes_it() {
        let reference = include_str!("../../docs/reference/metrics.md");
        let rows: Vec<&str> = reference.lines().filter(|l| l.starts_with("| `gaps_")).collect();
        let expected: Vec<String> = super::DESCRIBED
            .iter()
            .map(|(kind, name, help)| format!("| `{name}` | {} | {} |", format!("{kind:?}").to_lowercase(), help))
            .collect();
        assert_eq!(rows, expected, "regenerate the table in docs/reference/metrics.md");
    }
}
