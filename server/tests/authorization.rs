//! Authorization over the network, tried by an attacker that is not the project's client: a raw QUIC
//! connection (quinn, the cluster's mutual TLS) sending hand-made frames. Every attack the security issue
//! measured is tried with a valid certificate of the cluster CA and must be refused with a typed error,
//! while the real worker's training all applies.

mod common;

use gaps_common::layout::{Layout, TensorSpec};
use gaps_common::wire::{
    Authenticate, ErrorCode, Frame, Heartbeat, Leave, Limits, Message, Push, PushChunk, Register, RegisterShard, Role,
    PROTOCOL_VERSION,
};
use gaps_kernels::Hyper;
use gaps_server::service::{self, RunningServer, ServiceConfig};
use gaps_setup::certs::{CertOptions, CertificateAuthority, ClusterCerts};
use gaps_shard::{Init, ShardConfig};
use gaps_transport::net;
use gaps_transport::tls::TlsMaterial;
use gaps_worker::client::{Client, ClientOptions};
use std::time::Duration;

fn layout() -> Layout {
    Layout::new(vec![TensorSpec::new("w", 40)], 16).expect("layout")
}

fn core_config(shard: u32, num_shards: u32) -> ShardConfig {
    ShardConfig {
        shard,
        num_shards,
        hyper: Hyper { lr: 0.1, momentum: 0.0, ..Hyper::default() },
        init: Init { seed: 1, std: 0.1 },
        epoch: 31,
        ..ShardConfig::new(layout())
    }
}

async fn start_shard(certs: &ClusterCerts, shard: u32, num_shards: u32, coordinator: Option<String>) -> RunningServer {
    let core = core_config(shard, num_shards);
    let cfg = ServiceConfig {
        coordinator,
        join_timeout: Duration::from_secs(10),
        ..ServiceConfig::new("127.0.0.1:0".parse().expect("addr"), certs.shard_material(shard).expect("tls"), core)
    };
    service::start(cfg).await.expect("start shard")
}

fn certs() -> ClusterCerts {
    let opts = CertOptions { shards: 3, workers: vec!["worker".into(), "mallory".into()], ..CertOptions::default() };
    ClusterCerts::make(&opts, None).expect("certs")
}

/// A raw connection to `addr` with `tls` (no gaps client).
async fn raw(tls: &TlsMaterial, addr: std::net::SocketAddr) -> quinn::Connection {
    let endpoint = net::client_endpoint(tls, addr).expect("endpoint");
    net::connect(&endpoint, addr, Duration::from_secs(5)).await.expect("connect")
}

async fn ask(conn: &quinn::Connection, msg: Message, payload: &[f32]) -> Result<Frame, net::RpcError> {
    net::call(conn, &msg, &[net::f32_bytes_copied(payload)], &Limits::default(), Duration::from_secs(5)).await
}

fn refused(result: Result<Frame, net::RpcError>, what: &str) -> String {
    match result {
        Err(net::RpcError::Remote { code: ErrorCode::Unauthorized, message, .. }) => {
            assert!(!message.contains("fingerprint"), "{what}: the refusal leaks the layout: {message}");
            message
        }
        other => panic!("{what} was not refused as unauthorized: {other:?}"),
    }
}

