//! Real QUIC on 127.0.0.1 with certificates made in memory: mutual TLS, routing over two shards, exactly-once
//! retries, typed errors for malformed frames, fail-fast on an incomplete cluster.

use gaps_common::layout::{ChunkId, Layout, TensorSpec};
use gaps_common::wire::{self, ErrorCode, Limits, Message, Push, PushChunk, Register, Role, PROTOCOL_VERSION};
use gaps_kernels::{Hyper, Rule};
use gaps_server::service::{self, RunningServer, ServiceConfig};
use gaps_setup::certs::ClusterCerts;
use gaps_shard::{Init, ShardConfig};
use gaps_transport::net;
use gaps_transport::tls::TlsMaterial;
use gaps_worker::client::{Client, ClientError, ClientOptions};
use std::sync::Arc;
use std::time::Duration;

const LR: f32 = 0.5;

fn layout() -> Layout {
    Layout::new(vec![TensorSpec::new("w", 1000), TensorSpec::new("b", 3)], 128).expect("layout")
}

async fn start_shard(certs: &ClusterCerts, shard: u32, num_shards: u32, coordinator: Option<String>) -> RunningServer {
    start_shard_with(certs, shard, num_shards, coordinator, Rule::Sgd).await
}

async fn start_shard_with(
    certs: &ClusterCerts,
    shard: u32,
    num_shards: u32,
    coordinator: Option<String>,
    rule: Rule,
) -> RunningServer {
    start_shard_serving(certs, shard, num_shards, coordinator, rule, layout(), 0.1).await
}

async fn start_shard_serving(
    certs: &ClusterCerts,
    shard: u32,
    num_shards: u32,
    coordinator: Option<String>,
    rule: Rule,
    layout: Layout,
    init_std: f32,
) -> RunningServer {
    let cfg = ServiceConfig {
        coordinator,
        join_timeout: Duration::from_secs(10),
        tick_interval: Duration::from_millis(100),
        ..ServiceConfig::new(
            "127.0.0.1:0".parse().expect("addr"),
            certs.shard_material(shard).expect("server tls"),
            ShardConfig {
                shard,
                num_shards,
                layout,
                rule,
                hyper: Hyper {
                    lr: LR,
                    momentum: if rule == Rule::Sgd { 0.0 } else { 0.9 },
                    weight_decay: 0.0,
                    ..Hyper::default()
                },
                init: Init { seed: 5, std: init_std },
                lease: Duration::from_secs(10),
                advertise: String::new(),
                epoch: 1234,
                threads: 1,
                sparse: gaps_shard::core::SparseSettings::default(),
                modes: gaps_shard::modes::ModeConfig::default(),
            },
        )
    };
    service::start(cfg).await.expect("start shard")
}

async fn cluster(certs: &ClusterCerts, num_shards: u32) -> Vec<RunningServer> {
    let s0 = start_shard(certs, 0, num_shards, None).await;
    let coordinator = s0.advertise.clone();
    let mut servers = vec![s0];
    for s in 1..num_shards {
        servers.push(start_shard(certs, s, num_shards, Some(coordinator.clone())).await);
    }
    servers
}

fn options(certs: &ClusterCerts, coordinator: &str, role: Role) -> ClientOptions {
    let mut o = ClientOptions::new(coordinator, certs.worker_material().expect("worker tls"), role, "test");
    o.connect_timeout = Duration::from_secs(5);
    o.rpc_timeout = Duration::from_secs(5);
    o
}

fn gradient(seed: u32) -> Vec<Vec<f32>> {
    layout()
        .tensors
        .iter()
        .enumerate()
        .map(|(t, spec)| {
            (0..spec.len as u32).map(|i| (((i + seed) * 31 + t as u32 * 7) % 17) as f32 / 17.0 - 0.5).collect()
        })
        .collect()
}

/// A connection of its own to `server`, authenticated as `client`'s worker (for raw requests).
async fn connection_as(
    certs: &ClusterCerts,
    server: &RunningServer,
    client: &Client,
) -> (quinn::Endpoint, quinn::Connection) {
    let tls = certs.worker_material().expect("tls");
    let endpoint = net::client_endpoint(&tls, server.addr).expect("endpoint");
    let conn = net::connect(&endpoint, server.addr, Duration::from_secs(3)).await.expect("connect");
    let worker = client.worker_id().expect("id");
    let (_, token) = client.credential().expect("credential");
    let auth = Message::Authenticate(gaps_common::wire::Authenticate { worker, token });
    net::call(&conn, &auth, &[], &Limits::default(), Duration::from_secs(3)).await.expect("authenticate");
    (endpoint, conn)
}

/// A push of every chunk of `layout` by `client`'s worker, chunk i read at `versions[i]`, each tensor's
/// values in `dtype(tensor)`.
fn whole_push(
    layout: &Layout,
    client: &Client,
    seq: u64,
    versions: &[u64],
    dtype: impl Fn(u32) -> gaps_common::dtype::WireDtype,
) -> Message {
    let chunks = layout
        .chunks()
        .zip(versions)
        .map(|(id, v)| PushChunk {
            dtype: dtype(id.tensor),
            ..PushChunk::f32(id, *v, layout.chunk_len(id).expect("len") as u32)
        })
        .collect();
    Message::Push(Push::new(client.map().epoch, client.worker_id().expect("id"), seq, chunks))
}

async fn shutdown(servers: Vec<RunningServer>) {
    for s in servers {
        s.shutdown().await.expect("shutdown");
    }
}

