//! The tokio runtime a `gaps server` or `gaps worker` process runs on, sized by `--io-threads`.
//!
//! A request crosses several tasks on its way (quinn's endpoint driver reads the datagram, the connection's
//! driver decrypts it, the stream's task reads and answers it, and back): on a runtime of several threads
//! each hand-off may wake another thread, which costs a futex call, a context switch and, on a virtual
//! machine, an inter-processor interrupt. Measured on 2 cores (docs/results.md, "One runtime thread a
//! process"), a worker and a shard of one runtime thread each move a 1,000-float push-pull in 0.7–0.8 of
//! the time and CPU of two threads each, and a 1 Mi-float one 1.2 times as fast. More threads pay where
//! one process's packet work fills a core: a shard that many workers push to at once.

/// Which process a runtime is for (their automatic sizes differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoRole {
    /// A shard: one runtime thread per 4 cores, at least one (large updates run on threads of their own).
    Shard,
    /// A worker (and a client of the cluster): with one lane (its connections to each shard; the default)
    /// none — a current-thread runtime, whose one connection a shard the training thread drives itself
    /// while it awaits a step, heartbeats going from a thread of their own — and with more, one thread per
    /// lane, carrying its traffic beside the training loop (on the thread that called `block_on`). A
    /// current-thread worker saves the two wake-ups between the caller and the runtime's thread that every
    /// exchange costs otherwise (docs/results.md, "The caller's hand-off").
    Worker {
        /// Connections to each shard (`--lanes`).
        lanes: usize,
    },
}

/// The largest `--io-threads`.
pub const MAX_IO_THREADS: usize = 1024;

/// The runtime threads for `requested` (0: automatic, see [`IoRole`]) on a host of `cores` cores; 0 for
/// none of its own (the caller's thread drives it: [`build`]).
pub fn io_threads_for(requested: usize, role: IoRole, cores: usize) -> usize {
    if requested > 0 {
        return requested.min(MAX_IO_THREADS);
    }
    match role {
        IoRole::Shard => (cores / 4).max(1),
        IoRole::Worker { lanes } if lanes <= 1 => 0,
        IoRole::Worker { lanes } => lanes.min(MAX_IO_THREADS),
    }
}

/// [`io_threads_for`] on this host.
pub fn io_threads(requested: usize, role: IoRole) -> usize {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    io_threads_for(requested, role, cores)
}

/// A runtime of `threads` worker threads, named `gaps-io`, with I/O and timers: the multi-threaded kind
/// even for one thread, so that `block_in_place` ([`compute`]) works; for 0 the current-thread kind, whose
/// tasks and I/O run on the thread in `block_on` while it awaits.
pub fn build(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    if threads == 0 {
        return tokio::runtime::Builder::new_current_thread().enable_all().build();
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.min(MAX_IO_THREADS))
        .thread_name("gaps-io")
        .enable_all()
        .build()
}

/// Runs `work` (blocking, no awaiting: reading a checkpoint) from a runtime task without holding up the
/// runtime's other tasks — on a shard of one runtime thread, every connection — for its length:
/// `block_in_place` on a multi-threaded runtime (which hands this thread's other tasks to another thread;
/// on the thread that called `block_on`, where there are none, it just runs `work`), directly on a
/// current-thread one (tests).
pub fn compute<R>(work: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn automatic_sizes_follow_the_role_and_the_cores() {
        assert_eq!(io_threads_for(0, IoRole::Worker { lanes: 1 }, 64), 0, "one lane: the caller's thread");
        assert_eq!(io_threads_for(0, IoRole::Worker { lanes: 4 }, 2), 4);
        assert_eq!(io_threads_for(0, IoRole::Worker { lanes: 0 }, 2), 0);
        assert_eq!(io_threads_for(1, IoRole::Worker { lanes: 1 }, 2), 1);
        assert_eq!(io_threads_for(0, IoRole::Shard, 2), 1);
        assert_eq!(io_threads_for(0, IoRole::Shard, 7), 1);
        assert_eq!(io_threads_for(0, IoRole::Shard, 8), 2);
        assert_eq!(io_threads_for(0, IoRole::Shard, 64), 16);
        assert_eq!(io_threads_for(3, IoRole::Shard, 64), 3);
        assert_eq!(io_threads_for(3, IoRole::Worker { lanes: 4 }, 2), 3);
        assert_eq!(io_threads_for(1 << 20, IoRole::Worker { lanes: 1 }, 2), MAX_IO_THREADS);
    }

    #[test]
    fn compute_runs_on_both_flavors_and_keeps_a_one_thread_runtime_serving() {
        // Current-thread runtime (a worker's of one lane): run in place.
        let rt = build(0).expect("runtime");
        assert_eq!(rt.handle().runtime_flavor(), tokio::runtime::RuntimeFlavor::CurrentThread);
        assert_eq!(rt.block_on(async { compute(|| 6 * 7) }), 42);
        // One worker thread: a task spawned by the task that computes runs while the compute blocks (it
        // waits in that thread's own queue; without block_in_place the wait below would time out).
        let rt = build(1).expect("runtime");
        let answered = rt.block_on(async {
            tokio::spawn(async {
                let (tx, rx) = std::sync::mpsc::channel();
                let other = tokio::spawn(async move { tx.send(()).expect("send") });
                let got = compute(|| rx.recv_timeout(std::time::Duration::from_secs(5)).is_ok());
                other.await.expect("task");
                got
            })
            .await
            .expect("task")
        });
        assert!(answered, "the runtime's other task did not run while the compute blocked");
    }
}