fn push(worker: u32, seq: u64) -> (Message, Vec<f32>) {
    let chunks = layout()
        .chunks()
        .enumerate()
        .filter(|(g, _)| g % 2 == 1) // shard 1 of 2 owns the odd chunks
        .map(|(_, id)| PushChunk::f32(id, 0, layout().chunk_len(id).expect("len") as u32))
        .collect::<Vec<_>>();
    let n: usize = chunks.iter().map(|c| c.len as usize).sum();
    (Message::Push(Push { compute_ms: 1, ..Push::new(31, worker, seq, chunks) }), vec![0.5; n])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_certificate_of_the_cluster_acts_as_another_shard_or_worker() {
    let certs = certs();
    let s0 = start_shard(&certs, 0, 2, None).await;
    let s1 = start_shard(&certs, 1, 2, Some(s0.advertise.clone())).await;
    let mallory = certs.named_worker_material("mallory").expect("tls");

    // 1. A worker certificate cannot join as a shard (nor move one): refused, nothing about the layout.
    let conn = raw(&mallory, s0.addr).await;
    let join = |shard| {
        Message::RegisterShard(RegisterShard {
            protocol: PROTOCOL_VERSION,
            shard,
            num_shards: 2,
            addr: "127.0.0.1:9".into(),
            layout_fingerprint: layout().fingerprint(),
        })
    };
    refused(ask(&conn, join(1), &[]).await, "a worker certificate joining as shard 1");
    // 2. A shard certificate cannot join under another index.
    let shard2 = raw(&certs.shard_material(2).expect("tls"), s0.addr).await;
    refused(ask(&shard2, join(1), &[]).await, "shard 2's certificate joining as shard 1");
    // Shard 1's address is where it was: a new worker still trains.
    let o = common::options(&certs, &s0.advertise, Role::Worker, "real", Duration::from_secs(5));
    let real = Client::connect(o).await.expect("the real worker connects to both shards");
    let victim = real.worker_id().expect("id");

    // 3. Another worker — even registered, even with the same certificate — cannot push, heartbeat or leave
    //    as the real worker, nor bind its connection to it with its own credential.
    let reg = Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Worker, name: "m".into() });
    for (tls, what) in
        [(&mallory, "another certificate"), (&certs.worker_material().expect("tls"), "the same certificate")]
    {
        let to_s0 = raw(tls, s0.addr).await;
        let Frame { msg: Message::ClusterMap(map), .. } = ask(&to_s0, reg.clone(), &[]).await.expect("register") else {
            panic!("no map")
        };
        let (own_id, own_token) = (map.worker_id.expect("id"), map.token.expect("token"));
        assert_ne!(own_id, victim);
        let to_s1 = raw(tls, s1.addr).await;
        for seq in 1..=20 {
            let (msg, payload) = push(victim, seq);
            refused(ask(&to_s1, msg, &payload).await, &format!("{what}: a push as worker {victim}"));
        }
        refused(ask(&to_s1, Message::Heartbeat(Heartbeat { worker: victim }), &[]).await, "a foreign heartbeat");
        refused(ask(&to_s1, Message::Leave(Leave { worker: victim }), &[]).await, "a foreign leave");
        // Nor take (or give back) the real worker's data split at the coordinator.
        let split = |worker| {
            Message::SplitRequest(gaps_common::wire::SplitRequest { epoch: map.epoch, worker, finished: None })
        };
        refused(ask(&to_s0, split(victim), &[]).await, &format!("{what}: a split request as worker {victim}"));
        let steal = Message::Authenticate(Authenticate { worker: victim, token: own_token });
        refused(ask(&to_s1, steal, &[]).await, &format!("{what}: its own token for worker {victim}"));
        // A heartbeat for an id nobody registered (what stalled synchronous training) is refused too.
        refused(ask(&to_s1, Message::Heartbeat(Heartbeat { worker: 999 }), &[]).await, "an unregistered id");
        // Its own id works once authenticated: the checks refuse impersonation, not workers.
        let me = Message::Authenticate(Authenticate { worker: own_id, token: own_token });
        assert!(matches!(ask(&to_s1, me, &[]).await.expect("auth").msg, Message::Authenticated(_)), "{what}");
        let hb = ask(&to_s1, Message::Heartbeat(Heartbeat { worker: own_id }), &[]).await.expect("own heartbeat");
        assert!(matches!(hb.msg, Message::HeartbeatAck(_)));
        let leave = ask(&to_s1, Message::Leave(Leave { worker: own_id }), &[]).await.expect("own leave");
        assert!(matches!(leave.msg, Message::HeartbeatAck(_)));
    }
    // A shard certificate is dealt no data, whoever it names (on a bound connection or not).
    let shard1 = raw(&certs.shard_material(1).expect("tls"), s0.addr).await;
    for worker in [0, victim, 999] {
        let split = Message::SplitRequest(gaps_common::wire::SplitRequest { epoch: 0, worker, finished: None });
        let why = refused(ask(&shard1, split, &[]).await, "a shard certificate asking for a split");
        assert!(why.contains("not a worker certificate"), "{why}");
    }
    // 4. A credential does not travel to another certificate: the real worker's token from mallory's
    //    certificate is refused (it is bound to the registrant's identity).
    let (id, token) = real.credential().expect("credential");
    let to_s1 = raw(&mallory, s1.addr).await;
    refused(ask(&to_s1, Message::Authenticate(Authenticate { worker: id, token }), &[]).await, "a stolen token");

    // The real worker's pushes all apply (none counted as a duplicate of a forged one).
    for _ in 0..15 {
        let s = real.pull().await.expect("pull");
        let g = s.tensors.iter().map(|t| vec![0.1; t.len()]).collect();
        real.push(g, &s).await.expect("push");
    }
    let stats = real.stats().await.expect("stats");
    for st in &stats {
        assert_eq!(st.pushes_applied, 15, "shard {}: {st:?}", st.shard);
        assert_eq!(st.pushes_duplicate, 0, "shard {}: {st:?}", st.shard);
    }
    assert!(s0.unauthorized() >= 2 && s1.unauthorized() >= 40, "{} {}", s0.unauthorized(), s1.unauthorized());
    real.leave().await.expect("leave");
    real.close().await;
    s1.shutdown().await.expect("shutdown");
    s0.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_of_another_cluster_or_role_or_ca_are_refused_with_the_reason() {
    let certs = certs();
    let s0 = start_shard(&certs, 0, 1, None).await;
    // Same CA, another cluster name: refused at the connection, and the client is told why.
    let ca = CertificateAuthority::load(certs.ca.clone()).expect("ca");
    let other =
        ClusterCerts::make(&CertOptions { cluster: "other".into(), shards: 1, ..CertOptions::default() }, Some(&ca))
            .expect("other cluster");
    let o = ClientOptions::new(&s0.advertise, other.worker_material().expect("tls"), Role::Observer, "x");
    let err = Client::connect(o).await.expect_err("another cluster");
    let text = format!("{err:#}");
    assert!(text.contains("expected a shard of cluster \"other\""), "{text}");
    let conn = raw(&other.worker_material().expect("tls"), s0.addr).await;
    let reg = Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Observer, name: "x".into() });
    let err = ask(&conn, reg.clone(), &[]).await.expect_err("closed");
    assert!(err.to_string().contains("another cluster"), "{err}");

    // A shard certificate cannot register a worker.
    let conn = raw(&certs.shard_material(2).expect("tls"), s0.addr).await;
    let as_worker = Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Worker, name: "s".into() });
    refused(ask(&conn, as_worker, &[]).await, "a shard certificate registering a worker");

    // A certificate from another CA: the client says it is the CA, not "connection lost".
    let foreign = ClusterCerts::generate(&[]).expect("foreign");
    let impostor = TlsMaterial {
        ca: certs.worker_material().expect("tls").ca,
        identity: foreign.worker_material().expect("tls").identity,
    };
    let endpoint = net::client_endpoint(&impostor, s0.addr).expect("endpoint");
    let outcome = match net::connect(&endpoint, s0.addr, Duration::from_secs(5)).await {
        Err(e) => e.to_string(),
        Ok(conn) => ask(&conn, reg, &[]).await.expect_err("refused").to_string(),
    };
    assert!(outcome.contains("unknown_ca") || outcome.contains("TLS alert"), "{outcome}");
    s0.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_rotate_without_a_restart() {
    let old = certs();
    let s0 = start_shard(&old, 0, 1, None).await;
    let o = common::options(&old, &s0.advertise, Role::Worker, "before", Duration::from_secs(5));
    let before = Client::connect(o).await.expect("connect with the old material");

    // A new CA; during the move both are trusted. The shard takes its new certificate without a restart.
    let new = certs();
    let both = |m: TlsMaterial| TlsMaterial { ca: [old.ca_certs(), new.ca_certs()].concat(), ..m };
    let wrong = both(new.shard_material(1).expect("tls"));
    assert!(s0.reload_tls(&wrong).is_err(), "a certificate of another shard is refused");
    s0.reload_tls(&both(new.shard_material(0).expect("tls"))).expect("reload");

    // New connections use the new certificate: a worker that trusts only the new CA gets in.
    let o = common::options(&new, &s0.advertise, Role::Worker, "after", Duration::from_secs(5));
    let after = Client::connect(o).await.expect("connect with the new material");
    // The open connection of the old worker keeps working.
    let s = before.pull().await.expect("old connection");
    before.push(s.tensors.iter().map(|t| vec![0.1; t.len()]).collect(), &s).await.expect("old worker pushes");
    let s = after.pull().await.expect("new connection");
    after.push(s.tensors.iter().map(|t| vec![0.1; t.len()]).collect(), &s).await.expect("new worker pushes");
    // A worker rotates too: its new certificate (same identity, new CA) is used for new connections.
    before.reload_tls(&both(new.worker_material().expect("tls"))).expect("worker reload");
    let other_name = both(new.named_worker_material("mallory").expect("tls"));
    assert!(before.reload_tls(&other_name).is_err(), "a certificate of another identity is refused");
    for c in [before, after] {
        c.leave().await.expect("leave");
        c.close().await;
    }
    s0.shutdown().await.expect("shutdown");
}

