//! Shard 0's configuration, chosen by a majority of the shard processes (replicated shards, step 4 of
//! docs/replication.md: the coordinator's own fail-over).
//!
//! The coordinator decides who serves every other shard, but nobody is above shard 0 to decide who serves
//! it. Two decisions about it can conflict: the coordinator going on without a backup that stopped
//! answering (its replies stop waiting for that backup), and that backup taking shard 0 over because the
//! coordinator went silent. Both at once would lose acknowledged pushes, so each is a new
//! [`CoordinatorConfig`] — who serves shard 0, where, with which backups in sync — and each version of
//! the configuration is chosen once by single-decree Paxos among all the shard processes: every process is
//! an [`Acceptor`]; the coordinator (dropping or adding backups) and a backup in sync (taking over) are
//! [`Proposer`]s. A proposal is chosen once a majority accepted it; a proposer that meets an earlier
//! accepted value carries that value on, so two different configurations are never chosen for one version,
//! whatever the messages lost, repeated or reordered (the randomised test below drives it so).
//!
//! Sans-IO, like the shard core: the service sends the messages and keeps the acceptor's state across
//! restarts.

use bincode::{Decode, Encode};

/// Who serves shard 0 (the coordinator), where, and which of its backups hold every acknowledged request.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct CoordinatorConfig {
    /// Chosen versions count from 0 (the cluster's start: process 0 serves shard 0).
    pub version: u64,
    /// The shard process serving shard 0.
    pub serving: u32,
    /// Its address.
    pub addr: String,
    /// The backups its replies wait for (only these may take shard 0 over), sorted.
    pub in_sync: Vec<u32>,
}

impl CoordinatorConfig {
    /// Whether `next` may follow `self`: the next version, served by the same process (backups added or
    /// dropped) or by one of its backups in sync (a takeover, with no backup in sync yet).
    pub fn may_follow(&self, next: &CoordinatorConfig) -> bool {
        Some(next.version) == self.version.checked_add(1)
            && !next.in_sync.contains(&next.serving)
            && (next.serving == self.serving || (self.in_sync.contains(&next.serving) && next.in_sync.is_empty()))
    }
}

/// A proposal number: rounds first, the proposer's process breaking ties.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Encode, Decode)]
pub struct Ballot {
    /// The round.
    pub round: u64,
    /// The proposing process.
    pub proposer: u32,
}

/// Phase 1: `ballot` asks to propose the version after `base` (a chosen configuration the proposer knows,
/// which an acceptor that knows only an older one adopts).
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct ConfigPrepare {
    /// The proposal number.
    pub ballot: Ballot,
    /// The last chosen configuration the proposer knows.
    pub base: CoordinatorConfig,
}

/// An acceptor's promise to accept nothing below `ballot` for version `version`, with what it accepted
/// before for that version, if anything.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct ConfigPromise {
    /// The version being chosen.
    pub version: u64,
    /// The ballot promised.
    pub ballot: Ballot,
    /// The highest-numbered proposal it accepted for that version.
    pub accepted: Option<(Ballot, CoordinatorConfig)>,
}

/// Phase 2: accept `value` (of version `base.version + 1`) under `ballot`.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct ConfigAccept {
    /// The proposal number.
    pub ballot: Ballot,
    /// The last chosen configuration the proposer knows.
    pub base: CoordinatorConfig,
    /// The configuration proposed.
    pub value: CoordinatorConfig,
}

/// An acceptor accepted `ballot`'s value for `version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct ConfigAccepted {
    /// The version.
    pub version: u64,
    /// The ballot accepted.
    pub ballot: Ballot,
}

/// An acceptor's refusal, with what it knows: the ballot it promised and the last configuration chosen.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct ConfigRefused {
    /// The ballot it promised for the version after `chosen` (higher than the one refused, or the proposer's
    /// base is older than `chosen`).
    pub promised: Ballot,
    /// The last chosen configuration it knows.
    pub chosen: CoordinatorConfig,
}

/// Why a request to an acceptor was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// A ballot below the one promised, or a base older than what was chosen since.
    Outdated(ConfigRefused),
    /// A value that cannot follow its base (see [`CoordinatorConfig::may_follow`]).
    Invalid(String),
}

