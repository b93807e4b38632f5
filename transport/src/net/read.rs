//! Reading frames from a QUIC stream: headers under limits, payloads straight into their destination,
//! requests admitted against a memory budget as their bytes arrive.

use super::*;

/// Adapts a QUIC receive stream to [`wire::ReadExact`].
struct QuicReader<'a>(&'a mut quinn::RecvStream);

impl wire::ReadExact for QuicReader<'_> {
    async fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), WireError> {
        let needed = buf.len() as u64;
        self.0.read_exact(buf).await.map_err(|e| match e {
            quinn::ReadExactError::FinishedEarly(got) => WireError::Truncated { needed, got: got as u64 },
            quinn::ReadExactError::ReadError(e) => WireError::Io(e.to_string()),
        })
    }
}

/// Reads one frame, bounded by `limits`.
pub async fn read_frame(recv: &mut quinn::RecvStream, limits: &Limits) -> Result<Frame, WireError> {
    let msg = read_header(recv, limits).await?;
    let payload = read_payload(recv, &msg).await?;
    Ok(Frame { msg, payload })
}

/// Reads a frame's header only (see [`wire::read_header`]); [`read_payload`] reads the rest.
pub async fn read_header(recv: &mut quinn::RecvStream, limits: &Limits) -> Result<Message, WireError> {
    wire::read_header(&mut QuicReader(recv), limits).await
}

/// Reads the payload `msg` announced, straight from quinn's received chunks into the result (no zeroing,
/// one copy).
pub async fn read_payload(recv: &mut quinn::RecvStream, msg: &Message) -> Result<Vec<f32>, WireError> {
    let mut values = gaps_common::buffers::take(msg.payload_elems() as usize);
    read_sections(recv, msg, &mut |dtype, run| gaps_common::dtype::decode_extend(dtype, run, &mut values)).await?;
    Ok(values)
}

/// [`read_payload`], also telling whether every value is finite (no NaN or ±∞): each run is checked as it
/// is decoded, while in the cache, instead of in a second pass over the payload. A payload of megabytes is
/// checked on its wire bytes and written past the cache ([`STREAMING_DESTINATION`]).
pub async fn read_payload_finite(recv: &mut quinn::RecvStream, msg: &Message) -> Result<(Vec<f32>, bool), WireError> {
    let n = msg.payload_elems() as usize;
    let mut values = gaps_common::buffers::take(n);
    let mut finite = true;
    let decode = if n.saturating_mul(4) >= STREAMING_DESTINATION {
        gaps_common::dtype::decode_extend_finite_streaming
    } else {
        gaps_common::dtype::decode_extend_finite
    };
    read_sections(recv, msg, &mut |dtype, run| finite &= decode(dtype, run, &mut values)).await?;
    Ok((values, finite))
}

/// Why a server stopped reading a request before it was whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestReadError {
    /// The bytes do not make a valid request (answered with the reason).
    Wire(WireError),
    /// No byte arrived for the stall limit: the sender is stuck or holding the stream open on purpose.
    Stalled,
    /// The server's memory budget had no room for the request's bytes in time (answered
    /// [`gaps_common::ErrorCode::Busy`]; the client may send it again).
    Busy(String),
}

impl From<WireError> for RequestReadError {
    fn from(e: WireError) -> Self {
        RequestReadError::Wire(e)
    }
}

/// A server's reservation of memory for one request, grown as the request's bytes arrive, so that a request
/// holds budget for what it sent rather than for what it declared.
pub trait Admission {
    /// Makes room for `bytes` bytes of this request in all (the reservation never shrinks); an error
    /// refuses the request with that reason.
    fn grow_to(&mut self, bytes: u64) -> impl std::future::Future<Output = Result<(), String>> + Send;
}

/// The first room a request's payload gets when its first byte arrives: one stream window, what a sender
/// can have in flight before the server reads. The rest, if any, is admitted once this much has arrived.
pub const FIRST_PAYLOAD_ADMISSION: u64 = STREAM_WINDOW as u64;

/// The next byte chunk of a request, or [`RequestReadError::Stalled`] when none came within `stall`.
async fn next_chunk(
    recv: &mut quinn::RecvStream,
    max: usize,
    stall: Duration,
) -> Result<Option<quinn::Chunk>, RequestReadError> {
    match tokio::time::timeout(stall, recv.read_chunk(max, true)).await {
        Err(_) => Err(RequestReadError::Stalled),
        Ok(Err(e)) => Err(WireError::Io(e.to_string()).into()),
        Ok(Ok(chunk)) => Ok(chunk),
    }
}

