//! Whole clusters on the virtual clock of `gaps_shard::testnet`: what once needed real processes and the
//! wall clock (the automatic mode switch, seeded chaos) runs here deterministically — the same seed gives
//! the same run to the message, on any machine under any load.

use gaps_shard::testnet::{chaos_schedule, Cluster, Fault, Report, Spec};
use gaps_shard::Mode;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(600);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// One worker of four computes 4× slower for the first 1.5 s of a 300-step job (about 3 s): the coordinator
/// switches the cluster to GBA, every shard at the same step, and back to sync once it recovers; no gradient
/// is dropped at the switches.
#[test]
fn auto_mode_switches_to_gba_on_a_straggler_and_back_when_it_recovers() {
    let mut cluster = Cluster::new(Spec::new(2, 4, Mode::Auto, 300, 7)).expect("cluster");
    cluster.at(Duration::ZERO, Fault::Slow { worker: 1, factor: 4.0, until: ms(1500) });
    let r = cluster.run(LIMIT).expect("the job finishes");
    let switches = &r.switches[0];
    assert!(switches.len() >= 2, "{switches:?}");
    assert_eq!((switches[0].from, switches[0].to), (Mode::Sync.code(), Mode::Gba.code()), "{switches:?}");
    assert!(switches[0].reason.contains("x the median"), "{switches:?}");
    assert_eq!((switches[1].from, switches[1].to), (Mode::Gba.code(), Mode::Sync.code()), "{switches:?}");
    // One list for the cluster, decided by the coordinator, carried out by both shards at the same steps.
    let steps = |s: &[gaps_common::wire::ModeSwitchRecord]| -> Vec<_> {
        s.iter().map(|x| (x.number, x.from, x.to, x.from_step, x.at_global_step)).collect()
    };
    assert_eq!(steps(&r.switches[0]), steps(&r.switches[1]));
    assert!(r.stats.iter().all(|s| s.steps_sync > 0 && s.steps_gba > 0), "{:?}", r.stats);
    assert_eq!(r.pushes_sent, r.pushes_acknowledged, "{r:?}");
    assert_eq!(r.pushes_acknowledged, r.pushes_applied, "{r:?}");
    assert!(r.stats.iter().all(|s| s.pushes_dropped_at_switch == 0), "{:?}", r.stats);
    assert!(r.final_loss < r.initial_loss / 2.0, "{r:?}");
    // Without the straggler the cluster stays synchronous.
    let calm = Cluster::new(Spec::new(2, 4, Mode::Auto, 300, 7)).expect("cluster").run(LIMIT).expect("finishes");
    assert!(calm.switches[0].is_empty(), "{:?}", calm.switches);
}

/// Both shards (the coordinator too) killed and restarted from their checkpoints and a worker killed and
/// another added, at times drawn from `seed`; returns the report with the schedule. The books balance: no
/// push applied twice, none applied that a surviving worker did not see acknowledged, some lost with the
/// crashes (what came after a checkpoint) but under a quarter.
fn chaos(seed: u64, steps: u64, mode: Mode) -> (Report, Vec<(Duration, Fault)>) {
    let schedule = chaos_schedule(seed);
    let last_restart = schedule.iter().filter(|(_, f)| matches!(f, Fault::RestartShard(_))).map(|(at, _)| *at).max();
    let spec =
        Spec { checkpoint_every: Some(ms(500)), lease: Duration::from_secs(1), ..Spec::new(2, 4, mode, steps, seed) };
    let mut cluster = Cluster::new(spec).expect("cluster");
    for (at, fault) in &schedule {
        cluster.at(*at, fault.clone());
    }
    let r = cluster.run(LIMIT).unwrap_or_else(|e| panic!("{schedule:?}: {e}"));
    assert!(Some(r.now) > last_restart, "the job outlasts the schedule: {schedule:?}: {r:?}");
    assert_eq!(r.workers_final, 4, "{schedule:?}: {r:?}");
    assert_eq!(r.pushes_applied_twice, 0, "{schedule:?}: {r:?}");
    assert!(r.pushes_applied <= r.pushes_acknowledged + r.pushes_unconfirmed, "{schedule:?}: {r:?}");
    assert_eq!(r.pushes_applied_unacknowledged, 0, "{schedule:?}: {r:?}");
    // A worker registered after the coordinator's checkpoint keeps its id through the coordinator's
    // restart (its heartbeats are taken) and nobody gets it again.
    assert!(r.heartbeats_refused.is_empty(), "{schedule:?}: {:?}", r.heartbeats_refused);
    let mut ids = r.worker_ids.clone();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), r.worker_ids.len(), "one id per worker: {:?}", r.worker_ids);
    assert!(r.pushes_lost > 0, "a crash after a checkpoint loses what came after it: {schedule:?}: {r:?}");
    assert!(r.pushes_lost < r.pushes_acknowledged / 4, "{schedule:?}: {r:?}");
    assert!(r.final_loss < r.initial_loss / 2.0, "{schedule:?}: {r:?}");
    (r, schedule)
}