/// A shard process's part in choosing shard 0's configuration: the last configuration it knows chosen, and
/// its promise and acceptance for the next version.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct Acceptor {
    chosen: CoordinatorConfig,
    promised: Ballot,
    accepted: Option<(Ballot, CoordinatorConfig)>,
}

impl Acceptor {
    /// An acceptor that knows `chosen` (at the cluster's start: version 0, served by process 0).
    pub fn new(chosen: CoordinatorConfig) -> Self {
        Acceptor { chosen, promised: Ballot::default(), accepted: None }
    }

    /// The acceptor's state as bytes, to keep across a restart.
    pub fn to_bytes(&self) -> Vec<u8> {
        // Only lengths bounded by the process count and an address: encoding into a vector cannot fail.
        bincode::encode_to_vec(self, bincode::config::standard()).unwrap_or_default()
    }

    /// Reads [`Acceptor::to_bytes`]; anything else is an error.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        let config = bincode::config::standard().with_limit::<{ 1 << 20 }>();
        match bincode::decode_from_slice(bytes, config) {
            Ok((a, used)) if used == bytes.len() => Ok(a),
            Ok((_, used)) => Err(format!("{} bytes after the state", bytes.len() - used)),
            Err(e) => Err(e.to_string()),
        }
    }

    /// The round of the ballot it promised for the version in progress.
    pub fn promised_round(&self) -> u64 {
        self.promised.round
    }

    /// The last configuration this acceptor knows chosen.
    pub fn chosen(&self) -> &CoordinatorConfig {
        &self.chosen
    }

    /// Adopts `config` if it is newer than the last one known chosen (the sender saw it chosen); true if
    /// it was.
    pub fn learn(&mut self, config: &CoordinatorConfig) -> bool {
        if config.version <= self.chosen.version {
            return false;
        }
        self.chosen = config.clone();
        self.promised = Ballot::default();
        self.accepted = None;
        true
    }

    fn refused(&self) -> Refusal {
        Refusal::Outdated(ConfigRefused { promised: self.promised, chosen: self.chosen.clone() })
    }

    /// Phase 1 (see [`ConfigPrepare`]).
    pub fn prepare(&mut self, p: &ConfigPrepare) -> Result<ConfigPromise, Refusal> {
        self.learn(&p.base);
        if p.base.version < self.chosen.version || p.ballot < self.promised {
            return Err(self.refused());
        }
        self.promised = p.ballot;
        let version = self.chosen.version.saturating_add(1);
        Ok(ConfigPromise { version, ballot: p.ballot, accepted: self.accepted.clone() })
    }

    /// Phase 2 (see [`ConfigAccept`]).
    pub fn accept(&mut self, a: &ConfigAccept) -> Result<ConfigAccepted, Refusal> {
        if !a.base.may_follow(&a.value) {
            return Err(Refusal::Invalid(format!("configuration {:?} cannot follow {:?}", a.value, a.base)));
        }
        self.learn(&a.base);
        if a.base.version < self.chosen.version || a.ballot < self.promised {
            return Err(self.refused());
        }
        self.promised = a.ballot;
        self.accepted = Some((a.ballot, a.value.clone()));
        Ok(ConfigAccepted { version: a.value.version, ballot: a.ballot })
    }
}

/// Where a [`Proposer`] stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Still collecting promises or acceptances.
    Pending,
    /// This configuration was chosen for the version (the proposer's own, or an earlier proposal it carried
    /// on).
    Chosen(CoordinatorConfig),
    /// A later configuration was chosen meanwhile: the proposer's base is out of date.
    Superseded(CoordinatorConfig),
}

/// What a proposer sends next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Send {
    /// Nothing yet.
    Nothing,
    /// Phase 1 to every acceptor.
    Prepare(ConfigPrepare),
    /// Phase 2 to every acceptor.
    Accept(ConfigAccept),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    Preparing { promises: std::collections::BTreeMap<u32, Option<(Ballot, CoordinatorConfig)>> },
    Accepting { value: CoordinatorConfig, accepted: std::collections::BTreeSet<u32> },
    Done(Outcome),
}

/// One proposal of the configuration after `base` among `voters` acceptors (a majority decides).
#[derive(Debug, Clone)]
pub struct Proposer {
    me: u32,
    voters: u32,
    base: CoordinatorConfig,
    want: CoordinatorConfig,
    ballot: Ballot,
    phase: Phase,
    /// The highest round any acceptor answered with.
    highest: u64,
}