/// Reads a request's prefix and header as a server must: the header's buffer grows with the bytes that
/// arrived (never to the declared length up front), each byte is admitted by `admission` before it is
/// kept, and a sender that sends nothing for `stall` is given up on.
pub async fn read_request_header(
    recv: &mut quinn::RecvStream,
    limits: &Limits,
    stall: Duration,
    admission: &mut impl Admission,
) -> Result<Message, RequestReadError> {
    let mut prefix = [0u8; wire::FRAME_PREFIX_LEN];
    let mut got = 0;
    while got < prefix.len() {
        match next_chunk(recv, prefix.len() - got, stall).await? {
            Some(chunk) => {
                prefix[got..got + chunk.bytes.len()].copy_from_slice(&chunk.bytes);
                got += chunk.bytes.len();
            }
            None => return Err(WireError::Truncated { needed: prefix.len() as u64, got: got as u64 }.into()),
        }
    }
    let (kind, header_len) = wire::parse_prefix(&prefix, limits)?;
    let mut header = Vec::new();
    while header.len() < header_len {
        match next_chunk(recv, header_len - header.len(), stall).await? {
            Some(chunk) => {
                let total = (prefix.len() + header.len() + chunk.bytes.len()) as u64;
                admission.grow_to(total).await.map_err(RequestReadError::Busy)?;
                header.extend_from_slice(&chunk.bytes);
            }
            None => {
                let needed = header_len as u64;
                return Err(WireError::Truncated { needed, got: header.len() as u64 }.into());
            }
        }
    }
    Ok(wire::decode_header(kind, &header, limits)?)
}

/// [`read_payload_finite`] as a server must read it: memory for the decoded values is admitted by
/// `admission` (on top of `already` bytes the request holds) and allocated only as the payload arrives —
/// one stream window ([`FIRST_PAYLOAD_ADMISSION`]) at its first byte, the rest once that much came — and a
/// sender that sends nothing for `stall` is given up on.
pub async fn read_request_payload(
    recv: &mut quinn::RecvStream,
    msg: &Message,
    stall: Duration,
    already: u64,
    admission: &mut impl Admission,
) -> Result<(Vec<f32>, bool), RequestReadError> {
    let n = msg.payload_elems() as usize;
    let decoded_bytes = msg.payload_elems() * 4;
    let needed = msg.payload_bytes();
    let mut values = Vec::new();
    let mut admitted = 0u64;
    let mut finite = true;
    let decode = if n.saturating_mul(4) >= STREAMING_DESTINATION {
        gaps_common::dtype::decode_extend_finite_streaming
    } else {
        gaps_common::dtype::decode_extend_finite
    };
    let mut decoder = wire::PayloadDecoder::new(msg);
    while !decoder.is_done() {
        let missing = usize::try_from(decoder.bytes_missing()).unwrap_or(usize::MAX);
        let Some(chunk) = next_chunk(recv, missing, stall).await? else {
            return Err(WireError::Truncated { needed, got: needed - decoder.bytes_missing() }.into());
        };
        // The decoded bytes this chunk brings the payload to, in proportion to its wire bytes.
        let arrived = needed - decoder.bytes_missing() + chunk.bytes.len() as u64;
        let decoded_so_far = (u128::from(decoded_bytes) * u128::from(arrived)).div_ceil(u128::from(needed.max(1)));
        let decoded_so_far = u64::try_from(decoded_so_far).unwrap_or(decoded_bytes).min(decoded_bytes);
        if decoded_so_far > admitted {
            let next = if admitted == 0 { FIRST_PAYLOAD_ADMISSION.max(decoded_so_far) } else { decoded_bytes };
            admitted = next.min(decoded_bytes);
            admission.grow_to(already + admitted).await.map_err(RequestReadError::Busy)?;
            let floats = (admitted / 4) as usize;
            if values.capacity() == 0 {
                values = gaps_common::buffers::take(floats);
            } else {
                values.reserve_exact(floats.saturating_sub(values.len()));
            }
        }
        decoder.feed(&chunk.bytes, &mut |dtype, run| finite &= decode(dtype, run, &mut values));
    }
    Ok((values, finite))
}