/// One certificate may hold at most `max_workers_per_certificate` live workers: a flood of registrations
/// from a raw client is refused past the cap, another certificate still registers, and a worker that
/// leaves makes room again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_registers_at_most_its_cap_of_live_workers() {
    let certs = certs();
    let core = core_config(0, 1);
    let cfg = ServiceConfig {
        max_workers_per_certificate: 3,
        ..ServiceConfig::new("127.0.0.1:0".parse().expect("addr"), certs.shard_material(0).expect("tls"), core)
    };
    let server = service::start(cfg).await.expect("start");
    let mallory = certs.named_worker_material("mallory").expect("tls");
    let conn = raw(&mallory, server.addr).await;
    let register = || Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Worker, name: "m".into() });
    let mut ids = Vec::new();
    for _ in 0..3 {
        match ask(&conn, register(), &[]).await.expect("registered").msg {
            Message::ClusterMap(map) => ids.push((map.worker_id.expect("id"), map.token.expect("token"))),
            other => panic!("{other:?}"),
        }
    }
    for _ in 0..20 {
        match ask(&conn, register(), &[]).await {
            Err(net::RpcError::Remote { code: ErrorCode::Unauthorized, message, .. }) => {
                assert!(message.contains("max-workers-per-certificate"), "{message}")
            }
            other => panic!("a registration past the cap must be refused, got {other:?}"),
        }
    }
    // Another certificate is not affected.
    let o = common::options(&certs, &server.advertise, Role::Worker, "honest", Duration::from_secs(10));
    let honest = Client::connect(o).await.expect("another certificate registers");
    // One of mallory's workers leaves (on a connection authenticated as it): one more may register.
    let (w, token) = ids[0];
    let leaving = raw(&mallory, server.addr).await;
    ask(&leaving, Message::Authenticate(Authenticate { worker: w, token }), &[]).await.expect("authenticate");
    ask(&leaving, Message::Leave(Leave { worker: w }), &[]).await.expect("leave");
    assert!(matches!(ask(&conn, register(), &[]).await.expect("room again").msg, Message::ClusterMap(_)));
    honest.leave().await.expect("leave");
    server.shutdown().await.expect("shutdown");
}

