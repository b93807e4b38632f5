//! The core's thread: the queue of commands it runs, a striped push put together, held requests (step
//! waits, GBA's held push-pulls) and their timer, checkpoints taken between two requests, and what it
//! writes besides its replies (the dealer's journal, the replica log, the request record).

use super::*;

/// What the QUIC tasks ask of the core's thread.
pub(super) enum Command {
    /// Handle one request frame (`finite`: its payload holds no NaN or ±∞, checked as it was read).
    Handle { frame: Box<Frame>, finite: bool, reply: oneshot::Sender<Answer> },
    /// Expire leases and idle rows; report the counters.
    Tick { reply: oneshot::Sender<(Vec<CoreEvent>, Stats)> },
    /// Read the core (tests, reports).
    Inspect(Box<dyn FnOnce(&ShardCore) + Send>),
    /// Change the core between two requests (a rollback replaces it); a checkpoint waiting for a point is
    /// given up, since the core it waited on is gone.
    Replace(Box<dyn FnOnce(&mut ShardCore) + Send>),
    /// Snapshot the core as checkpoint `id` into `buf` once it reaches `at`; the reply carries the snapshot,
    /// or the step the core had already passed. Dropping the reply's receiver gives it up.
    Checkpoint(PendingSnapshot),
    /// Snapshot the core for backup process `backup` (replicated shards): the log index it holds, and its
    /// bytes. The backup follows the log from that index on.
    ReplicaSnapshot { backup: u32, reply: oneshot::Sender<Result<(u64, Vec<u8>), String>> },
    /// A held request's time may be up (sent by a timer set when it was held).
    Wake,
}

/// The core's answer to one request: the reply, what changed, the parameter buffers the reply shares
/// instead of a payload (`ShardCore::set_shared_replies`), and the request's entry in the replica log (0:
/// none; the reply goes once every live backup applied it).
pub(super) type Answer = (Frame, Vec<CoreEvent>, Vec<Arc<Vec<f32>>>, u64);

/// Parameters a reply shares with the core, as the bytes of one payload part.
pub(super) struct SharedParams(pub(super) Arc<Vec<f32>>);

impl AsRef<[f32]> for SharedParams {
    fn as_ref(&self) -> &[f32] {
        &self.0
    }
}

/// A checkpoint the core takes when it reaches the point asked for.
pub(super) struct PendingSnapshot {
    pub(super) id: u64,
    pub(super) at: CheckpointAt,
    pub(super) buf: Vec<u8>,
    pub(super) reply: oneshot::Sender<Result<Snapshot, NoSnapshot>>,
}

/// The core's state, copied for a checkpoint.
pub(super) struct Snapshot {
    pub(super) bytes: Vec<u8>,
    /// How long the core paused to copy it.
    pub(super) pause: Duration,
    /// Synchronous/GBA steps applied when it was copied.
    pub(super) step: u64,
}

/// Why the core took no snapshot.
#[derive(Debug)]
pub(super) enum NoSnapshot {
    /// It is past the step asked for (it has applied this many).
    TooLate(u64),
    /// The device holding the dense state could not be read.
    Failed(String),
}

/// Takes `p` if the core is at its point; keeps it for later if not yet; answers it if never.
pub(super) fn try_snapshot(
    core: &ShardCore,
    p: PendingSnapshot,
    record: &mut Option<crate::record::Recorder>,
) -> Option<PendingSnapshot> {
    if p.reply.is_closed() {
        return None;
    }
    match core.checkpoint_readiness(p.at) {
        Readiness::Later => Some(p),
        Readiness::Never(step) => {
            let _ = p.reply.send(Err(NoSnapshot::TooLate(step)));
            None
        }
        Readiness::Ready => {
            let started = Instant::now();
            let taken = match core.checkpoint_into(p.id, p.buf) {
                Ok(bytes) => {
                    if let Some(r) = record {
                        r.item(&crate::record::Item::Checkpoint { id: p.id });
                    }
                    Ok(Snapshot { bytes, pause: started.elapsed(), step: core.global_step() })
                }
                Err(e) => Err(NoSnapshot::Failed(e.to_string())),
            };
            let _ = p.reply.send(taken);
            None
        }
    }
}

