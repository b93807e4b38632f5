//! Tries, against a running shard, the impersonation attacks a certificate holder of the cluster could
//! attempt, with nothing but a raw QUIC connection (quinn, mutual TLS) and hand-made frames — no gaps
//! client library — and reports each outcome. Exits 1 if any was accepted.
//!
//! ```sh
//! cargo run -p gaps-server --example probe -- HOST:PORT ca.pem some-worker.pem some-worker.key [VICTIM_ID] [SHARD_INDEX]
//! ```
//!
//! Attacks: join as shard SHARD_INDEX (default 1); push, heartbeat and leave as worker VICTIM_ID (default 0);
//! bind the connection to VICTIM_ID with a forged credential; heartbeat for an id nobody registered. A
//! refused attack changes nothing; an accepted one may (a leave removes the victim's lease): point it at
//! a test cluster.

use gaps_common::wire::{
    Authenticate, ErrorCode, Frame, Heartbeat, Leave, Limits, Message, Push, Register, RegisterShard, Role,
    PROTOCOL_VERSION,
};
use gaps_transport::net::{self, RpcError};
use gaps_transport::tls::TlsMaterial;
use std::time::Duration;

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [addr, ca, cert, key, rest @ ..] = args.as_slice() else {
        anyhow::bail!("usage: probe HOST:PORT ca.pem cert.pem cert.key [VICTIM_ID] [SHARD_INDEX]");
    };
    let victim: u32 = rest.first().map_or(Ok(0), |v| v.parse())?;
    let shard: u32 = rest.get(1).map_or(Ok(1), |v| v.parse())?;
    let tls = TlsMaterial::load(ca.as_ref(), cert.as_ref(), key.as_ref())?;
    let addr = net::resolve(addr).await?;
    let endpoint = net::client_endpoint(&tls, addr)?;
    let conn = net::connect(&endpoint, addr, Duration::from_secs(5)).await?;
    let ask = |msg: Message| {
        let conn = conn.clone();
        async move { net::call(&conn, &msg, &[], &Limits::default(), Duration::from_secs(5)).await }
    };
    // What any certificate of the cluster may do: observe (to learn the epoch).
    let observe =
        Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Observer, name: "probe".into() });
    let epoch = match ask(observe).await {
        Ok(Frame { msg: Message::ClusterMap(map), .. }) => map.epoch,
        other => anyhow::bail!("could not observe the cluster (not the coordinator?): {other:?}"),
    };
    let attacks = [
        (
            format!("join as shard {shard}"),
            Message::RegisterShard(RegisterShard {
                protocol: PROTOCOL_VERSION,
                shard,
                num_shards: shard + 1,
                addr: "127.0.0.1:9".into(),
                layout_fingerprint: 0,
            }),
        ),
        (
            format!("push as worker {victim}"),
            Message::Push(Push {
                epoch,
                worker: victim,
                seq: 1 << 40,
                chunks: Vec::new(),
                compute_ms: 0,
                step: 0,
                decisions: Default::default(),
                data: None,
            }),
        ),
        (format!("heartbeat as worker {victim}"), Message::Heartbeat(Heartbeat { worker: victim })),
        (
            format!("authenticate as worker {victim} with a forged credential"),
            Message::Authenticate(Authenticate { worker: victim, token: [0; 32] }),
        ),
        ("heartbeat for worker 999999 (never registered)".into(), Message::Heartbeat(Heartbeat { worker: 999_999 })),
        (format!("leave as worker {victim}"), Message::Leave(Leave { worker: victim })),
    ];
    let mut accepted = 0;
    for (what, msg) in attacks {
        let outcome = match ask(msg).await {
            Err(RpcError::Remote { code, message, .. }) => {
                let leak = if message.contains("fingerprint") { " (LEAKS the layout fingerprint)" } else { "" };
                if code != ErrorCode::Unauthorized || !leak.is_empty() {
                    accepted += usize::from(!leak.is_empty());
                }
                format!("refused ({code:?}): {message}{leak}")
            }
            Err(e) => format!("failed: {e}"),
            Ok(reply) => {
                accepted += 1;
                format!("ACCEPTED: {}", net::kind_name(&reply.msg))
            }
        };
        println!("{what:<58} {outcome}");
    }
    conn.close(0u32.into(), b"probe done");
    if accepted > 0 {
        anyhow::bail!("{accepted} attack(s) accepted");
    }
    Ok(())
}