#[test]
fn chaos_shards_and_workers_killed_at_seeded_times_and_the_job_still_finishes() {
    let (r, schedule) = chaos(20261123, 400, Mode::Async);
    let calm = Cluster::new(Spec { checkpoint_every: Some(ms(500)), ..Spec::new(2, 4, Mode::Async, 400, 20261123) })
        .expect("cluster")
        .run(LIMIT)
        .expect("finishes");
    assert!(r.final_loss < 1.5 * calm.final_loss.max(1e-3), "chaos {r:?} vs undisturbed {calm:?}: {schedule:?}");
}

#[test]
fn chaos_over_seeds_and_modes() {
    for mode in [Mode::Async, Mode::Sync, Mode::Gba] {
        for seed in [1, 2, 3] {
            chaos(seed, 600, mode);
        }
    }
}

/// Requests and replies lost on the way (5 % of messages) are sent again with the same sequence numbers:
/// every push is applied exactly once.
#[test]
fn a_lossy_network_loses_and_doubles_no_push() {
    for mode in [Mode::Async, Mode::Sync] {
        let spec = Spec { loss: 0.05, ..Spec::new(2, 3, mode, 150, 11) };
        let r = Cluster::new(spec).expect("cluster").run(LIMIT).expect("finishes");
        assert_eq!(r.pushes_sent, 2 * 3 * 150, "{r:?}");
        assert_eq!(
            (r.pushes_acknowledged, r.pushes_applied, r.pushes_applied_twice),
            (r.pushes_sent, r.pushes_sent, 0)
        );
        assert_eq!((r.pushes_lost, r.pushes_applied_unacknowledged), (0, 0), "{r:?}");
        // Every synchronous step holds one gradient of each worker: a worker whose ack was lost and who
        // sent its push again still waits for the step (its next gradient does not join the same step).
        if mode == Mode::Sync {
            let steps: Vec<u64> = r.stats.iter().map(|s| s.steps_sync).collect();
            assert_eq!(steps, [150, 150], "{r:?}");
        }
        assert!(r.stats.iter().map(|s| s.pushes_duplicate).sum::<u64>() > 0, "some pushes arrived twice: {r:?}");
        assert!(r.final_loss < r.initial_loss / 2.0, "{r:?}");
    }
}

/// The harness itself: the same seed gives the same run, another seed another.
#[test]
fn the_same_seed_gives_the_same_run() {
    let run = |seed| {
        let spec = Spec { loss: 0.02, checkpoint_every: Some(ms(300)), ..Spec::new(3, 5, Mode::Auto, 120, seed) };
        let mut c = Cluster::new(spec).expect("cluster");
        c.at(ms(200), Fault::Slow { worker: 2, factor: 5.0, until: ms(900) });
        c.at(ms(400), Fault::KillShard(2));
        c.at(ms(700), Fault::RestartShard(2));
        format!("{:?}", c.run(LIMIT).expect("finishes"))
    };
    assert_eq!(run(5), run(5));
    assert_ne!(run(5), run(6));
}

/// The periodic checkpoint schedule on the virtual clock — the service's own (`gaps_shard::schedule`), which
/// `server/tests/checkpoints.rs` can only check on a real service as "some were written": the coordinator's
/// cluster checkpoint every interval, on every shard; while the coordinator is down, shard 1 takes its own
/// once two intervals passed without one; the coordinator started again keeps its schedule from its new
/// start, and the cluster checkpoints resume on both.
#[test]
fn periodic_checkpoints_follow_the_coordinator_and_a_shard_goes_on_alone_while_it_is_down() {
    let spec =
        Spec { checkpoint_every: Some(ms(500)), lease: Duration::from_secs(1), ..Spec::new(2, 4, Mode::Async, 600, 5) };
    let mut cluster = Cluster::new(spec).expect("cluster");
    cluster.at(ms(1200), Fault::KillShard(0));
    cluster.at(ms(3200), Fault::RestartShard(0));
    let r = cluster.run(LIMIT).expect("finishes");
    assert!(r.now > ms(4500), "the job outlasts what is checked: {r:?}");
    let until = |times: &[Duration]| times.iter().copied().filter(|t| *t <= ms(4500)).collect::<Vec<_>>();
    assert_eq!(until(&r.checkpoints_at[0]), [500, 1000, 3700, 4200].map(ms), "{:?}", r.checkpoints_at);
    assert_eq!(until(&r.checkpoints_at[1]), [500, 1000, 2000, 3000, 3700, 4200].map(ms), "{:?}", r.checkpoints_at);
    assert_eq!(r.pushes_applied_twice, 0);
}
