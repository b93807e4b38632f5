//! Joining a cluster: registering with the coordinator (following it where a majority moved it), reading
//! the rules and routes from the map it answers with, connecting to every shard, and a client's companion
//! (the same worker over connections of its own).

use super::*;

/// Registers with the coordinator at `coordinator`, or where the process there says it is now, waiting for it
/// to come up and for every shard to join until `deadline`; returns the cluster map it answered with.
pub(super) async fn register(
    opts: &ClientOptions,
    endpoint: &quinn::Endpoint,
    cluster: &str,
    coordinator: SocketAddr,
    started: Instant,
    deadline: Instant,
) -> Result<ClusterMap, ClientError> {
    let register = Message::Register(Register { protocol: PROTOCOL_VERSION, role: opts.role, name: opts.name.clone() });
    let (mut tries, mut redirects) = (0u32, 0u32);
    // Where the registration goes: the address given, or where the process there says the coordinator is
    // now (a majority moved it: the process given answers `Moved`, or that it is not the coordinator).
    let mut coordinator = coordinator;
    loop {
        // `connect_timeout` bounds the whole wait: every attempt gets at most the time that is left, and at
        // most a quarter of it (but 2 s at least), so that a handshake lost on a loaded machine is tried
        // again rather than waited for until the end.
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let per_call = opts.rpc_timeout.min(left).min((left / 4).max(Duration::from_secs(2)));
        let attempt = async {
            let conn = net::connect(endpoint, coordinator, per_call).await?;
            // Any shard process's certificate: the coordinator moves where a majority chooses who serves
            // shard 0; the map must then name the process that answered as serving it.
            let process = net::expect_any_shard(&conn, cluster)?;
            let reply = net::call(&conn, &register, &[], &opts.limits, per_call).await;
            conn.close(0u32.into(), b"registered");
            match reply {
                Ok(Frame { msg: Message::ClusterMap(map), .. })
                    if map.shards.first().is_none_or(|s| s.process != process) =>
                {
                    Err(RpcError::Identity {
                        addr: coordinator.to_string(),
                        message: format!("shard process {process} answered, but its map says another serves shard 0"),
                    })
                }
                other => other,
            }
        };
        let attempt = async {
            match tokio::time::timeout(left, attempt).await {
                Ok(result) => result,
                Err(_) => Err(RpcError::Timeout { addr: coordinator.to_string(), timeout: left }),
            }
        };
        let last = match attempt.await {
            Ok(Frame { msg: Message::ClusterMap(map), .. }) => return Ok(map),
            Ok(other) => {
                return Err(RpcError::Unexpected {
                    addr: coordinator.to_string(),
                    kind: net::kind_name(&other.msg).into(),
                }
                .into())
            }
            Err(RpcError::Remote { code: ErrorCode::ClusterIncomplete | ErrorCode::Busy, message, .. }) => message,
            Err(e) if e.is_retryable() => e.to_string(),
            Err(e @ RpcError::Remote { code: ErrorCode::Moved | ErrorCode::Misconfigured, .. }) if redirects < 3 => {
                match coordinator_named_by(endpoint, coordinator, cluster, per_call).await {
                    Some(now) if now != coordinator => {
                        debug!(from = %coordinator, to = %now, "the coordinator moved: registering there");
                        (redirects, coordinator) = (redirects + 1, now);
                        continue;
                    }
                    _ => return Err(e.into()),
                }
            }
            Err(e) => return Err(e.into()),
        };
        // Exponential backoff with jitter: hundreds of workers started at once do not come back at once.
        tries += 1;
        let base = (100u64 << tries.min(4)).min(1_600);
        let pause = Duration::from_millis(base / 2 + jitter_ms(base / 2));
        // Give up when no further attempt fits (a pause and at least as long again for the attempt): the
        // error reports what the last complete attempt said.
        if Instant::now() + 2 * pause >= deadline {
            return Err(ClientError::JoinTimeout {
                coordinator: opts.coordinator.clone(),
                waited: started.elapsed(),
                last,
            });
        }
        debug!(%last, "cluster not ready, retrying");
        tokio::time::sleep(pause).await;
    }
}

/// The rules a map names: the dense default, each tensor's (with its hyper-parameters) and each table's.
pub(super) type MapRules = (Rule, Vec<(Rule, Hyper)>, Vec<Rule>);

/// Checks the map's layout and shard list and reads its rules.
pub(super) fn rules_of(map: &ClusterMap) -> Result<MapRules, ClientError> {
    map.layout.validate().map_err(|e| ClientError::BadMap(e.to_string()))?;
    let rule: Rule =
        map.rule.name.parse().map_err(|e: gaps_kernels::KernelError| ClientError::BadMap(e.to_string()))?;
    let hyper = Hyper { momentum: map.rule.momentum, weight_decay: map.rule.weight_decay, ..Hyper::default() };
    let sparse_rule: Rule =
        map.rule.sparse.parse().map_err(|e: gaps_kernels::KernelError| ClientError::BadMap(e.to_string()))?;
    let tensor_rules = map
        .layout
        .tensors
        .iter()
        .map(|t| hyper.resolve(rule, &t.rule))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ClientError::BadMap(e.to_string()))?;
    let table_rules = map
        .layout
        .tables
        .iter()
        .map(|t| hyper.resolve(sparse_rule, &t.rule).map(|(r, _)| r))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ClientError::BadMap(e.to_string()))?;
    if map.shards.len() != map.num_shards as usize || map.shards.iter().enumerate().any(|(i, s)| s.index as usize != i)
    {
        return Err(ClientError::BadMap(format!("expected {} shards in index order", map.num_shards)));
    }
    Ok((rule, tensor_rules, table_rules))
}