/// Where the core's thread writes what it handled besides its replies.
pub(super) struct Sinks {
    /// The dealer's journal (the coordinator, async).
    pub(super) journal: Option<std::fs::File>,
    /// The replica log its backups follow.
    pub(super) log: Option<Arc<Log>>,
    /// The request record (`--record-requests`).
    pub(super) record: Option<crate::record::Recorder>,
}

/// The core's thread's state, shared by the thread and the connections' tasks: a task runs a small request
/// itself when the core is idle ([`CoreQueue::try_inline`]) instead of handing it over and waiting for two
/// thread wake-ups. Whoever runs a command holds the lock for that one command.
pub(super) type Seat = Arc<std::sync::Mutex<Actor>>;

/// The way to the core: its queue and its seat.
#[derive(Clone)]
pub(super) struct CoreQueue {
    pub(super) sender: mpsc::Sender<Command>,
    pub(super) seat: Seat,
}

/// Elements of the largest request a connection's task runs inline — the larger of what it carries and what
/// its reply can hold — and rows of the most embedding rows it reads or updates ([`request_rows`]): 1-2 ms
/// of the core's work at most on this project's 2-core development VM (a row read and updated costs ~250 ns
/// in a 10 M-row table, and a row created ~1 µs), and a request that could make a table grow its index,
/// metadata or arena (a cost in proportion to the table) goes to the queue
/// ([`gaps_shard::ShardCore::table_has_room_for`]). Meanwhile the runtime's other threads, where it has
/// more than one (`--io-threads`), take the other tasks, and with one they wait that long; what the queue
/// saves is two thread wake-ups a request. Measured 2026-11-29
/// (`gaps bench transport --only sparse`, 4,096 rows of 16): rows/s +10-14 % with one shard and +31-37 %
/// with two against 16 Ki elements (which sent every row request of a training step to the core's thread),
/// end to end unchanged.
const INLINE_MAX_ELEMS: u64 = 128 * 1024;
/// See [`INLINE_MAX_ELEMS`].
const INLINE_MAX_ROWS: u64 = 8 * 1024;

impl CoreQueue {
    /// Runs `frame` on the calling task and returns the receiver of its answer, when it is a small training
    /// request (by the larger of its payload's and its reply's elements, and by its rows; rows it may create
    /// fit in their table as it is) and the core is idle:
    /// no command queued, no one running one, no checkpoint waiting for its point (whose copy would run here),
    /// no request record, no request held (which a step would release here). A push runs inline only in
    /// asynchronous training, where it applies its own gradient and never a whole synchronous step. Otherwise
    /// gives the frame back, for the queue.
    pub(super) fn try_inline(&self, frame: Box<Frame>, finite: bool) -> Result<oneshot::Receiver<Answer>, Box<Frame>> {
        let push =
            matches!(frame.msg, Message::Push(_) | Message::PushPull(_) | Message::SparsePush(_) | Message::Step(_));
        let kind = push || matches!(frame.msg, Message::Pull(_) | Message::SparsePull(_) | Message::Heartbeat(_));
        let carried = frame.msg.payload_elems().max(frame.payload.len() as u64);
        let rows = request_rows(&frame.msg);
        if !kind
            || carried > INLINE_MAX_ELEMS
            || rows > INLINE_MAX_ROWS
            || self.sender.capacity() < self.sender.max_capacity()
        {
            return Err(frame);
        }
        let Ok(mut actor) = self.seat.try_lock() else { return Err(frame) };
        let stepped = push && actor.core.active_mode() != gaps_shard::Mode::Async;
        let answered = reply_elems(&actor.core.config().layout, &frame.msg);
        let creates = match &frame.msg {
            Message::SparsePull(p) if p.create => Some(p),
            Message::Step(s) => s.next_rows.as_ref().filter(|p| p.create),
            _ => None,
        };
        if stepped
            || answered > INLINE_MAX_ELEMS
            || creates.is_some_and(|p| !actor.core.table_has_room_for(p.table, u64::from(p.count)))
            || actor.pending.is_some()
            || actor.record.is_some()
            || !actor.parked.is_empty()
        {
            return Err(frame);
        }
        let (tx, rx) = oneshot::channel();
        actor.run(Command::Handle { frame, finite, reply: tx });
        actor.after_command();
        Ok(rx)
    }
}

