//! The Rust client's log records, handed to Python's `logging` as the `gaps` logger's records.
//!
//! The client's threads never take the GIL to log (that could wait on a thread holding it): a tracing layer
//! queues each record (bounded; the oldest are dropped and counted when nobody collects them), and the
//! Python thread running a gaps call hands them to `logging.getLogger("gaps")` while it waits (every
//! 100 ms) and when the call returns. `GAPS_LOG` (tracing's filter syntax, default `info`) chooses what is
//! queued; Python's logging configuration chooses what is shown.

use pyo3::prelude::*;
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::{EnvFilter, Layer};

/// Records kept between two hand-overs.
const QUEUE: usize = 1024;

struct Record {
    /// Python's level number.
    level: u8,
    text: String,
}

static RECORDS: Mutex<VecDeque<Record>> = Mutex::new(VecDeque::new());
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// The event's message, then its other fields as `name=value`.
#[derive(Default)]
struct Text {
    message: String,
    fields: String,
}

impl Visit for Text {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value}", field.name());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
}

struct ToPython;

impl<S: tracing::Subscriber> Layer<S> for ToPython {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut text = Text::default();
        event.record(&mut text);
        let level = match *event.metadata().level() {
            tracing::Level::ERROR => 40,
            tracing::Level::WARN => 30,
            tracing::Level::INFO => 20,
            tracing::Level::DEBUG => 10,
            tracing::Level::TRACE => 5,
        };
        let Ok(mut queue) = RECORDS.lock() else { return };
        if queue.len() >= QUEUE {
            queue.pop_front();
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
        queue.push_back(Record { level, text: text.message + &text.fields });
    }
}

/// Sends the client's tracing events to the queue (once per process; a no-op when the embedding
/// application installed a subscriber of its own).
pub fn install() {
    let filter = EnvFilter::try_from_env("GAPS_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry().with(ToPython.with_filter(filter)));
}

/// Hands the queued records to the `gaps` logger (errors of Python's logging are ignored: logging never
/// fails a call).
pub fn forward(py: Python<'_>) {
    let records: Vec<Record> = match RECORDS.lock() {
        Ok(mut queue) if !queue.is_empty() => queue.drain(..).collect(),
        _ => return,
    };
    let Ok(logger) = py.import("logging").and_then(|l| l.call_method1("getLogger", ("gaps",))) else { return };
    let dropped = DROPPED.swap(0, Ordering::Relaxed);
    if dropped > 0 {
        let _ = logger.call_method1("log", (30u8, format!("{dropped} log records of the gaps client were dropped")));
    }
    for r in records {
        let _ = logger.call_method1("log", (r.level, r.text));
    }
}