/// One link per shard of the map, its chunks assigned round-robin in layout order, `lanes` connections each.
pub(super) async fn links(map: &ClusterMap, lanes: usize) -> Result<Vec<ShardLink>, ClientError> {
    let mut owned: Vec<Vec<(ChunkId, u64)>> = vec![Vec::new(); map.num_shards as usize];
    for (g, id) in map.layout.chunks().enumerate() {
        owned[g % map.num_shards as usize].push((id, g as u64));
    }
    let mut shards = Vec::with_capacity(map.shards.len());
    for (s, chunks) in map.shards.iter().zip(owned) {
        let addr = net::resolve(&s.addr).await?;
        let route = Route { name: s.addr.clone(), addr, process: s.process, epoch: s.epoch };
        shards.push(ShardLink::new(s.index, route, lanes, chunks));
    }
    Ok(shards)
}

impl ShardLink {
    /// A link to shard `index` at `route` with `lanes` connections (none open yet), owning `chunks`.
    pub(super) fn new(index: u32, route: Route, lanes: usize, chunks: Vec<(ChunkId, u64)>) -> ShardLink {
        let lanes = lanes.clamp(1, usize::from(MAX_PUSH_PARTS));
        ShardLink {
            index,
            route: Mutex::new(route),
            conns: (0..lanes).map(|_| Mutex::new(None)).collect(),
            used_ms: (0..lanes).map(|_| Default::default()).collect(),
            next_seq: AtomicU64::new(1),
            acknowledged: AtomicU64::new(0),
            chunks,
            sparse_in_flight: AtomicUsize::new(0),
            sparse_answered: tokio::sync::Notify::new(),
        }
    }
}

/// Connects to every shard now, so a missing or unreachable shard fails by name — tried again with a
/// jittered backoff until `deadline`, since a handshake can be lost on a loaded machine.
pub(super) async fn reach_every_shard(client: &Client, started: Instant, deadline: Instant) -> Result<(), ClientError> {
    for s in 0..client.inner.shards.len() {
        let mut tries = 0u32;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
            let bound = remaining.min((remaining / 4).max(Duration::from_secs(2)));
            match client.connection(s, 0, bound).await {
                Ok(_) => break,
                Err(e) if Instant::now() + Duration::from_millis(200) < deadline => {
                    tries += 1;
                    let base = (100u64 << tries.min(4)).min(1_600);
                    debug!(shard = s, error = %e, "connecting to a shard, trying again");
                    tokio::time::sleep(Duration::from_millis(base / 2 + jitter_ms(base / 2))).await;
                }
                Err(e) => {
                    return Err(ClientError::JoinTimeout {
                        coordinator: client.inner.opts.coordinator.clone(),
                        waited: started.elapsed(),
                        last: format!("shard {} at {} is unreachable: {e}", s, client.inner.shards[s].addr()),
                    })
                }
            }
        }
    }
    Ok(())
}

impl Inner {
    /// A client's state before its first request, every counter at zero.
    pub(super) fn fresh(
        opts: ClientOptions,
        cluster: String,
        rotated: Arc<Mutex<Option<quinn::ClientConfig>>>,
        (endpoint, path): (quinn::Endpoint, net::PathTuning),
        map: ClusterMap,
        shards: Vec<ShardLink>,
        (rule, tensor_rules, table_rules): MapRules,
    ) -> Inner {
        let processes = map.process_addrs();
        Inner {
            opts,
            cluster,
            rotated,
            endpoint,
            path,
            map,
            shards,
            drop_after_send: AtomicU32::new(0),
            pushes_sent: AtomicU64::new(0),
            pushes_acknowledged: AtomicU64::new(0),
            stale_after_restore: AtomicU64::new(0),
            rollbacks_seen: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            rule,
            tensor_rules,
            slim_momentum: Mutex::new(Vec::new()),
            table_rules,
            last_pull: Mutex::new(None),
            data_tag: Mutex::new(None),
            waited_us: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            processes: Mutex::new(processes),
            located: Mutex::new(None),
            map_asked: Mutex::new(None),
            decisions: Mutex::new(None),
            born: Instant::now(),
            caller_driven: false,
        }
    }
}

impl Client {
    /// A client of the same worker over connections of its own, on an endpoint of its own driven by the
    /// runtime this is called on (each shard's connection opened at its first request, authenticated with
    /// this worker's credential): for requests that must go on while the thread that drives this client's
    /// connections is busy ([`Client::start_heartbeats`]). It shares the TLS material (a rotation reaches
    /// both) and starts with the shards' routes as this client knows them (following a shard that moves on
    /// its own, as any client does); counters start at zero.
    pub fn companion(&self) -> Result<Client, ClientError> {
        let inner = &self.inner;
        let (endpoint, path) = net::client_endpoint_tuned(&inner.opts.tls, inner.shards[0].addr())?;
        let shards = inner.shards.iter().map(|l| ShardLink::new(l.index, l.route(), 1, l.chunks.clone())).collect();
        let rules = (inner.rule, inner.tensor_rules.clone(), inner.table_rules.clone());
        let (opts, cluster, map) = (inner.opts.clone(), inner.cluster.clone(), inner.map.clone());
        let companion = Inner::fresh(opts, cluster, inner.rotated.clone(), (endpoint, path), map, shards, rules);
        if let (Ok(mine), Ok(mut theirs)) = (inner.processes.lock(), companion.processes.lock()) {
            theirs.clone_from(&mine);
        }
        *companion.decisions.lock().map_err(|_| RpcError::Setup("a lock is poisoned".into()))? = inner.decisions();
        Ok(Client { inner: Arc::new(companion) })
    }
}
