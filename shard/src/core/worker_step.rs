//! A worker's whole step on this shard in one request ([`Step`]): its rows' gradients, its dense push-pull,
//! and its next batch's rows.

use super::*;
use gaps_common::wire::{Step, StepReply};

impl ShardCore {
    /// A [`Step`]: the rows' gradients applied as a [`SparsePush`] is, then the dense push as a push-pull
    /// ([`Self::push_pull`]), then — where the worker goes on at once (the push is answered with its values:
    /// no step to wait for, no GBA hold) — the next rows read as a [`SparsePull`]. (A step held for its
    /// synchronous step or a GBA hold is the service's to hold; it reads the rows, as a request of their
    /// own, when it releases the step.) The parts' worker ids and
    /// epochs must agree, their sequence numbers differ, and the payload must hold exactly their values; the
    /// dense push is checked before the rows are applied: a step refused for any of these changes nothing.
    /// (A failure past the checks — the device's, say — leaves the rows applied, acknowledged as a duplicate
    /// when the step is sent again.) A read of the next rows that fails leaves them out (the worker pulls
    /// them itself and meets the error then). A step counts as its pushes (one, or two with rows): a
    /// step refused before its dense push was tried counts both refused.
    pub(super) fn worker_step(
        &mut self,
        req: &Step,
        (payload, checked_finite): (&[f32], bool),
        now: Duration,
        events: &mut Vec<CoreEvent>,
    ) -> Result<Frame, ShardError> {
        let untried = |core: &mut Self, e: ShardError| {
            // The caller counts the refused request as one push refused; the dense push was one more.
            if req.rows.is_some() {
                core.stats.pushes_rejected += 1;
            }
            Err(e)
        };
        let (worker, epoch) = (req.push.worker, req.push.epoch);
        if req.rows.as_ref().is_some_and(|r| r.worker != worker || r.epoch != epoch || r.seq == req.push.seq)
            || req.next_rows.as_ref().is_some_and(|p| p.epoch != epoch)
        {
            let why = "the parts of a step name different workers or epochs, or one sequence number twice";
            return untried(self, ShardError::WrongShape(why.into()));
        }
        let (rows_len, push_len, ids_len) = req.payload_split();
        let declared = rows_len.saturating_add(push_len).saturating_add(ids_len);
        if declared != payload.len() as u64 {
            let carried = payload.len();
            return untried(
                self,
                ShardError::WrongShape(format!("a step declares {declared} values and carries {carried}")),
            );
        }
        let (rows_payload, rest) = payload.split_at(rows_len as usize);
        let (push_payload, ids) = rest.split_at(push_len as usize);
        // The dense push is checked as `push` checks it before the rows change anything, so that a step it
        // would refuse (a gradient read ahead of a restored shard, a wrong shape) changes nothing.
        let checked = self.push_is_new(epoch, worker, req.push.seq).and_then(|new| {
            if new {
                self.plan_push(&req.push, push_payload, checked_finite).map(drop)
            } else {
                Ok(())
            }
        });
        if let Err(e) = checked {
            return untried(self, e);
        }
        let rows = match req.rows.as_ref().map(|rows| self.sparse_push(rows, rows_payload, self.now_s)) {
            Some(Ok(Frame { msg: Message::Ack(ack), .. })) => Some(ack),
            Some(Ok(_)) => {
                return untried(
                    self,
                    ShardError::Misconfigured("a sparse push was answered with something else".into()),
                )
            }
            Some(Err(e)) => return untried(self, e),
            None => None,
        };
        let Frame { msg, mut payload } = self.push_pull(&req.push, push_payload, checked_finite, now, events)?;
        let Message::PushPullReply(push) = msg else {
            return Err(ShardError::Misconfigured("a push-pull was answered with something else".into()));
        };
        // Decided by the shard's state alone (a backup replaying the step decides the same): not by whether
        // the dense read succeeded.
        let goes_on = push.ack.wait_for_step == 0 && push.ack.wait_for_clock == 0 && !self.step.gba_hold.asked();
        let next_rows = match (&req.next_rows, goes_on) {
            (Some(next), true) => match self.sparse_pull(next, ids, self.now_s) {
                Ok(Frame { msg: Message::SparsePullReply(reply), payload: values }) => {
                    append_reply_values(&mut payload, &mut self.replies.reply_views, values);
                    Some(reply)
                }
                Ok(_) | Err(_) => None,
            },
            _ => None,
        };
        Ok(Frame { msg: Message::StepReply(StepReply { rows, push, next_rows }), payload })
    }
}

/// Appends `values` to a reply made of `payload` or, where it shares the shard's parameter buffers
/// ([`ShardCore::take_reply_views`]), of `views`: as one buffer more after shared ones, as the payload
/// itself where it is empty, else copied after it.
pub fn append_reply_values(payload: &mut Vec<f32>, views: &mut Vec<Arc<Vec<f32>>>, values: Vec<f32>) {
    if !views.is_empty() {
        views.push(Arc::new(values));
    } else if payload.is_empty() {
        *payload = values;
    } else {
        payload.extend_from_slice(&values);
    }
}