/// A cluster of `shards` shards with new certificates, and a worker's client connected to it.
async fn worker_of_cluster(shards: u32) -> (ClusterCerts, Vec<RunningServer>, Client) {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let servers = cluster(&certs, shards).await;
    let client = Client::connect(options(&certs, &servers[0].advertise, Role::Worker)).await.expect("connect");
    (certs, servers, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_shards_route_pull_and_push_and_apply_sgd() {
    let (_certs, servers, client) = worker_of_cluster(2).await;
    assert_eq!(client.map().num_shards, 2);
    let before = client.pull().await.expect("pull");
    assert!(before.versions.iter().all(|v| *v == 0));
    let g = gradient(1);
    let summary = client.push(g.clone(), &before).await.expect("push");
    assert_eq!((summary.applied, summary.duplicates, summary.max_staleness), (2, 0, 0));
    let after = client.pull().await.expect("pull");
    for (t, grad) in g.iter().enumerate() {
        for (i, (a, b)) in after.tensors[t].iter().zip(&before.tensors[t]).enumerate() {
            assert_eq!(*a, b - LR * grad[i], "tensor {t} element {i}");
        }
    }
    assert!(after.versions.iter().all(|v| *v == 1));
    // Both shards hold part of the model and each applied exactly one push.
    let stats = client.stats().await.expect("stats");
    assert_eq!(stats.iter().map(|s| s.pushes_applied).collect::<Vec<_>>(), vec![1, 1]);
    assert_eq!(stats[0].live_workers, 1);
    client.leave().await.expect("leave");
    shutdown(servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_retried_after_a_lost_connection_is_applied_once() {
    let (_certs, servers, client) = worker_of_cluster(2).await;
    let before = client.pull().await.expect("pull");
    let g = gradient(2);
    // Both shard pushes are written in full, then their connections are cut before the acknowledgement.
    client.inject_connection_drops(2);
    let summary = client.push(g.clone(), &before).await.expect("push survives the drop");
    assert_eq!(summary.retries, 2);
    assert_eq!(summary.applied + summary.duplicates, 2);
    let after = client.pull().await.expect("pull");
    for (i, (a, b)) in after.tensors[0].iter().zip(&before.tensors[0]).enumerate() {
        assert_eq!(*a, b - LR * g[0][i], "element {i} must be updated exactly once");
    }
    let stats = client.stats().await.expect("stats");
    assert_eq!(stats.iter().map(|s| s.pushes_applied).sum::<u64>(), 2);
    assert_eq!(client.pushes_sent(), 2);
    client.leave().await.expect("leave");
    shutdown(servers).await;
}

/// A cluster of `shards` on a multi-thread runtime of its own, and a worker's client on a current-thread
/// runtime (`gaps-worker` with one lane), which moves packets only while its thread is in `block_on`.
fn caller_driven_worker(
    shards: u32,
) -> (tokio::runtime::Runtime, ClusterCerts, Vec<RunningServer>, tokio::runtime::Runtime, Client) {
    let servers_rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let servers = servers_rt.block_on(cluster(&certs, shards));
    let caller = gaps_transport::runtime::build(0).expect("a worker's runtime of one lane");
    let connect = Client::connect(options(&certs, &servers[0].advertise, Role::Worker));
    let client = caller.block_on(connect).expect("connect");
    (servers_rt, certs, servers, caller, client)
}

/// A worker on a current-thread runtime (`gaps-worker` with one lane) moves no packet while its thread
/// computes outside `block_on`; its heartbeats go from a thread and connections of their own, reach every
/// shard meanwhile, and stop before it leaves: no late heartbeat brings the worker back.
#[test]
fn a_current_thread_worker_heartbeats_while_its_thread_is_busy_and_stops_before_it_leaves() {
    let (servers_rt, certs, servers, caller, client) = caller_driven_worker(2);
    let heartbeats = caller.block_on(async { client.start_heartbeats(Duration::from_millis(50)) }).expect("heartbeats");
    assert!(heartbeats.acknowledged().is_some(), "a current-thread client's heartbeats were made a task");
    // The caller's thread is outside block_on, as if computing: nothing drives its runtime. A bound on the
    // wait, not a measurement.
    let bound = std::time::Instant::now() + Duration::from_secs(60);
    while heartbeats.acknowledged() < Some(3) && std::time::Instant::now() < bound {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(heartbeats.acknowledged() >= Some(3), "{:?} heartbeats answered", heartbeats.acknowledged());
    caller.block_on(async {
        heartbeats.stop().await;
        let live: Vec<u32> = client.stats().await.expect("stats").iter().map(|s| s.live_workers).collect();
        assert_eq!(live, vec![1, 1]);
        client.leave().await.expect("leave");
    });
    drop(client);
    servers_rt.block_on(async {
        let observer = Client::connect(options(&certs, &servers[0].advertise, Role::Observer)).await.expect("observer");
        let live: Vec<u32> = observer.stats().await.expect("stats").iter().map(|s| s.live_workers).collect();
        assert_eq!(live, vec![0, 0], "a heartbeat renewed the lease of a worker that left");
        observer.close().await;
        shutdown(servers).await;
    });
}

/// A caller-driven client (current-thread runtime) whose thread computed longer than the transport's idle
/// timeout sent no keep-alive meanwhile and the shard dropped its connection: the next request goes on a
/// new connection at once instead of meeting the dead one and being sent again.
#[test]
fn a_connection_left_undriven_past_the_idle_timeout_is_replaced_before_the_next_request() {
    let (servers_rt, _certs, servers, caller, client) = caller_driven_worker(1);
    caller.block_on(client.pull()).expect("pull");
    // The caller computes (outside block_on) past the idle timeout: at least this long, whatever the load.
    std::thread::sleep(net::IDLE_TIMEOUT + Duration::from_secs(1));
    caller.block_on(async {
        client.pull().await.expect("pull after a long computation");
        assert_eq!(client.retries(), 0, "the request met the dropped connection and was sent again");
        client.leave().await.expect("leave");
    });
    drop(client);
    servers_rt.block_on(shutdown(servers));
}

/// Tries one RPC with a hand-made rustls client configuration; returns whether the server answered.
async fn register_with(config: rustls::ClientConfig, addr: std::net::SocketAddr) -> bool {
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(config).expect("quic client config");
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().expect("addr")).expect("endpoint");
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    let Ok(conn) = net::connect(&endpoint, addr, Duration::from_secs(3)).await else { return false };
    let reg = Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Observer, name: "intruder".into() });
    net::call(&conn, &reg, &[], &Limits::default(), Duration::from_secs(3)).await.is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_without_a_certificate_from_the_cluster_ca_are_refused() {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let servers = cluster(&certs, 1).await;
    let addr = servers[0].addr;
    let provider = gaps_transport::tls::provider();
    let mut roots = rustls::RootCertStore::empty();
    for c in certs.worker_material().expect("tls").ca {
        roots.add(c).expect("root");
    }
    let versions = [&rustls::version::TLS13];
    // 1. No client certificate at all.
    let mut anonymous = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&versions)
        .expect("tls13")
        .with_root_certificates(roots.clone())
        .with_no_client_auth();
    anonymous.alpn_protocols = vec![gaps_transport::tls::ALPN.to_vec()];
    assert!(!register_with(anonymous, addr).await, "a client without a certificate was served");
    // 2. A certificate signed by another CA.
    let foreign = ClusterCerts::generate(&[]).expect("other certs").worker_material().expect("tls");
    let impostor = TlsMaterial { ca: certs.worker_material().expect("tls").ca, identity: foreign.identity };
    assert!(!register_with(impostor.client_config().expect("config"), addr).await, "a foreign certificate was served");
    // 3. The legitimate certificate is served.
    assert!(register_with(certs.worker_material().expect("tls").client_config().expect("config"), addr).await);
    let registered = servers[0].with_core(|c| c.stats().registered_workers).await.expect("core");
    assert_eq!(registered, 0, "observers only");
    shutdown(servers).await;
}

/// Sends raw bytes as one request on its own stream and returns the decoded reply.
async fn raw_request(conn: &quinn::Connection, bytes: &[u8]) -> Message {
    let (mut send, mut recv) = conn.open_bi().await.expect("stream");
    send.write_all(bytes).await.expect("write");
    send.finish().expect("finish");
    net::read_frame(&mut recv, &Limits::default()).await.expect("a reply frame").msg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_over_the_network_get_typed_errors_and_change_nothing() {
    let (certs, servers, client) = worker_of_cluster(1).await;
    let before = client.pull().await.expect("pull");
    let tls = certs.worker_material().expect("tls");
    let endpoint = net::client_endpoint(&tls, servers[0].addr).expect("endpoint");
    let conn = net::connect(&endpoint, servers[0].addr, Duration::from_secs(3)).await.expect("connect");
    let worker = client.worker_id().expect("id");
    // The raw connection acts for the worker with its credential (same certificate), as its client does.
    let (_, token) = client.credential().expect("credential");
    let auth = Message::Authenticate(gaps_common::wire::Authenticate { worker, token });
    net::call(&conn, &auth, &[], &Limits::default(), Duration::from_secs(3)).await.expect("authenticate");
    let l = layout();
    let ids: Vec<ChunkId> = l.chunks().collect();
    // Fresh f32 gradients of `of`, computed on version 0.
    let chunks_of = |of: &[ChunkId]| -> Vec<PushChunk> {
        of.iter().map(|id| PushChunk::f32(*id, 0, l.chunk_len(*id).expect("len") as u32)).collect()
    };
    let push = |payload_len: u32, value: f32| {
        let chunks = chunks_of(&ids);
        let total: u32 = chunks.iter().map(|c| c.len).sum();
        let msg = Message::Push(Push::new(client.map().epoch, worker, 1, chunks));
        let mut bytes = wire::encode_header(&msg, total as usize).expect("header");
        bytes.extend((0..payload_len).flat_map(|i| if i == 5 { value } else { 0.25f32 }.to_le_bytes()));
        bytes
    };
    let total = l.total_elems() as u32;
    let expect = |reply: Message, code: ErrorCode, what: &str| match reply {
        Message::Error(e) => assert_eq!(e.code, code, "{what}: {}", e.message),
        other => panic!("{what}: expected an error, got {other:?}"),
    };
    expect(raw_request(&conn, &[99, 0, 0, 0, 0]).await, ErrorCode::UnknownKind, "unknown kind");
    expect(raw_request(&conn, &push(total - 1, 0.1)).await, ErrorCode::Malformed, "truncated payload");
    let mut trailing = push(total, 0.1);
    trailing.extend_from_slice(&[1, 2, 3]);
    expect(raw_request(&conn, &trailing).await, ErrorCode::Malformed, "trailing bytes");
    expect(raw_request(&conn, &push(total, f32::NAN)).await, ErrorCode::NonFinite, "NaN gradient");
    expect(raw_request(&conn, &push(total, f32::NEG_INFINITY)).await, ErrorCode::NonFinite, "-Inf gradient");
    // Parts of a striped push: malformed ones are refused at once; a part holding NaN makes the whole push
    // refused (every part answered so), and a part cannot act for another worker.
    let part = |index: u16, parts: u16, seq: u64, acting: u32, value: f32| {
        let half = ids.len() / 2;
        let chunks = chunks_of(if index == 0 { &ids[..half] } else { &ids[half..] });
        let n: u32 = chunks.iter().map(|c| c.len).sum();
        let push = Push::new(client.map().epoch, acting, seq, chunks);
        let msg = Message::PushPart(gaps_common::wire::PushPart { part: index, parts, push });
        let mut bytes = wire::encode_header(&msg, n as usize).expect("header");
        bytes.extend((0..n).flat_map(|i| if i == 3 { value } else { 0.25f32 }.to_le_bytes()));
        bytes
    };
    expect(raw_request(&conn, &part(0, 1, 1, worker, 0.1)).await, ErrorCode::WrongShape, "a push of one part");
    expect(raw_request(&conn, &part(2, 2, 1, worker, 0.1)).await, ErrorCode::WrongShape, "part index out of range");
    expect(raw_request(&conn, &part(0, 2, 1, worker + 1, 0.1)).await, ErrorCode::Unauthorized, "another worker");
    let first = part(0, 2, 1, worker, 0.1);
    let held = {
        let conn = conn.clone();
        tokio::spawn(async move { raw_request(&conn, &first).await })
    };
    expect(raw_request(&conn, &part(1, 2, 1, worker, f32::NAN)).await, ErrorCode::NonFinite, "NaN in part 1");
    expect(held.await.expect("part 0"), ErrorCode::NonFinite, "part 0 gets the whole push's answer");
    let mut huge = vec![6u8];
    huge.extend_from_slice(&(64u32 << 20).to_le_bytes());
    expect(raw_request(&conn, &huge).await, ErrorCode::TooLarge, "over-limit header");
    // A push whose header declares far more payload than the shard owns is refused before allocation.
    let big = Message::Push(Push::new(
        client.map().epoch,
        worker,
        2,
        vec![PushChunk {
            id: ids[0],
            read_version: 0,
            len: u32::MAX,
            echo: false,
            dtype: gaps_common::dtype::WireDtype::F32,
        }],
    ));
    let header = wire::encode_header(&big, u32::MAX as usize).expect("header");
    expect(raw_request(&conn, &header).await, ErrorCode::TooLarge, "over-limit payload");
    let after = client.pull().await.expect("pull");
    assert_eq!(after, before, "refused requests changed the model");
    // The worker's own sequence number 1 is still unused and applies normally.
    let summary = client.push(gradient(3), &before).await.expect("push");
    assert_eq!(summary.applied, 1);
    conn.close(0u32.into(), b"done");
    client.leave().await.expect("leave");
    shutdown(servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incomplete_cluster_fails_fast_and_names_the_missing_shard() {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let servers = vec![start_shard(&certs, 0, 3, None).await];
    let mut opts = options(&certs, &servers[0].advertise, Role::Worker);
    opts.connect_timeout = Duration::from_millis(800);
    let started = std::time::Instant::now();
    let err = Client::connect(opts).await.expect_err("the cluster is incomplete");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert!(matches!(err, ClientError::JoinTimeout { .. }), "{err}");
    assert!(err.to_string().contains("shard(s) 1, 2 of 3"), "{err}");
    // Nobody listens here: the error says which address was tried.
    let mut nowhere = options(&certs, "127.0.0.1:9", Role::Worker);
    nowhere.connect_timeout = Duration::from_millis(500);
    nowhere.rpc_timeout = Duration::from_millis(200);
    let err = Client::connect(nowhere).await.expect_err("no coordinator");
    assert!(err.to_string().contains("127.0.0.1:9"), "{err}");
    shutdown(servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_with_read_echo_look_ahead_or_worker_momentum_work_over_the_network() {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    for rule in [Rule::GapAware, Rule::DanaSlim, Rule::DanaGa, Rule::DcAsgdAdaptive] {
        let s0 = start_shard_with(&certs, 0, 2, None, rule).await;
        let s1 = start_shard_with(&certs, 1, 2, Some(s0.advertise.clone()), rule).await;
        let client = Client::connect(options(&certs, &s0.advertise, Role::Worker)).await.expect("connect");
        assert_eq!(client.rule(), rule);
        let first = client.pull().await.expect("pull");
        let mut snap = first.clone();
        for step in 0..3 {
            let summary = client.push(gradient(step), &snap).await.unwrap_or_else(|e| panic!("{rule}: {e}"));
            assert_eq!(summary.applied, 2, "{rule}");
            snap = client.pull().await.expect("pull");
        }
        assert!(snap.versions.iter().all(|v| *v == 3), "{rule}");
        assert_ne!(snap.tensors, first.tensors, "{rule} changed nothing");
        client.leave().await.expect("leave");
        shutdown(vec![s0, s1]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_bit_tensors_travel_rounded_while_the_shard_keeps_f32() {
    use gaps_common::dtype::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16, WireDtype};
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let mut l = layout();
    l.tensors[0].wire_dtype = Some(WireDtype::Bf16);
    l.tensors[1].wire_dtype = Some(WireDtype::F16);
    // Parameters start at zero so the expected values are known exactly.
    let server = start_shard_serving(&certs, 0, 1, None, Rule::Sgd, l, 0.0).await;
    let client = Client::connect(options(&certs, &server.advertise, Role::Worker)).await.expect("connect");
    let round: [fn(f32) -> f32; 2] = [|x| bf16_to_f32(f32_to_bf16(x)), |x| f16_to_f32(f32_to_f16(x))];
    // Gradients with more precision than 16 bits carry.
    let grad = |seed: u32| -> Vec<Vec<f32>> {
        gradient(seed).into_iter().map(|t| t.into_iter().map(|g| g * 1.001_234_5 + 1e-4).collect()).collect()
    };
    let s0 = client.pull().await.expect("pull");
    assert!(s0.tensors.iter().flatten().all(|v| *v == 0.0));
    let (g1, g2) = (grad(1), grad(2));
    client.push(g1.clone(), &s0).await.expect("push");
    let s1 = client.pull().await.expect("pull");
    client.push(g2.clone(), &s1).await.expect("push");
    let s2 = client.pull().await.expect("pull");
    let mut rounded_somewhere = false;
    for t in 0..2 {
        for i in 0..g1[t].len() {
            // The shard applied the rounded gradients to f32 state; a pull rounds the state once.
            let state1 = -LR * round[t](g1[t][i]);
            let state2 = state1 - LR * round[t](g2[t][i]);
            assert_eq!(s1.tensors[t][i], round[t](state1), "tensor {t} element {i} after one push");
            assert_eq!(s2.tensors[t][i], round[t](state2), "tensor {t} element {i} after two pushes");
            rounded_somewhere |= round[t](g1[t][i]) != g1[t][i] || round[t](state2) != state2;
        }
    }
    assert!(rounded_somewhere, "the test's values must exercise rounding");

    // Bad 16-bit payloads over the network: a NaN pattern and a truncated value are refused.
    let (_endpoint, conn) = connection_as(&certs, &server, &client).await;
    let l = layout();
    let msg = whole_push(&l, &client, 3, &vec![2; l.chunks().count()], |_| WireDtype::Bf16);
    let total = l.total_elems() as usize;
    let frame = |pattern: u16, halves: usize, extra: usize| {
        let mut bytes = wire::encode_header(&msg, total).expect("header");
        bytes.extend((0..halves).flat_map(|i| if i == 7 { pattern } else { 0x3e80 }.to_le_bytes()));
        bytes.extend(std::iter::repeat_n(0u8, extra));
        bytes
    };
    let expect = |reply: Message, code: ErrorCode, what: &str| match reply {
        Message::Error(e) => assert_eq!(e.code, code, "{what}: {}", e.message),
        other => panic!("{what}: expected an error, got {other:?}"),
    };
    expect(raw_request(&conn, &frame(0x7fc0, total, 0)).await, ErrorCode::NonFinite, "bf16 NaN");
    expect(raw_request(&conn, &frame(0x7f80, total, 0)).await, ErrorCode::NonFinite, "bf16 infinity");
    expect(raw_request(&conn, &frame(0x3e80, total - 1, 1)).await, ErrorCode::Malformed, "half a value short");
    expect(raw_request(&conn, &frame(0x3e80, total, 1)).await, ErrorCode::Malformed, "a byte too many");
    // The same push, well formed, applies: 0x3e80 is 0.25 in bfloat16.
    match raw_request(&conn, &frame(0x3e80, total, 0)).await {
        Message::Ack(a) => assert!(!a.duplicate),
        other => panic!("expected an ack, got {other:?}"),
    }
    let s3 = client.pull().await.expect("pull");
    assert_eq!(s3.tensors[0][0], round[0](-LR * round[0](g1[0][0]) - LR * round[0](g2[0][0]) - LR * 0.25));
    conn.close(0u32.into(), b"done");
    client.leave().await.expect("leave");
    server.shutdown().await.expect("shutdown");
}

/// A model large enough that each shard's part of a push is cut into stripes (≥ 512 KiB a stripe).
fn striped_layout() -> Layout {
    Layout::new(vec![TensorSpec::new("w", 1 << 20), TensorSpec::new("b", 5)], 1 << 16).expect("layout")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_striped_over_several_connections_is_applied_once_even_when_parts_are_cut_off() {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let s0 = start_shard_serving(&certs, 0, 2, None, Rule::Sgd, striped_layout(), 0.1).await;
    let s1 = start_shard_serving(&certs, 1, 2, Some(s0.advertise.clone()), Rule::Sgd, striped_layout(), 0.1).await;
    let mut striped = options(&certs, &s0.advertise, Role::Worker);
    striped.lanes = 4;
    let client = Client::connect(striped).await.expect("connect");
    let observer = Client::connect(options(&certs, &s0.advertise, Role::Observer)).await.expect("observer");
    let before = client.pull().await.expect("striped pull");
    assert_eq!(before, observer.pull().await.expect("plain pull"), "a striped pull reads what a whole one does");
    let grads: Vec<Vec<f32>> = striped_layout()
        .tensors
        .iter()
        .map(|t| (0..t.len).map(|i| ((i * 13) % 29) as f32 / 29.0 - 0.5).collect())
        .collect();
    // Three parts are written in full and their connections cut before the reply: each is sent again on a
    // new connection, and each shard still applies its push once, whole.
    client.inject_connection_drops(3);
    let summary = client.push(grads.clone(), &before).await.expect("striped push survives the drops");
    assert_eq!(summary.retries, 3);
    assert_eq!(summary.applied + summary.duplicates, 2, "one acknowledgement per shard");
    let after = observer.pull().await.expect("pull");
    for (t, g) in grads.iter().enumerate() {
        for (i, (a, b)) in after.tensors[t].iter().zip(&before.tensors[t]).enumerate() {
            assert_eq!(*a, b - LR * g[i], "tensor {t} element {i} must be updated exactly once");
        }
    }
    assert!(after.versions.iter().all(|v| *v == 1), "every chunk applied once: {:?}", after.versions);
    let stats = observer.stats().await.expect("stats");
    assert_eq!(stats.iter().map(|s| s.pushes_applied).collect::<Vec<_>>(), vec![1, 1]);
    // A second striped push, without faults, lands on top; the in-flight bound held throughout.
    let summary = client.push(grads.clone(), &client.pull().await.expect("pull")).await.expect("push");
    assert_eq!((summary.applied, summary.retries), (2, 0));
    assert!(observer.pull().await.expect("pull").versions.iter().all(|v| *v == 2));
    // A push-pull striped over lanes is acknowledged part by part, then pulled (striped) on its own.
    let (summary, next) = client.push_pull(grads.clone(), &after).await.expect("striped push_pull");
    assert_eq!(summary.applied, 2);
    assert_eq!(next, observer.pull().await.expect("pull"), "push_pull returns what a pull right after reads");
    assert!(next.versions.iter().all(|v| *v == 3));
    for s in [&s0, &s1] {
        assert!(s.peak_inflight_bytes() <= service::DEFAULT_INFLIGHT_BYTES, "{}", s.peak_inflight_bytes());
    }
    client.leave().await.expect("leave");
    shutdown(vec![s0, s1]).await;
}

/// Two identical clusters of `shards` shards under `rule`, each with a worker's client.
async fn twin_clusters(certs: &ClusterCerts, shards: u32, rule: Rule) -> Vec<(Client, Vec<RunningServer>)> {
    let mut clusters = Vec::new();
    for _ in 0..2 {
        let s0 = start_shard_with(certs, 0, shards, None, rule).await;
        let mut servers = vec![];
        for shard in 1..shards {
            servers.push(start_shard_with(certs, shard, shards, Some(s0.advertise.clone()), rule).await);
        }
        let client = Client::connect(options(certs, &s0.advertise, Role::Worker)).await.expect("connect");
        servers.insert(0, s0);
        clusters.push((client, servers));
    }
    clusters
}

/// Each cluster's worker leaves, then its shards stop.
async fn stop_all(clusters: Vec<(Client, Vec<RunningServer>)>) {
    for (client, servers) in clusters {
        client.leave().await.expect("leave");
        shutdown(servers).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_pull_trains_exactly_as_a_push_then_a_pull_and_survives_lost_connections() {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    for rule in [Rule::Sgd, Rule::GapAware, Rule::DanaSlim] {
        // Two identical clusters of two shards: one driven with push then pull, one with push_pull.
        let clusters = twin_clusters(&certs, 2, rule).await;
        let (separate, fused) = (&clusters[0].0, &clusters[1].0);
        let mut a = separate.pull().await.expect("pull");
        let mut b = fused.pull().await.expect("pull");
        assert_eq!(a, b, "{rule}: the clusters start alike");
        for step in 0..4 {
            if step == 2 {
                // Both shards' push-pulls are written in full, then their connections are cut before the
                // reply: sent again, each is applied once and still answered with the values.
                fused.inject_connection_drops(2);
            }
            let summary = separate.push(gradient(step), &a).await.expect("push");
            a = separate.pull().await.expect("pull");
            let (fused_summary, next) = fused.push_pull(gradient(step), &b).await.expect("push_pull");
            b = next;
            assert_eq!(summary.applied, 2, "{rule}");
            assert_eq!(fused_summary.applied + fused_summary.duplicates, 2, "{rule}");
            assert_eq!(fused_summary.retries, if step == 2 { 2 } else { 0 }, "{rule} step {step}");
            assert_eq!(a, b, "{rule} step {step}: push_pull read what push then pull read");
        }
        assert!(b.versions.iter().all(|v| *v == 4), "{rule}: {:?}", b.versions);
        let stats = fused.stats().await.expect("stats");
        assert_eq!(stats.iter().map(|s| s.pushes_applied).sum::<u64>(), 8, "{rule}: each push applied once");
        // The first pull, one read per push-pull, and one more for each of the two whose reply was lost.
        assert_eq!(stats.iter().map(|s| s.pulls).sum::<u64>(), 2 + 8 + 2, "{rule}: reads");
        stop_all(clusters).await;
    }
}

/// A model smaller than a chunk lives on one shard; the other is pushed to only to end the worker's step
/// and answers with no values, and a pull does not ask it. A push-pull is then one request per shard, with
/// no pull after it
/// (until 2026-11-29 the empty answer sent every push-pull back for a pull of the whole model: twice the
/// requests and round trips on every cluster whose dense model does not reach every shard).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_pull_needs_no_pull_when_a_shard_owns_none_of_the_model() {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let small = Layout::new(vec![TensorSpec::new("w", 100)], 128).expect("layout");
    let s0 = start_shard_serving(&certs, 0, 2, None, Rule::Sgd, small.clone(), 0.1).await;
    let s1 = start_shard_serving(&certs, 1, 2, Some(s0.advertise.clone()), Rule::Sgd, small.clone(), 0.1).await;
    let client = Client::connect(options(&certs, &s0.advertise, Role::Worker)).await.expect("connect");
    let observer = Client::connect(options(&certs, &s0.advertise, Role::Observer)).await.expect("observer");
    assert_eq!(small.total_chunks(), 1, "one chunk, so one of the two shards owns none");
    let mut snapshot = client.pull().await.expect("pull");
    let pulls = |stats: Vec<wire::Stats>| stats.iter().map(|s| s.pulls).sum::<u64>();
    let before = pulls(client.stats().await.expect("stats"));
    for step in 1..=3u64 {
        let grads = vec![(0..100).map(|i| (i % 7) as f32 * 0.01).collect::<Vec<f32>>()];
        let (summary, next) = client.push_pull(grads, &snapshot).await.expect("push_pull");
        assert_eq!(summary.applied, 2, "step {step}: both shards took the push");
        assert_eq!(next, observer.pull().await.expect("pull"), "step {step}: what a pull right after reads");
        assert_eq!(next.versions, vec![step], "step {step}");
        snapshot = next;
    }
    // Each push-pull is a read on each shard, and each of the observer's pulls one on the shard that holds
    // the model (the other, owning nothing, is not asked); nothing more.
    let reads = pulls(client.stats().await.expect("stats")) - before;
    assert_eq!(reads, 3 * 2 + 3, "reads: {reads}");
    client.leave().await.expect("leave");
    shutdown(vec![s0, s1]).await;
}

/// A reply sink that records what `call_with` told it.
#[derive(Default)]
struct Recording {
    begins: u32,
    promised: bool,
    values: Vec<f32>,
}

impl net::ReplySink for Recording {
    fn begin(&mut self) {
        self.begins += 1;
        self.promised = false;
    }

    fn destination<'s>(&'s mut self, msg: &Message) -> Result<Option<Vec<&'s mut [f32]>>, String> {
        self.promised = true;
        self.values.resize(msg.payload_elems() as usize, 0.0);
        Ok(Some(vec![&mut self.values[..]]))
    }
}

/// A reply cut off in its values after its sink was given their destination, then a refusal of the call
/// sent again: the sink hears that each call begins, so the first reply's promise does not outlive it.
/// (Until 2026-11-29 a worker's push-pull or step sent again after such a cut and refused by a restored
/// shard returned a snapshot — and a step its next rows — whose part from that shard was never written.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_cut_off_in_its_values_promises_nothing_to_the_next_call() {
    use gaps_common::dtype::WireDtype;
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let tls = certs.shard_material(0).expect("tls");
    let (server, _) = net::server_endpoint("127.0.0.1:0".parse().expect("addr"), &tls).expect("endpoint");
    let addr = server.local_addr().expect("addr");
    let limits = Limits::default();
    let serving = tokio::spawn(async move {
        let conn = server.accept().await.expect("incoming").await.expect("connection");
        // The first call: a pull reply's header for 4 values, then 2 of them and the stream's end.
        let (mut send, mut recv) = conn.accept_bi().await.expect("stream");
        net::read_frame(&mut recv, &limits).await.expect("request");
        let chunk =
            wire::ChunkVersion { id: ChunkId { tensor: 0, chunk: 0 }, version: 1, len: 4, dtype: WireDtype::F32 };
        let reply = Message::PullReply(wire::PullReply { chunks: vec![chunk] });
        send.write_all(&wire::encode_header(&reply, 4).expect("header")).await.expect("write");
        send.write_all(&[0u8; 8]).await.expect("write");
        send.finish().expect("finish");
        // The second: refused.
        let (mut send, mut recv) = conn.accept_bi().await.expect("stream");
        net::read_frame(&mut recv, &limits).await.expect("request");
        let refusal = Message::error(ErrorCode::ReadAhead, "computed before this shard's restore");
        net::write_frame(&mut send, &refusal, &[]).await.expect("write");
        send.finish().expect("finish");
        conn.closed().await;
    });
    let endpoint = net::client_endpoint(&certs.worker_material().expect("tls"), addr).expect("endpoint");
    let conn = net::connect(&endpoint, addr, Duration::from_secs(5)).await.expect("connect");
    let pull = Message::Pull(wire::Pull { epoch: 1, chunks: vec![ChunkId { tensor: 0, chunk: 0 }] });
    let mut sink = Recording::default();
    let cut = net::call_with(&conn, &pull, &[], &limits, Duration::from_secs(5), &mut sink).await;
    assert!(cut.is_err(), "{cut:?}");
    assert!(sink.promised, "the cut-off reply's values were given a destination");
    let refused = net::call_with(&conn, &pull, &[], &limits, Duration::from_secs(5), &mut sink).await;
    assert!(matches!(refused, Err(net::RpcError::Remote { code: ErrorCode::ReadAhead, .. })), "{refused:?}");
    assert_eq!(sink.begins, 2, "one begin a call");
    assert!(!sink.promised, "a refusal promises no values");
    conn.close(0u32.into(), b"done");
    serving.await.expect("server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_gradient_is_pushed_as_it_is_and_left_unchanged_for_the_caller() {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    // DANA-Slim turns the gradient into the worker's Nesterov step on the client: into a copy of a shared one.
    for rule in [Rule::Sgd, Rule::DanaSlim] {
        let clusters = twin_clusters(&certs, 1, rule).await;
        let (owned, shared) = (&clusters[0].0, &clusters[1].0);
        let (mut a, mut b) = (owned.pull().await.expect("pull"), shared.pull().await.expect("pull"));
        let kept = std::sync::Arc::new(gradient(1));
        for step in 0..3 {
            owned.push(gradient(1), &a).await.expect("push");
            a = owned.pull().await.expect("pull");
            b = if step == 1 {
                shared.push_shared(kept.clone(), &b).await.expect("push_shared");
                shared.pull().await.expect("pull")
            } else {
                shared.push_pull_shared(kept.clone(), &b).await.expect("push_pull_shared").1
            };
            assert_eq!(a, b, "{rule} step {step}");
            assert_eq!(*kept, gradient(1), "{rule}: the caller's gradient is untouched");
        }
        stop_all(clusters).await;
    }
}

/// Payloads of megabytes are written past the cache on both sides (the pulled snapshot, the shard's copy of
/// a push) and checked on their wire bytes: the values are exactly those of the small-payload path, and a
/// NaN or infinity deep inside a bf16 or an f32 section is still refused with nothing changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn megabyte_payloads_go_past_the_cache_and_are_still_checked_value_by_value() {
    use gaps_common::dtype::{bf16_to_f32, f32_to_bf16, WireDtype};
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let mut big = TensorSpec::new("e", 700_000);
    big.wire_dtype = Some(WireDtype::Bf16);
    let l = Layout::new(vec![big, TensorSpec::new("d", 300_003)], 1 << 16).expect("layout");
    let server = start_shard_serving(&certs, 0, 1, None, Rule::Sgd, l.clone(), 0.0).await;
    let client = Client::connect(options(&certs, &server.advertise, Role::Worker)).await.expect("connect");
    let round = |x: f32| bf16_to_f32(f32_to_bf16(x));
    let grads: Vec<Vec<f32>> = l
        .tensors
        .iter()
        .map(|spec| (0..spec.len as u32).map(|i| ((i * 31) % 17) as f32 / 17.0 * 1.001_234_5 - 0.4999).collect())
        .collect();
    let s0 = client.pull().await.expect("pull");
    assert!(s0.tensors.iter().flatten().all(|v| *v == 0.0));
    let (_, s1) = client.push_pull(grads.clone(), &s0).await.expect("push-pull");
    for (i, g) in grads[0].iter().enumerate() {
        assert_eq!(s1.tensors[0][i], round(-LR * round(*g)), "bf16 element {i}");
    }
    for (i, g) in grads[1].iter().enumerate() {
        assert_eq!(s1.tensors[1][i], -LR * g, "f32 element {i}");
    }

    // Raw pushes with one bad value far into a section.
    let (_endpoint, conn) = connection_as(&certs, &server, &client).await;
    let msg = whole_push(&l, &client, 99, &s1.versions, |t| l.wire_dtype(t));
    let total = l.total_elems() as usize;
    // 0.25 everywhere but one value: `bad_half` at bf16 index `at_half`, `bad` at f32 index `at`.
    let frame = |at_half: usize, bad_half: u16, at: usize, bad: f32| {
        let mut bytes = wire::encode_header(&msg, total).expect("header");
        bytes.extend((0..700_000).flat_map(|i| if i == at_half { bad_half } else { 0x3e80u16 }.to_le_bytes()));
        bytes.extend((0..300_003).flat_map(|i| if i == at { bad } else { 0.25f32 }.to_le_bytes()));
        bytes
    };
    let expect = |reply: Message, what: &str| match reply {
        Message::Error(e) => assert_eq!(e.code, ErrorCode::NonFinite, "{what}: {}", e.message),
        other => panic!("{what}: expected an error, got {other:?}"),
    };
    let none = usize::MAX;
    expect(raw_request(&conn, &frame(650_001, 0x7fc0, none, 0.0)).await, "bf16 NaN");
    expect(raw_request(&conn, &frame(none, 0, 299_999, f32::NEG_INFINITY)).await, "f32 -infinity");
    expect(raw_request(&conn, &frame(none, 0, 123_457, f32::from_bits(0x7f80_0001))).await, "f32 signalling NaN");
    let again = client.pull().await.expect("pull");
    assert_eq!((&again.tensors, &again.versions), (&s1.tensors, &s1.versions), "a refused push changed the shard");
    match raw_request(&conn, &frame(none, 0, none, 0.0)).await {
        Message::Ack(a) => assert!(!a.duplicate),
        other => panic!("expected an ack, got {other:?}"),
    }
    let s2 = client.pull().await.expect("pull");
    // The shard's f32 state went on from the unrounded value; the pull rounds it once.
    assert_eq!(s2.tensors[0][650_001], round(-LR * round(grads[0][650_001]) - LR * 0.25));
    assert_eq!(s2.tensors[1][299_999], s1.tensors[1][299_999] - LR * 0.25);
    conn.close(0u32.into(), b"done");
    client.leave().await.expect("leave");
    server.shutdown().await.expect("shutdown");
}

/// Shard 0 of 1 serving `layout()` with SGD at `LR`, zero initial values and a 30 s lease, in `modes`.
fn one_shard(modes: gaps_shard::modes::ModeConfig) -> ShardConfig {
    ShardConfig {
        hyper: Hyper { lr: LR, momentum: 0.0, weight_decay: 0.0, ..Hyper::default() },
        init: Init { seed: 5, std: 0.0 },
        lease: Duration::from_secs(30),
        epoch: 77,
        modes,
        ..ShardConfig::new(layout())
    }
}

/// A worker waiting for a synchronous step is held by the shard until the step completes (a `WaitStep`),
/// or answered when its time is up with the step not reached — never polled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_a_step_is_held_until_the_step_or_its_time_is_up() {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let core = one_shard(gaps_shard::modes::ModeConfig { mode: gaps_shard::Mode::Sync, ..Default::default() });
    let cfg = ServiceConfig {
        tick_interval: Duration::from_millis(50),
        ..ServiceConfig::new("127.0.0.1:0".parse().expect("addr"), certs.shard_material(0).expect("tls"), core)
    };
    let server = service::start(cfg).await.expect("start");
    let a = Client::connect(options(&certs, &server.advertise, Role::Worker)).await.expect("a");
    let b = Client::connect(options(&certs, &server.advertise, Role::Worker)).await.expect("b");
    let (_endpoint, raw) = connection_as(&certs, &server, &a).await;
    let wait = |step, max_wait_ms| Message::WaitStep(wire::WaitStep { step, clock: 0, max_wait_ms });
    let ask = |msg: Message| {
        let raw = raw.clone();
        async move {
            match net::call(&raw, &msg, &[], &Limits::default(), Duration::from_secs(10)).await.expect("call").msg {
                Message::Stats(s) => s.global_step,
                other => panic!("a wait was answered with {other:?}"),
            }
        }
    };
    // Only a's gradient of step 1 is in: a wait for step 1 is answered when its time is up, step not reached.
    let sa = a.pull().await.expect("pull");
    let a_push = tokio::spawn({
        let a = a.clone();
        async move { a.push(gradient(1), &sa).await.map(drop) }
    });
    let observer = Client::connect(options(&certs, &server.advertise, Role::Observer)).await.expect("observer");
    while observer.stats().await.expect("stats")[0].pushes_applied < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(ask(wait(1, 100)).await, 0, "released by its deadline, the step not reached");
    // A wait held while b's gradient completes the step is answered with it.
    let held = tokio::spawn(ask(wait(1, 1000)));
    let sb = b.pull().await.expect("pull");
    b.push(gradient(2), &sb).await.expect("b's push");
    a_push.await.expect("join").expect("a's push");
    assert_eq!(held.await.expect("join"), 1, "released by the step");
    // A wait for a step already reached is answered at once.
    assert_eq!(ask(wait(1, 1000)).await, 1);
    // A held wait does not hold its connection up: a request on another stream of it is answered meanwhile
    // (the connection's task drives every stream in flight). The wait ends with step 2, below.
    let (mut send, mut recv) = raw.open_bi().await.expect("a stream");
    net::write_frame(&mut send, &wait(2, 10_000), &[]).await.expect("write the wait");
    send.finish().expect("finish");
    assert_eq!(ask(wait(1, 1000)).await, 1, "answered while the other stream's wait is held");
    let early = tokio::time::timeout(Duration::ZERO, net::read_frame(&mut recv, &Limits::default())).await;
    assert!(early.is_err(), "the wait for step 2 was answered before step 2: {early:?}");
    // A push-pull into a step not complete is held and answered, once b's gradient completes the step, with
    // the step's new values and nothing left to wait for.
    let Message::Push(push) = whole_push(&layout(), &a, 2, &[1, 1], |_| gaps_common::dtype::WireDtype::F32) else {
        panic!("a push")
    };
    let n: usize = push.chunks.iter().map(|c| c.len as usize).sum();
    let held = tokio::spawn({
        let raw = raw.clone();
        async move {
            let msg = Message::PushPull(push);
            net::call(&raw, &msg, &[net::f32_bytes(vec![0.25f32; n])], &Limits::default(), Duration::from_secs(10))
                .await
                .expect("call")
        }
    });
    let sb = b.pull().await.expect("pull");
    b.push(gradient(3), &sb).await.expect("b's second push");
    let reply = held.await.expect("join");
    match net::read_frame(&mut recv, &Limits::default()).await.expect("the wait's answer").msg {
        Message::Stats(s) => assert_eq!(s.global_step, 2, "released by step 2"),
        other => panic!("a wait was answered with {other:?}"),
    }
    match reply.msg {
        Message::PushPullReply(wire::PushPullReply { ack, chunks }) => {
            assert_eq!((ack.wait_for_step, ack.duplicate), (0, false), "{ack:?}");
            assert_eq!(chunks.iter().map(|c| c.version).collect::<Vec<_>>(), vec![2, 2], "the step's values");
            assert_eq!(reply.payload.len(), n);
        }
        other => panic!("a push-pull was answered with {other:?}"),
    }
    shutdown(vec![server]).await;
}

/// GBA's hold (`--gba-hold`): a push-pull that leaves its step short while another worker is due is held,
/// and answered with values either way — those of the step once the other worker's gradient completes it,
/// or the step read ahead when the hold's time is up — never with a wait for the worker to do itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gba_push_pull_is_held_for_its_step_and_answered_with_values_either_way() {
    let certs = ClusterCerts::generate(&[]).expect("certs");
    let core =
        one_shard(gaps_shard::modes::ModeConfig { mode: gaps_shard::Mode::Gba, gba_hold: 1.0, ..Default::default() });
    let cfg = ServiceConfig::new("127.0.0.1:0".parse().expect("addr"), certs.shard_material(0).expect("tls"), core);
    let server = service::start(cfg).await.expect("start");
    let a = Client::connect(options(&certs, &server.advertise, Role::Worker)).await.expect("a");
    let b = Client::connect(options(&certs, &server.advertise, Role::Worker)).await.expect("b");
    let observer = Client::connect(options(&certs, &server.advertise, Role::Observer)).await.expect("observer");
    let (_endpoint, raw) = connection_as(&certs, &server, &a).await;
    // Three rounds 50 ms apart, a then b: the shard sees each push about every 50 ms.
    let mut s = a.pull().await.expect("pull");
    for round in 0..3 {
        a.push(gradient(round), &s).await.expect("a's push");
        b.push(gradient(round + 10), &s).await.expect("b's push");
        s = a.pull().await.expect("pull");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(s.versions.iter().all(|v| *v == 3), "{:?}", s.versions);
    let push_pull = |seq: u64, versions: Vec<u64>| {
        let raw = raw.clone();
        let Message::Push(push) = whole_push(&layout(), &a, seq, &versions, |_| gaps_common::dtype::WireDtype::F32)
        else {
            panic!("a push")
        };
        let n: usize = push.chunks.iter().map(|c| c.len as usize).sum();
        tokio::spawn(async move {
            let msg = Message::PushPull(push);
            let payload = [net::f32_bytes(vec![0.25f32; n])];
            let reply = net::call(&raw, &msg, &payload, &Limits::default(), Duration::from_secs(10)).await;
            (reply.expect("call"), n)
        })
    };
    let applied = |count: u64| {
        let observer = &observer;
        async move {
            while observer.stats().await.expect("stats")[0].pushes_applied < count {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    };
    // a's push-pull goes first and b's completes the step: a is answered with values and nothing to wait
    // for — the step's (version 4) when b's push came within the hold, the step read ahead (version 3) when
    // not (a loaded machine).
    let held = push_pull(1000, s.versions.clone());
    applied(7).await;
    b.push(gradient(20), &s).await.expect("b's push");
    let (reply, n) = held.await.expect("join");
    let versions = match reply.msg {
        Message::PushPullReply(wire::PushPullReply { ack, chunks }) => {
            assert_eq!((ack.wait_for_step, ack.duplicate), (0, false), "{ack:?}");
            assert_eq!(reply.payload.len(), n, "values");
            chunks.iter().map(|c| c.version).collect::<Vec<_>>()
        }
        other => panic!("a push-pull was answered with {other:?}"),
    };
    assert!(versions.iter().all(|v| *v == 3) || versions.iter().all(|v| *v == 4), "{versions:?}");
    let now = a.pull().await.expect("pull");
    assert!(now.versions.iter().all(|v| *v == 4), "b's gradient completed the step");
    // b stays silent: a's next push-pull is answered when the hold's time is up (at most a second), with the
    // step read ahead (its own gradient in it) and the applied version.
    let (reply, n) = push_pull(1001, now.versions.clone()).await.expect("join");
    match reply.msg {
        Message::PushPullReply(wire::PushPullReply { ack, chunks }) => {
            assert_eq!(ack.wait_for_step, 0, "{ack:?}");
            assert_eq!(reply.payload.len(), n, "values");
            assert!(chunks.iter().all(|c| c.version == 4), "{chunks:?}");
        }
        other => panic!("a push-pull was answered with {other:?}"),
    }
    shutdown(vec![server]).await;
}

/// A worker's step in one request (`Message::Step`) through the service: in synchronous training it is held
/// like a push-pull until the step completes, then answered with the rows' ack, the step's values and its
/// next rows read then; in asynchronous training `Client::step` brings back the values and the next rows a
/// pull right after reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_is_held_for_a_synchronous_step_and_otherwise_brings_the_next_rows() {
    use gaps_common::layout::SparseSpec;
    let layout =
        Layout::with_tables(vec![TensorSpec::new("w", 300)], 128, vec![SparseSpec::new("emb", 4)]).expect("layout");
    let certs = ClusterCerts::generate(&[]).expect("certs");
    for mode in [gaps_shard::Mode::Sync, gaps_shard::Mode::Async] {
        let core = ShardConfig {
            layout: layout.clone(),
            ..one_shard(gaps_shard::modes::ModeConfig { mode, ..Default::default() })
        };
        let cfg = ServiceConfig::new("127.0.0.1:0".parse().expect("addr"), certs.shard_material(0).expect("tls"), core);
        let server = service::start(cfg).await.expect("start");
        let a = Client::connect(options(&certs, &server.advertise, Role::Worker)).await.expect("a");
        let b = Client::connect(options(&certs, &server.advertise, Role::Worker)).await.expect("b");
        let grads = |seed: f32| layout.tensors.iter().map(|t| vec![seed; t.len as usize]).collect::<Vec<_>>();
        let rows = a.pull_sparse(0, &[1, 2, 3], true).await.expect("rows");
        let dense = a.pull().await.expect("pull");
        if mode == gaps_shard::Mode::Async {
            let row_grads = vec![0.5f32; 12];
            let out = a.step(grads(0.25), &dense, (0, &rows, &row_grads), Some(&[3, 4, 5])).await.expect("step");
            assert_eq!(out.summary.applied, 2, "the rows and the dense push: {:?}", out.summary);
            let next = out.rows.expect("the next rows");
            assert_eq!(next.ids, vec![3, 4, 5]);
            let read = a.pull_sparse(0, &[3, 4, 5], false).await.expect("rows after");
            assert_eq!((&next.values, &next.versions), (&read.values, &read.versions), "what a pull right after reads");
            assert_ne!(read.versions[0], rows.versions[2], "row 3 was pushed before it was read");
            assert_eq!(out.dense.tensors, a.pull().await.expect("pull").tensors);
            shutdown(vec![server]).await;
            continue;
        }
        // Synchronous: a's step, sent raw, is held until b's push completes the step.
        let (_endpoint, raw) = connection_as(&certs, &server, &a).await;
        let Message::Push(push) = whole_push(&layout, &a, 2, &dense.versions, |_| gaps_common::dtype::WireDtype::F32)
        else {
            panic!("a push")
        };
        let row_push =
            wire::SparsePush { epoch: 77, worker: push.worker, seq: 1, table: 0, count: 3, dim: 4, echo_read: false };
        let mut payload = Vec::new();
        wire::ids_to_words(&[1, 2, 3], &mut payload);
        payload.extend(rows.versions.iter().map(|v| f32::from_bits(*v)));
        payload.extend([0.5f32; 12]);
        payload.extend(vec![0.25f32; 300]);
        wire::ids_to_words(&[3, 4], &mut payload);
        let next_rows = Some(wire::SparsePull { epoch: 77, table: 0, count: 2, create: true });
        let step = Message::Step(wire::Step { rows: Some(row_push), push, next_rows });
        let held = tokio::spawn({
            let raw = raw.clone();
            async move {
                let payload = [net::f32_bytes(payload)];
                net::call(&raw, &step, &payload, &Limits::default(), Duration::from_secs(10)).await.expect("call")
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!held.is_finished(), "answered before the step was complete");
        let sb = b.pull().await.expect("pull");
        b.push(grads(1.0), &sb).await.expect("b's push");
        let reply = held.await.expect("join");
        let Message::StepReply(wire::StepReply { rows: row_ack, push, next_rows }) = &reply.msg else {
            panic!("a step was answered with {:?}", reply.msg)
        };
        assert!(row_ack.is_some_and(|r| !r.duplicate), "{row_ack:?}");
        assert_eq!((push.ack.wait_for_step, push.ack.duplicate), (0, false), "{:?}", push.ack);
        assert!(push.chunks.iter().all(|c| c.version == 1), "the step's values: {:?}", push.chunks);
        assert_eq!(*next_rows, Some(wire::SparsePullReply { table: 0, count: 2, dim: 4 }), "read once released");
        assert_eq!(reply.payload.len(), 300 + 2 * 5);
        assert_eq!(reply.payload[..300], a.pull().await.expect("pull").tensors[0], "the completed step's values");
        let read = a.pull_sparse(0, &[3, 4], false).await.expect("rows after");
        let (versions, values) = reply.payload[300..].split_at(2);
        assert_eq!(versions.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), read.versions);
        assert_eq!(values, read.values, "the rows as the completed step left them");
        assert!(read.versions[0] > 0, "row 3 was pushed in the step: {:?}", read.versions);
        shutdown(vec![server]).await;
    }
}