/// Embedding rows `msg` reads or updates: a row pull's and a row push's, a step's both.
fn request_rows(msg: &Message) -> u64 {
    match msg {
        Message::SparsePull(p) => u64::from(p.count),
        Message::SparsePush(p) => u64::from(p.count),
        Message::Step(s) => {
            s.rows.as_ref().map_or(0, |r| u64::from(r.count)) + s.next_rows.as_ref().map_or(0, |r| u64::from(r.count))
        }
        _ => 0,
    }
}

/// Elements the reply to `msg` carries at most (values of the chunks a pull names, rows and their versions
/// of a row pull), counted up to just past [`INLINE_MAX_ELEMS`].
fn reply_elems(layout: &gaps_common::layout::Layout, msg: &Message) -> u64 {
    let chunks = |ids: &mut dyn Iterator<Item = gaps_common::layout::ChunkId>| {
        let mut total = 0u64;
        for id in ids {
            total += layout.chunk_len(id).unwrap_or(0) as u64;
            if total > INLINE_MAX_ELEMS {
                break;
            }
        }
        total
    };
    let rows = |p: &gaps_common::wire::SparsePull| {
        let dim = layout.tables.get(p.table as usize).map_or(0, |t| u64::from(t.dim));
        u64::from(p.count) * (1 + dim)
    };
    match msg {
        Message::Pull(p) => chunks(&mut p.chunks.iter().copied()),
        Message::PushPull(p) => chunks(&mut p.chunks.iter().map(|c| c.id)),
        Message::SparsePull(p) => rows(p),
        Message::Step(s) => chunks(&mut s.push.chunks.iter().map(|c| c.id)) + s.next_rows.as_ref().map_or(0, rows),
        _ => 0,
    }
}

/// Seats the core: its state as the core's thread and the connections' tasks share it.
pub(super) fn seat(core: ShardCore, started: Instant, part_wait: Duration, sinks: Sinks, wake: Alarm) -> Seat {
    let Sinks { journal, log, record } = sinks;
    Arc::new(std::sync::Mutex::new(Actor {
        core,
        started,
        part_wait,
        journal,
        log,
        record,
        wake,
        pending: None,
        parts: Assembler::default(),
        parked: Vec::new(),
    }))
}

/// Runs the core's commands on the calling thread until every sender of `queue` is gone (or a command
/// panicked: the requests it held are let go, and the service sees its thread stopped). A checkpoint waiting for its
/// step is checked after every command, so it is taken right after the request that completed the step,
/// before any other is handled.
///
/// The parts of a push striped over several connections are held here until the push is whole, then handled
/// as one request and every part answered with its reply; incomplete pushes are given up after `part_wait`.
pub(super) fn run_actor(seat: Seat, mut queue: mpsc::Receiver<Command>) {
    // Should a command panic on this thread, the requests the core holds are let go as the thread unwinds.
    let _let_go = LetGo(&seat);
    while let Some(command) = queue.blocking_recv() {
        // A command that panicked on a connection's task left the lock poisoned: this thread ends the same way.
        let Ok(mut actor) = seat.lock() else { return };
        actor.run(command);
        actor.after_command();
    }
}

/// Lets every request the core holds go when the core's thread ends after a panic (here or on a
/// connection's task): the state outlives the thread (the connections share it), so without this a held
/// request's waiter would wait for a thread that is gone instead of seeing the core gone.
struct LetGo<'a>(&'a Seat);

impl Drop for LetGo<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() || self.0.is_poisoned() {
            let mut actor = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            actor.parked.clear();
            actor.pending = None;
            actor.parts = Assembler::default();
        }
    }
}

/// A part's reply and whether its payload was found finite as it was read.
type PartReply = (oneshot::Sender<Answer>, bool);

/// The core's thread's state: the core, what it writes besides its replies, and what it holds between
/// commands (a checkpoint waiting for its point, the parts of striped pushes, held requests).
pub(super) struct Actor {
    core: ShardCore,
    started: Instant,
    part_wait: Duration,
    journal: Option<std::fs::File>,
    log: Option<Arc<Log>>,
    record: Option<crate::record::Recorder>,
    wake: Alarm,
    pending: Option<PendingSnapshot>,
    parts: Assembler<PartReply>,
    parked: Vec<ParkedWait>,
}

