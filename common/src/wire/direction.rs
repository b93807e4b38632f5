//! Which way a message goes: every kind is either a [`Request`] (it asks something of a shard process) or a
//! [`Reply`] (it answers one). [`Message`] is both, as the wire carries them; a receiver that serves takes a
//! message apart with [`Message::into_request`] and matches on requests only, and a reply kind sent as a
//! request is refused in one place.

use super::*;

/// Defines [`Request`] and [`Reply`] and the conversions, from one list: the match in
/// [`Message::into_request`] names every kind, so a new kind that is in neither list does not compile.
macro_rules! directions {
    (requests { $($rq:ident($rqt:ty)),* $(,)? } replies { $($rp:ident($rpt:ty)),* $(,)? }) => {
        /// A message that asks something of a shard process.
        #[derive(Debug, Clone, PartialEq)]
        pub enum Request {
            $(
                #[doc = concat!("[`Message::", stringify!($rq), "`].")]
                $rq($rqt),
            )*
        }

        /// A message that answers a [`Request`].
        #[derive(Debug, Clone, PartialEq)]
        pub enum Reply {
            $(
                #[doc = concat!("[`Message::", stringify!($rp), "`].")]
                $rp($rpt),
            )*
        }

        impl Message {
            /// The request this message is, or the reply it is instead (boxed: replies as requests are rare,
            /// and a reply can be large).
            pub fn into_request(self) -> Result<Request, Box<Reply>> {
                match self {
                    $(Message::$rq(m) => Ok(Request::$rq(m)),)*
                    $(Message::$rp(m) => Err(Box::new(Reply::$rp(m))),)*
                }
            }
        }

        impl From<Request> for Message {
            fn from(r: Request) -> Message {
                match r { $(Request::$rq(m) => Message::$rq(m),)* }
            }
        }

        impl From<Reply> for Message {
            fn from(r: Reply) -> Message {
                match r { $(Reply::$rp(m) => Message::$rp(m),)* }
            }
        }

        impl Reply {
            /// The kind's name, as in [`Message`].
            pub fn name(&self) -> &'static str {
                match self { $(Reply::$rp(_) => stringify!($rp),)* }
            }
        }

        impl Request {
            /// The kind's name, as in [`Message`].
            pub fn name(&self) -> &'static str {
                match self { $(Request::$rq(_) => stringify!($rq),)* }
            }
        }
    };
}

directions! {
    requests {
        Register(Register), RegisterShard(RegisterShard), Pull(Pull), Push(Push), Heartbeat(Heartbeat),
        StatsRequest(StatsRequest), Leave(Leave), SparsePull(SparsePull), SparsePush(SparsePush),
        CheckpointRequest(CheckpointRequest), Authenticate(Authenticate), PushPart(PushPart), PushPull(Push),
        Rollback(Rollback), SplitRequest(SplitRequest), DataStatusRequest(DataStatusRequest), WaitStep(WaitStep),
        Initialize(Initialize), TableScan(TableScan), TableLoad(TableLoad), ReplicaSnapshot(ReplicaSnapshot),
        ReplicaAppend(ReplicaAppend), ReplicaReport(ReplicaReport), Promote(Promote),
        ConfigPrepare(ConfigPrepare), ConfigAccept(ConfigAccept),
        // Sent to every process when a configuration is chosen; an acceptor answers it with the same kind.
        ConfigChosen(CoordinatorConfig),
        CoordinatorWhere(CoordinatorWhere), Step(Step),
    }
    replies {
        ClusterMap(ClusterMap), PullReply(PullReply), Ack(Ack), Error(ErrorReply), HeartbeatAck(HeartbeatAck),
        Stats(Stats), SparsePullReply(SparsePullReply), CheckpointDone(CheckpointDone),
        Authenticated(Authenticated), PushPullReply(PushPullReply), RollbackReply(RollbackReply),
        SplitGrant(SplitGrant), DataStatus(DataStatus), Initialized(Initialized), TableRows(TableRows),
        TableLoaded(TableLoaded), ReplicaAck(ReplicaAck), ReplicaEpoch(ReplicaEpoch),
        ConfigPromise(ConfigPromise), ConfigAccepted(ConfigAccepted), ConfigRefused(ConfigRefused),
        CoordinatorAt(CoordinatorAt), StepReply(StepReply),
    }
}

impl Request {
    /// Whether this request carries gradients (a push of any form).
    pub fn is_push(&self) -> bool {
        matches!(
            self,
            Request::Push(_) | Request::PushPull(_) | Request::PushPart(_) | Request::SparsePush(_) | Request::Step(_)
        )
    }
}