/// Replicated shards (`--replicas 2`): only shard i's certificate replicates shard i, only a process speaks
/// for itself to the coordinator, a takeover of a live primary is refused, and bad replication input from
/// the right certificate is a typed error that leaves the copies working — tried with hand-made frames.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_shards_own_certificate_replicates_it_and_no_live_primary_is_taken_over() {
    use gaps_common::wire::{bytes_to_words, Promote, ReplicaAppend, ReplicaReport, ReplicaSnapshot};
    let certs = certs();
    let start = |shard: u32, coordinator: Option<String>| {
        let core = core_config(shard, 2);
        let cfg = ServiceConfig {
            coordinator,
            join_timeout: Duration::from_secs(10),
            replicas: 2,
            ..ServiceConfig::new("127.0.0.1:0".parse().expect("addr"), certs.shard_material(shard).expect("tls"), core)
        };
        service::start(cfg)
    };
    let s0 = start(0, None).await.expect("shard 0");
    let s1 = start(1, Some(s0.advertise.clone())).await.expect("shard 1");
    for _ in 0..400 {
        if s0.live_backups() == 1 && s1.live_backups() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!((s0.live_backups(), s1.live_backups()), (1, 1), "both copies count");
    let append = |shard, first, entries: &[u8], lens: Vec<u32>| {
        let mut words = Vec::new();
        bytes_to_words(entries, &mut words);
        (Message::ReplicaAppend(ReplicaAppend { shard, first, lens }), words)
    };
    let snapshot = |shard| Message::ReplicaSnapshot(ReplicaSnapshot { shard, index: 1, offset: 0, total: 8, bytes: 8 });
    let promote = |process| Message::Promote(Promote { shard: 1, process, epoch: 0, addr: "127.0.0.1:9".into() });
    let report = |process| Message::ReplicaReport(ReplicaReport { shard: 1, process, epoch: 0, in_sync: vec![] });
    // A worker certificate: nothing.
    let mallory = raw(&certs.named_worker_material("mallory").expect("tls"), s0.addr).await;
    let (msg, words) = append(1, 1, &[0; 8], vec![8]);
    refused(ask(&mallory, msg, &words).await, "a worker's log entries");
    refused(ask(&mallory, snapshot(1), &[0.0, 0.0]).await, "a worker's snapshot");
    refused(ask(&mallory, promote(0), &[]).await, "a worker's takeover");
    refused(ask(&mallory, report(1), &[]).await, "a worker's report");
    // Another shard's certificate (shard 2 of the CA): not shard 1's log, not speaking for process 1 or 0.
    let shard2 = raw(&certs.shard_material(2).expect("tls"), s0.addr).await;
    let (msg, words) = append(1, 1, &[0; 8], vec![8]);
    refused(ask(&shard2, msg, &words).await, "shard 2's certificate sending shard 1's log");
    refused(ask(&shard2, promote(0), &[]).await, "shard 2's certificate speaking for process 0");
    refused(ask(&shard2, report(1), &[]).await, "shard 2's certificate reporting for process 1");
    // The coordinator's own certificate asks to take live shard 1 over: refused, the primary answers.
    let shard0 = raw(&certs.shard_material(0).expect("tls"), s0.addr).await;
    match ask(&shard0, promote(0), &[]).await {
        Err(net::RpcError::Remote { code: ErrorCode::Misconfigured, message, .. }) => {
            assert!(message.contains("answers"), "{message}")
        }
        other => panic!("a takeover of a live primary: {other:?}"),
    }
    // Shard 1's own certificate with bad input to its backup (process 0): typed errors.
    let shard1 = raw(&certs.shard_material(1).expect("tls"), s0.addr).await;
    let (msg, words) = append(1, u64::MAX, &[1, 2, 3], vec![3]);
    assert!(matches!(ask(&shard1, msg, &words).await, Err(net::RpcError::Remote { .. })), "entries out of order");
    let (msg, words) = append(1, 1, &[1, 2, 3], vec![30]);
    assert!(ask(&shard1, msg, &words).await.is_err(), "entries longer than the payload");
    assert!(ask(&shard1, snapshot(0), &[0.0, 0.0]).await.is_err(), "shard 0's snapshot from shard 1");
    // The copies still count and the real worker trains through both shards, every push acknowledged.
    let o = common::options(&certs, &s0.advertise, Role::Worker, "real", Duration::from_secs(10));
    let real = Client::connect(o).await.expect("connect");
    for _ in 0..10 {
        let s = real.pull().await.expect("pull");
        let g = s.tensors.iter().map(|t| vec![0.1; t.len()]).collect();
        real.push(g, &s).await.expect("push");
    }
    assert_eq!(real.pushes_acknowledged_by_shard(), vec![10, 10]);
    assert_eq!((s0.live_backups(), s1.live_backups()), (1, 1), "the copies still count");
    real.leave().await.expect("leave");
    real.close().await;
    s1.shutdown().await.expect("shutdown");
    s0.shutdown().await.expect("shutdown");
}