impl Actor {
    fn run(&mut self, command: Command) {
        match command {
            Command::Handle { frame, finite, reply } => match frame.msg {
                Message::PushPart(part) if !self.core.push_applied(part.push.worker, part.push.seq) => {
                    self.push_part(part, frame.payload, finite, reply)
                }
                // A wait for a step not reached yet is held here (not in the core, which never blocks) until the
                // step comes or its time is up, instead of the worker polling.
                Message::WaitStep(wait)
                    if wait.max_wait_ms > 0
                        && !self.core.wait_satisfied(&wait)
                        && self.parked.len() < MAX_PARKED_WAITS =>
                {
                    let ms = wait.max_wait_ms.min(gaps_common::wire::MAX_WAIT_STEP_MS);
                    self.parked.push((
                        HeldRequest::Wait(wait),
                        self.started.elapsed() + Duration::from_millis(u64::from(ms)),
                        reply,
                    ));
                }
                // A part of a push applied before is answered by the core, as a duplicate.
                msg => self.request(Frame { msg, payload: frame.payload }, finite, reply),
            },
            Command::Wake => self.wake.rang(self.started.elapsed()),
            Command::Tick { reply } => {
                for ((reply, _), frame) in self.parts.expire(self.started.elapsed(), self.part_wait) {
                    let _ = reply.send((frame, Vec::new(), Vec::new(), 0));
                }
                let now = self.started.elapsed();
                let index = self.log.as_ref().map_or(0, |log| log.tick(now));
                if let Some(r) = &mut self.record {
                    r.tick(index, now);
                }
                let events = self.core.tick(now);
                let _ = reply.send((events, self.core.stats()));
            }
            Command::Inspect(f) => f(&self.core),
            Command::Replace(f) => {
                f(&mut self.core);
                self.pending = None;
                if let Some(r) = &mut self.record {
                    r.item(&crate::record::Item::Replaced);
                }
                // The backups' copies do not continue the replaced core: each copies a new snapshot.
                if let Some(log) = &self.log {
                    log.reset();
                }
            }
            Command::Checkpoint(p) => self.pending = Some(p),
            Command::ReplicaSnapshot { backup, reply } => self.replica_snapshot(backup, reply),
        }
    }

    /// What follows every command: the dealer's changes journaled (before a checkpoint can be taken after
    /// them), a checkpoint waiting for this point taken, held requests whose step came answered.
    fn after_command(&mut self) {
        journal_changes(&mut self.core, &mut self.journal);
        if let Some(p) = self.pending.take() {
            self.pending = try_snapshot(&self.core, p, &mut self.record);
        }
        if !self.parked.is_empty() {
            self.release_waits(self.started.elapsed());
            self.wake.arm(&self.parked, self.started.elapsed());
        }
    }

    /// Logs a request for the backups and the request record; a request that cannot be logged for the
    /// backups is refused, unhandled. The request's index in the replica log (0: none).
    fn log_request(&mut self, now: Duration, frame: &Frame) -> Result<u64, Box<Frame>> {
        let index = self
            .log
            .as_ref()
            .map_or(Ok(0), |l| l.request(now, frame))
            .map_err(|(code, msg)| Box::new(Frame::new(Message::error(code, msg))))?;
        if let Some(r) = &mut self.record {
            r.request(index, now, frame);
        }
        Ok(index)
    }

    /// One part of a striped push: held until the push is whole, then handled as one request and every part
    /// answered with its reply.
    fn push_part(
        &mut self,
        part: gaps_common::wire::PushPart,
        payload: Vec<f32>,
        finite: bool,
        reply: oneshot::Sender<Answer>,
    ) {
        let offered = self.parts.offer(part, payload, (reply, finite), self.started.elapsed());
        for ((reply, _), frame) in offered.answer_now {
            let _ = reply.send((frame, Vec::new(), Vec::new(), 0));
        }
        let Some((whole, replies)) = offered.whole else { return };
        let finite = replies.iter().all(|(_, f)| *f);
        let now = self.started.elapsed();
        let index = match self.log_request(now, &whole) {
            Ok(index) => index,
            Err(refusal) => {
                for (reply, _) in replies {
                    let _ = reply.send((*refusal.clone(), Vec::new(), Vec::new(), 0));
                }
                return;
            }
        };
        let (answer, mut events) = self.core.handle_checked(whole, now, finite);
        for (reply, _) in replies {
            let _ = reply.send((answer.clone(), std::mem::take(&mut events), Vec::new(), index));
        }
    }

