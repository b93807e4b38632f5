//! Helpers the shard's integration tests share: one request through a core, a worker's registration.

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