impl Proposer {
    /// Process `me` proposes `want` (version `base.version + 1`, valid after `base`) to `voters` acceptors,
    /// with ballots above round `above`: a process must never use one ballot for two proposals of a version
    /// (a late phase 2 message of the first could overwrite the second's choice), so it passes the highest
    /// round it used or promised before ([`Proposer::round`], [`Acceptor::promised_round`]).
    pub fn new(
        me: u32,
        voters: u32,
        base: CoordinatorConfig,
        want: CoordinatorConfig,
        above: u64,
    ) -> Result<Self, String> {
        if !base.may_follow(&want) {
            return Err(format!("configuration {want:?} cannot follow {base:?}"));
        }
        if voters == 0 {
            return Err("no acceptors".into());
        }
        Ok(Proposer {
            me,
            voters,
            base,
            want,
            ballot: Ballot { round: above.saturating_add(1), proposer: me },
            phase: Phase::Preparing { promises: Default::default() },
            highest: 0,
        })
    }

    fn majority(&self) -> usize {
        self.voters as usize / 2 + 1
    }

    /// The round of the current ballot.
    pub fn round(&self) -> u64 {
        self.ballot.round
    }

    /// Phase 1 of the current ballot.
    pub fn prepare(&self) -> ConfigPrepare {
        ConfigPrepare { ballot: self.ballot, base: self.base.clone() }
    }

    /// Where it stands.
    pub fn outcome(&self) -> Outcome {
        match &self.phase {
            Phase::Done(o) => o.clone(),
            _ => Outcome::Pending,
        }
    }

    /// Acceptor `from` promised: once a majority did, phase 2 with the value of the highest-numbered
    /// proposal they accepted before, or this proposer's own.
    pub fn on_promise(&mut self, from: u32, p: &ConfigPromise) -> Send {
        if p.ballot != self.ballot || p.version != self.want.version {
            return Send::Nothing;
        }
        let majority = self.majority();
        let Phase::Preparing { promises } = &mut self.phase else { return Send::Nothing };
        promises.insert(from, p.accepted.clone());
        if promises.len() < majority {
            return Send::Nothing;
        }
        let earlier = promises.values().flatten().max_by_key(|(b, _)| *b).map(|(_, v)| v.clone());
        let value = earlier.unwrap_or_else(|| self.want.clone());
        self.phase = Phase::Accepting { value: value.clone(), accepted: Default::default() };
        Send::Accept(ConfigAccept { ballot: self.ballot, base: self.base.clone(), value })
    }

    /// Acceptor `from` accepted: once a majority did, the value is chosen (tell every process).
    pub fn on_accepted(&mut self, from: u32, a: &ConfigAccepted) -> Outcome {
        if a.ballot != self.ballot || a.version != self.want.version {
            return self.outcome();
        }
        let majority = self.majority();
        if let Phase::Accepting { value, accepted } = &mut self.phase {
            accepted.insert(from);
            if accepted.len() >= majority {
                self.phase = Phase::Done(Outcome::Chosen(value.clone()));
            }
        }
        self.outcome()
    }

    /// An acceptor refused: a later configuration was chosen (done: superseded, or chosen — the very
    /// version this proposer worked on), or it promised a higher ballot (try again above it with
    /// [`Proposer::retry`]).
    pub fn on_refused(&mut self, r: &ConfigRefused) -> Outcome {
        if matches!(self.phase, Phase::Done(_)) {
            return self.outcome();
        }
        if r.chosen.version > self.base.version {
            let done = if r.chosen.version == self.want.version {
                Outcome::Chosen(r.chosen.clone())
            } else {
                Outcome::Superseded(r.chosen.clone())
            };
            self.phase = Phase::Done(done);
        } else {
            self.highest = self.highest.max(r.promised.round);
        }
        self.outcome()
    }

    /// A new ballot above every one seen (after refusals or lost messages): phase 1 again.
    pub fn retry(&mut self) -> Option<ConfigPrepare> {
        if matches!(self.phase, Phase::Done(_)) {
            return None;
        }
        self.ballot = Ballot { round: self.ballot.round.max(self.highest).saturating_add(1), proposer: self.me };
        self.phase = Phase::Preparing { promises: Default::default() };
        Some(self.prepare())
    }
}

#[cfg(test)]
mod tests;