    /// Any other request: handled by the core and answered, or held (a push-pull waiting for its step).
    fn request(&mut self, frame: Frame, finite: bool, reply: oneshot::Sender<Answer>) {
        let read = |p: &gaps_common::wire::Push| gaps_common::wire::Pull {
            epoch: p.epoch,
            chunks: p.chunks.iter().map(|c| c.id).collect(),
        };
        let pull = match &frame.msg {
            Message::PushPull(p) => Some(read(p)),
            Message::Step(s) => Some(read(&s.push)),
            _ => None,
        };
        // A step's next rows, kept to be read when the step is held and released (a hold only comes outside
        // asynchronous training; there the ids are not copied).
        let next = match &frame.msg {
            Message::Step(s) if self.core.active_mode() != gaps_shard::Mode::Async => s.next_rows.map(|p| {
                let from = frame.payload.len().saturating_sub(p.payload_elems() as usize);
                (p, frame.payload[from..].to_vec())
            }),
            _ => None,
        };
        let now = self.started.elapsed();
        let index = match self.log_request(now, &frame) {
            Ok(index) => index,
            Err(refusal) => {
                let _ = reply.send((*refusal, Vec::new(), Vec::new(), 0));
                return;
            }
        };
        let (mut answer, events) = self.core.handle_checked(frame, now, finite);
        // The replica log's lag is the process's, not the core's (a backup's core knows none).
        if let (Some(log), Message::Stats(stats)) = (&self.log, &mut answer.msg) {
            (stats.replica_lag_entries, stats.replica_lag_peak) = log.lag();
            stats.replica_copies = log.copies();
        }
        // A split dealt or reported finished is journaled before the worker hears of it.
        journal_changes(&mut self.core, &mut self.journal);
        let gba_hold = pull.as_ref().and(self.core.take_gba_hold());
        let room = self.parked.len() < MAX_PARKED_WAITS;
        // A push-pull's or a step's answer without values: its ack, and a step's rows' ack.
        let unread = match &answer.msg {
            Message::PushPullReply(PushPullReply { ack, chunks }) if chunks.is_empty() => Some((*ack, None)),
            Message::StepReply(StepReply { rows, push: PushPullReply { ack, chunks }, next_rows: None })
                if chunks.is_empty() =>
            {
                Some((*ack, Some(Box::new(HeldStep { rows: *rows, next }))))
            }
            _ => None,
        };
        match (pull, unread) {
            // A GBA push-pull held for its step (see `gaps_shard`'s `hold`): answered with the values once the
            // step is applied or the hold's short time is up, whichever is first.
            (Some(pull), Some((ack, step))) if gba_hold.is_some() && room => {
                let until = gba_hold.unwrap_or(now);
                let ack = gaps_common::wire::Ack { wait_for_step: self.core.global_step() + 1, ..ack };
                let held = HeldRequest::PushPull { ack, step, pull, events, index, soft: true };
                self.parked.push((held, until, reply));
            }
            // A push-pull whose ack asks the worker to wait for the step: held until the step is applied, then
            // answered with the new values (no wait request, no pull after it).
            (Some(pull), Some((ack, step))) if (ack.wait_for_step > 0 || ack.wait_for_clock > 0) && room => {
                let held = HeldRequest::PushPull { ack, step, pull, events, index, soft: false };
                self.parked.push((held, self.started.elapsed() + HOLD_PUSH_PULL, reply));
            }
            _ => {
                let _ = reply.send((answer, events, self.core.take_reply_views(), index));
            }
        }
    }