/// Reads the payload `msg` announced chunk by chunk as quinn received it, decoding its sections and
/// handing each run of whole values to `emit`.
async fn read_sections(
    recv: &mut quinn::RecvStream,
    msg: &Message,
    emit: &mut impl FnMut(gaps_common::dtype::WireDtype, &[u8]),
) -> Result<(), WireError> {
    let needed = msg.payload_bytes();
    let mut decoder = wire::PayloadDecoder::new(msg);
    while !decoder.is_done() {
        let missing = usize::try_from(decoder.bytes_missing()).unwrap_or(usize::MAX);
        match recv.read_chunk(missing, true).await {
            Ok(Some(chunk)) => decoder.feed(&chunk.bytes, emit),
            Ok(None) => return Err(WireError::Truncated { needed, got: needed - decoder.bytes_missing() }),
            Err(e) => return Err(WireError::Io(e.to_string())),
        }
    }
    Ok(())
}

/// Where a reply's payload goes. [`call_with`] asks once the reply's header is read and valid; `Ok(None)`
/// keeps the payload in the returned frame, `Ok(Some(slices))` has it read straight into the caller's
/// buffers (their lengths must add up to the payload's), `Err` refuses the reply.
pub trait ReplySink {
    /// Called as each call begins, before anything is sent: what the reply of an earlier call promised (a
    /// destination whose values were then cut off, an attempt given up for a retry) no longer holds.
    fn begin(&mut self) {}

    /// The destination of the payload of reply `msg` (called at most once a call, after [`Self::begin`]).
    fn destination<'s>(&'s mut self, msg: &Message) -> Result<Option<Vec<&'s mut [f32]>>, String>;
}

/// The reply's payload stays in its frame.
#[derive(Debug, Clone, Copy, Default)]
pub struct InFrame;

impl ReplySink for InFrame {
    fn destination<'s>(&'s mut self, _msg: &Message) -> Result<Option<Vec<&'s mut [f32]>>, String> {
        Ok(None)
    }
}

/// Reads the payload `msg` announced into `dest`, whose lengths must add up to it.
pub async fn read_payload_into(
    recv: &mut quinn::RecvStream,
    msg: &Message,
    dest: &mut [&mut [f32]],
) -> Result<(), WireError> {
    let n = msg.payload_elems() as usize;
    let room: usize = dest.iter().map(|d| d.len()).sum();
    if room != n {
        return Err(WireError::Io(format!("the reply carries {n} values where {room} were expected")));
    }
    let streaming = room.saturating_mul(4) >= STREAMING_DESTINATION;
    let mut fill = SliceFiller { dest, slice: 0, offset: 0, streaming };
    read_sections(recv, msg, &mut |dtype, run| fill.put(dtype, run)).await
}

/// Destinations of at least this many bytes (a core's L2 cache here) are written with non-temporal stores
/// ([`gaps_common::dtype::decode_into_streaming`]): they do not stay in the cache anyway.
const STREAMING_DESTINATION: usize = 2 << 20;

/// Writes runs of whole values into a sequence of slices, splitting runs at slice boundaries.
pub(super) struct SliceFiller<'d, 'b> {
    pub(super) dest: &'d mut [&'b mut [f32]],
    pub(super) slice: usize,
    pub(super) offset: usize,
    /// The slices are large: written past the caches.
    pub(super) streaming: bool,
}

impl SliceFiller<'_, '_> {
    /// Decodes `run` (whole `dtype` values; never more than the slices' room, as the decoder stops at the
    /// payload's end) into the slices.
    pub(super) fn put(&mut self, dtype: gaps_common::dtype::WireDtype, mut run: &[u8]) {
        let width = dtype.bytes();
        while !run.is_empty() {
            while self.dest[self.slice].len() == self.offset {
                self.slice += 1;
                self.offset = 0;
            }
            let target = &mut self.dest[self.slice][self.offset..];
            let count = target.len().min(run.len() / width);
            let (from, to) = (&run[..count * width], &mut target[..count]);
            if self.streaming {
                gaps_common::dtype::decode_into_streaming(dtype, from, to);
            } else {
                gaps_common::dtype::decode_into(dtype, from, to);
            }
            self.offset += count;
            run = &run[count * width..];
        }
    }
}

/// After a request frame: the stream must end here.
pub async fn expect_end(recv: &mut quinn::RecvStream) -> Result<(), WireError> {
    let mut probe = [0u8; 64];
    match recv.read(&mut probe).await {
        Ok(None) => Ok(()),
        Ok(Some(n)) => Err(WireError::TrailingBytes(n as u64)),
        Err(e) => Err(WireError::Io(e.to_string())),
    }
}
