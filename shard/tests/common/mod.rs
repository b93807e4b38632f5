//! Helpers the shard's integration tests share: one request through a core, a worker's registration.
#![allow(dead_code)] // each test file is its own crate and uses some of them

use gaps_common::wire::{Frame, Message, Register, Role, PROTOCOL_VERSION};
use gaps_shard::ShardCore;
use std::time::Duration;

/// `msg` with `payload` through `core` at one second of shard time; the reply.
pub fn call(core: &mut ShardCore, msg: Message, payload: Vec<f32>) -> Frame {
    core.handle(Frame { msg, payload }, Duration::from_secs(1)).0
}

/// Registers a worker with `core`; its id.
pub fn register(core: &mut ShardCore) -> u32 {
    let reg = Register { protocol: PROTOCOL_VERSION, role: Role::Worker, name: "w".into() };
    match call(core, Message::Register(reg), vec![]).msg {
        Message::ClusterMap(m) => m.worker_id.expect("id"),
        other => panic!("{other:?}"),
    }
}

/// A sparse push to table 0 (rows of `dim`) as a worker sends it: the row ids as words, the versions read,
/// then the gradients.
pub fn sparse_push_frame(
    epoch: u64,
    worker: u32,
    seq: u64,
    dim: u32,
    ids: &[u64],
    versions: &[u32],
    grads: &[f32],
) -> Frame {
    let mut payload = Vec::new();
    gaps_common::wire::ids_to_words(ids, &mut payload);
    payload.extend(versions.iter().map(|v| f32::from_bits(*v)));
    payload.extend_from_slice(grads);
    let count = ids.len() as u32;
    let push = gaps_common::wire::SparsePush { epoch, worker, seq, table: 0, count, dim, echo_read: false };
    Frame { msg: Message::SparsePush(push), payload }
}