    /// A copy of the core for backup process `backup`, with the log index it follows from.
    fn replica_snapshot(&mut self, backup: u32, reply: oneshot::Sender<Result<(u64, Vec<u8>), String>>) {
        let began = Instant::now();
        let taken = match &self.log {
            Some(log) => self.core.copy_state().map(|bytes| (log.follow(backup), bytes)).map_err(|e| e.to_string()),
            None => Err("this shard keeps no replica log".into()),
        };
        if let (Some(log), Ok(_)) = (&self.log, &taken) {
            log.snapshot_taken(backup, began.elapsed());
        }
        if let (Some(r), Ok((index, _))) = (&mut self.record, &taken) {
            r.item(&crate::record::Item::Followed { backup, index: *index });
        }
        let _ = reply.send(taken);
    }
}

/// Wakes the core's thread at the earliest deadline of the held GBA push-pulls (the thread blocks on its
/// queue between requests; ticks come every 250 ms, a hold lasts milliseconds). One timer is armed at a
/// time, for the earliest deadline; a later hold arms nothing while an earlier timer is pending.
pub(super) struct Alarm {
    pub(super) runtime: tokio::runtime::Handle,
    pub(super) queue: mpsc::WeakSender<Command>,
    /// When the armed timer rings, if one is.
    pub(super) armed: Option<Duration>,
}

impl Alarm {
    /// Arms the timer for the earliest deadline of the soft holds in `parked`, unless one rings by then.
    pub(super) fn arm(&mut self, parked: &[ParkedWait], now: Duration) {
        let earliest = parked
            .iter()
            .filter(|(held, _, _)| matches!(held, HeldRequest::PushPull { soft: true, .. }))
            .map(|(_, until, _)| *until)
            .min();
        let Some(at) = earliest else { return };
        if self.armed.is_some_and(|armed| armed <= at) {
            return;
        }
        self.armed = Some(at);
        let (queue, after) = (self.queue.clone(), at.saturating_sub(now));
        self.runtime.spawn(async move {
            tokio::time::sleep(after).await;
            if let Some(queue) = queue.upgrade() {
                let _ = queue.send(Command::Wake).await;
            }
        });
    }

    /// A [`Command::Wake`] came at `now`: the timer armed for then or before has rung.
    pub(super) fn rang(&mut self, now: Duration) {
        if self.armed.is_some_and(|armed| armed <= now + Duration::from_millis(1)) {
            self.armed = None;
        }
    }
}

/// Appends the dealer's changes since the last call to the coordinator's journal (async); a journal that
/// cannot be written is given up, said once.
pub(super) fn journal_changes(core: &mut ShardCore, journal: &mut Option<std::fs::File>) {
    let Some(file) = journal.as_mut() else { return };
    let changes = core.take_dealer_journal();
    if changes.is_empty() {
        return;
    }
    if let Err(e) = crate::journal::append(file, &changes) {
        error!(%e, "writing the dealer journal failed; a restore will deal again the splits finished since its checkpoint");
        core.stop_dealer_journal();
        *journal = None;
    }
}

/// Most [`Message::WaitStep`] requests a shard holds at once (one per worker is the norm); more are
/// answered at once.
pub(super) const MAX_PARKED_WAITS: usize = 8192;

/// How long a push-pull whose step is not complete is held for the step's values before it is answered
/// with its ack alone (the worker then waits with [`Message::WaitStep`] and pulls).
pub(super) const HOLD_PUSH_PULL: Duration = Duration::from_secs(1);

/// What a held request waits for.
pub(super) enum HeldRequest {
    /// A [`Message::WaitStep`]: answered with the shard's stats.
    Wait(gaps_common::wire::WaitStep),
    /// A push-pull applied into a step not yet complete: answered with `ack` and the values `pull` reads once
    /// the step is applied (with the events of the push). `soft` (GBA's hold): when the time is up first,
    /// answered with the values read then, and the worker goes on; otherwise with the ack alone, and the
    /// worker waits for the step itself. A worker's step (`step`) is answered as one, with its next rows read
    /// after the values.
    PushPull {
        ack: gaps_common::wire::Ack,
        /// A worker's step (boxed: the variant stays as small as a push-pull's).
        step: Option<Box<HeldStep>>,
        pull: gaps_common::wire::Pull,
        events: Vec<CoreEvent>,
        index: u64,
        soft: bool,
    },
}

/// What a held worker's step adds to a held push-pull.
pub(super) struct HeldStep {
    /// The rows' ack.
    rows: Option<gaps_common::wire::Ack>,
    /// The next rows to read once the values are (their ids), where the step asked for them.
    next: Option<(gaps_common::wire::SparsePull, Vec<f32>)>,
}

/// A held request: what it waits for, until when, and where its answer goes.
pub(super) type ParkedWait = (HeldRequest, Duration, oneshot::Sender<Answer>);

impl Actor {
    /// Answers the held requests whose step came, and those whose time is up at `now`.
    fn release_waits(&mut self, now: Duration) {
        let satisfied = |core: &ShardCore, held: &HeldRequest| match held {
            HeldRequest::Wait(wait) => core.wait_satisfied(wait),
            HeldRequest::PushPull { ack, .. } => core.wait_satisfied(&gaps_common::wire::WaitStep {
                step: ack.wait_for_step,
                clock: ack.wait_for_clock,
                max_wait_ms: 0,
            }),
        };
        if !self.parked.iter().any(|(held, until, _)| satisfied(&self.core, held) || now >= *until) {
            return;
        }
        let mut stats = None;
        for (held, until, reply) in std::mem::take(&mut self.parked) {
            let ready = satisfied(&self.core, &held);
            if !(ready || now >= until) {
                self.parked.push((held, until, reply));
                continue;
            }
            let answer = match held {
                HeldRequest::Wait(_) => {
                    let stats = stats.get_or_insert_with(|| Frame::new(Message::Stats(self.core.stats())));
                    (stats.clone(), Vec::new(), Vec::new(), 0)
                }
                HeldRequest::PushPull { ack, step, pull, events, index, soft } => {
                    let go_on = gaps_common::wire::Ack { wait_for_step: 0, wait_for_clock: 0, ..ack };
                    // A hold's ack asks for no wait: the worker goes on with what it reads.
                    let ack = if soft { go_on } else { ack };
                    let (rows_ack, next) = match step {
                        Some(held) => (Some(held.rows), held.next),
                        None => (None, None),
                    };
                    let answer = |push: PushPullReply, next_rows| match rows_ack {
                        Some(rows) => Message::StepReply(StepReply { rows, push, next_rows }),
                        None => Message::PushPullReply(push),
                    };
                    let alone = (Frame::new(answer(PushPullReply { ack, chunks: Vec::new() }, None)), Vec::new(), 0);
                    let (frame, views, read_at) = if !(ready || soft) {
                        alone
                    } else {
                        match self.core.handle(Frame::new(Message::Pull(pull)), now).0 {
                            Frame { msg: Message::PullReply(PullReply { chunks }), mut payload } => {
                                let mut views = self.core.take_reply_views();
                                let (rows, at) = match next.and_then(|(p, ids)| self.read_rows(p, ids, now)) {
                                    Some((reply, values, at)) => {
                                        gaps_shard::append_reply_values(&mut payload, &mut views, values);
                                        (Some(reply), at)
                                    }
                                    None => (None, 0),
                                };
                                (Frame { msg: answer(PushPullReply { ack: go_on, chunks }, rows), payload }, views, at)
                            }
                            // The read failed: the ack alone, and the worker pulls on its own.
                            _ => alone,
                        }
                    };
                    (frame, events, views, index.max(read_at))
                }
            };
            let _ = reply.send(answer);
        }
    }

    /// A released step's next rows, read as a [`Message::SparsePull`] of its own — logged for the backups
    /// (it creates rows), so its answer waits for them as the log index says: (the reply, its values, the
    /// index). None where it cannot be logged or is refused (the worker pulls the rows itself).
    fn read_rows(
        &mut self,
        pull: gaps_common::wire::SparsePull,
        ids: Vec<f32>,
        now: Duration,
    ) -> Option<(gaps_common::wire::SparsePullReply, Vec<f32>, u64)> {
        let frame = Frame { msg: Message::SparsePull(pull), payload: ids };
        let index = self.log_request(now, &frame).ok()?;
        match self.core.handle(frame, now).0 {
            Frame { msg: Message::SparsePullReply(reply), payload } => Some((reply, payload, index)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests;
