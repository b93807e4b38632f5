//! Frames: a header and its payload encoded, decoded and read from a stream.

use super::*;

pub(super) fn config() -> impl bincode::config::Config {
    bincode::config::standard()
        .with_little_endian()
        .with_variable_int_encoding()
        .with_limit::<{ MAX_HEADER_BYTES as usize }>()
}

/// A decoded frame: header message plus tensor payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    /// The header.
    pub msg: Message,
    /// The tensor payload (empty for messages without one).
    pub payload: Vec<f32>,
}

impl Frame {
    /// A frame without payload.
    pub fn new(msg: Message) -> Frame {
        Frame { msg, payload: Vec::new() }
    }
}

/// Encodes the prefix and header of a frame whose payload has `payload_elems` elements.
pub fn encode_header(msg: &Message, payload_elems: usize) -> Result<Vec<u8>, WireError> {
    let declared = msg.payload_elems();
    if declared != payload_elems as u64 {
        return Err(WireError::ElementCountMismatch { expected: declared, got: payload_elems as u64 });
    }
    let mut out = vec![msg.kind(), 0, 0, 0, 0];
    let len = msg.encode_body(&mut out).map_err(|e| WireError::BadHeader(e.to_string()))?;
    if len as u64 > u64::from(MAX_HEADER_BYTES) {
        return Err(WireError::HeaderTooLarge { len: len as u64, max: u64::from(MAX_HEADER_BYTES) });
    }
    out[1..5].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(out)
}

/// Encodes a whole frame into one buffer (prefix, header, payload).
pub fn encode_frame(frame: &Frame) -> Result<Vec<u8>, WireError> {
    let mut out = encode_header(&frame.msg, frame.payload.len())?;
    for part in encode_payload(&frame.msg, &frame.payload)? {
        out.extend_from_slice(&part);
    }
    Ok(out)
}

/// The wire bytes of `values`, the whole payload of `msg`, section by section: f32 sections as views of
/// `values` (no copy on little-endian hosts), 16-bit ones converted.
pub fn encode_payload<'v>(msg: &Message, values: &'v [f32]) -> Result<Vec<std::borrow::Cow<'v, [u8]>>, WireError> {
    let sections = msg.payload_sections();
    let declared: u64 = sections.iter().map(|(n, _)| n).sum();
    if declared != values.len() as u64 {
        return Err(WireError::ElementCountMismatch { expected: declared, got: values.len() as u64 });
    }
    let mut parts: Vec<std::borrow::Cow<'v, [u8]>> = Vec::new();
    let mut at = 0usize;
    let mut f32_run = 0usize;
    for (n, dtype) in sections {
        let n = n as usize;
        if dtype == WireDtype::F32 {
            f32_run += n;
        } else {
            if f32_run > 0 {
                parts.push(f32s_to_le_bytes(&values[at - f32_run..at]));
                f32_run = 0;
            }
            parts.push(std::borrow::Cow::Owned(crate::dtype::encode_bulk(dtype, &values[at..at + n])));
        }
        at += n;
    }
    if f32_run > 0 {
        parts.push(f32s_to_le_bytes(&values[at - f32_run..at]));
    }
    Ok(parts)
}

/// Decodes a payload arriving in byte pieces of any length and alignment into f32 values, section by
/// section (see [`Message::payload_sections`]). Whole runs of values are handed to the caller's `emit` in
/// their wire format; a value split across pieces is kept until it is complete.
#[derive(Debug)]
pub struct PayloadDecoder {
    sections: Vec<(u64, WireDtype)>,
    section: usize,
    left: u64,
    carry: [u8; 4],
    carry_len: usize,
    bytes_left: u64,
}

impl PayloadDecoder {
    /// A decoder for the payload `msg` announces.
    pub fn new(msg: &Message) -> Self {
        let sections: Vec<(u64, WireDtype)> = msg.payload_sections().into_iter().filter(|(n, _)| *n > 0).collect();
        let left = sections.first().map_or(0, |s| s.0);
        PayloadDecoder { sections, section: 0, left, carry: [0; 4], carry_len: 0, bytes_left: msg.payload_bytes() }
    }

    /// Payload bytes still to come.
    pub fn bytes_missing(&self) -> u64 {
        self.bytes_left
    }

    /// True once the whole payload was decoded.
    pub fn is_done(&self) -> bool {
        self.bytes_left == 0
    }

    /// Consumes `bytes` (anything beyond the payload is ignored) and calls `emit(format, bytes)` for each run
    /// of whole values, in payload order.
    pub fn feed(&mut self, bytes: &[u8], emit: &mut impl FnMut(WireDtype, &[u8])) {
        let mut bytes = &bytes[..bytes.len().min(usize::try_from(self.bytes_left).unwrap_or(usize::MAX))];
        while !bytes.is_empty() {
            while self.left == 0 {
                self.section += 1;
                match self.sections.get(self.section) {
                    Some(section) => self.left = section.0,
                    // Only a byte count that disagrees with the sections (it saturated) gets here.
                    None => {
                        self.bytes_left = 0;
                        return;
                    }
                }
            }
            let dtype = self.sections[self.section].1;
            let width = dtype.bytes();
            if self.carry_len > 0 {
                let take = (width - self.carry_len).min(bytes.len());
                self.carry[self.carry_len..self.carry_len + take].copy_from_slice(&bytes[..take]);
                self.carry_len += take;
                self.bytes_left -= take as u64;
                bytes = &bytes[take..];
                if self.carry_len == width {
                    emit(dtype, &self.carry[..width]);
                    self.carry_len = 0;
                    self.left -= 1;
                }
                continue;
            }
            let whole = ((bytes.len() / width) as u64).min(self.left) as usize;
            if whole > 0 {
                emit(dtype, &bytes[..whole * width]);
                self.left -= whole as u64;
                self.bytes_left -= (whole * width) as u64;
                bytes = &bytes[whole * width..];
            } else {
                self.carry[..bytes.len()].copy_from_slice(bytes);
                self.carry_len = bytes.len();
                self.bytes_left -= bytes.len() as u64;
                bytes = &[];
            }
        }
    }
}

/// Checks a frame prefix and returns `(kind, header_len)`; the header length is bounded here.
pub fn parse_prefix(prefix: &[u8; FRAME_PREFIX_LEN], limits: &Limits) -> Result<(u8, usize), WireError> {
    let kind = prefix[0];
    if !Message::is_known_kind(kind) {
        return Err(WireError::UnknownKind(kind));
    }
    let len = u32::from_le_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]);
    let max = limits.max_header_bytes.min(MAX_HEADER_BYTES);
    if len > max {
        return Err(WireError::HeaderTooLarge { len: u64::from(len), max: u64::from(max) });
    }
    Ok((kind, len as usize))
}

/// Decodes a header of the given kind, which must be consumed exactly, and bounds the payload it implies.
pub fn decode_header(kind: u8, header: &[u8], limits: &Limits) -> Result<Message, WireError> {
    let (msg, used) = Message::decode_body(kind, header)?;
    if used != header.len() {
        return Err(WireError::BadHeader(format!("{} unused bytes in the header", header.len() - used)));
    }
    let bytes = msg.payload_elems().saturating_mul(4);
    if bytes > limits.max_payload_bytes {
        return Err(WireError::PayloadTooLarge { len: bytes, max: limits.max_payload_bytes });
    }
    Ok(msg)
}

/// Decodes one complete frame from a buffer that must hold exactly one frame.
pub fn decode_frame(buf: &[u8], limits: &Limits) -> Result<Frame, WireError> {
    let truncated = |needed: usize| WireError::Truncated { needed: needed as u64, got: buf.len() as u64 };
    let prefix: &[u8; FRAME_PREFIX_LEN] =
        buf.get(..FRAME_PREFIX_LEN).and_then(|p| p.try_into().ok()).ok_or(truncated(FRAME_PREFIX_LEN))?;
    let (kind, header_len) = parse_prefix(prefix, limits)?;
    let header_end = FRAME_PREFIX_LEN + header_len;
    let header = buf.get(FRAME_PREFIX_LEN..header_end).ok_or(truncated(header_end))?;
    let msg = decode_header(kind, header, limits)?;
    let payload_bytes = msg.payload_bytes() as usize;
    let rest = &buf[header_end..];
    if rest.len() < payload_bytes {
        return Err(truncated(header_end + payload_bytes));
    }
    if rest.len() > payload_bytes {
        return Err(WireError::TrailingBytes((rest.len() - payload_bytes) as u64));
    }
    Ok(Frame { payload: decode_payload(&msg, rest), msg })
}

/// Decodes a whole payload of `msg` (whose length the caller checked) into f32 values.
fn decode_payload(msg: &Message, bytes: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(msg.payload_elems() as usize);
    PayloadDecoder::new(msg).feed(bytes, &mut |dtype, run| crate::dtype::decode_extend(dtype, run, &mut out));
    out
}

/// A source of bytes that can fill a whole buffer or fail; implemented by the transports (the QUIC
/// receive stream) and by in-memory readers in tests. The transport maps its own errors into [`WireError`]
/// (an early end of stream is [`WireError::Truncated`]).
pub trait ReadExact {
    /// Fills `buf` completely.
    fn read_exact(&mut self, buf: &mut [u8]) -> impl std::future::Future<Output = Result<(), WireError>> + Send;
}

/// Reads one frame; lengths are bounded by `limits` before each allocation.
pub async fn read_frame<R: ReadExact>(source: &mut R, limits: &Limits) -> Result<Frame, WireError> {
    let msg = read_header(source, limits).await?;
    let payload = read_payload(source, &msg).await?;
    Ok(Frame { msg, payload })
}

/// Reads a frame's prefix and header; the payload it announces ([`Message::payload_elems`], bounded by
/// `limits`) follows on the stream. A server uses the split to reserve memory before reading the payload.
pub async fn read_header<R: ReadExact>(source: &mut R, limits: &Limits) -> Result<Message, WireError> {
    let mut prefix = [0u8; FRAME_PREFIX_LEN];
    source.read_exact(&mut prefix).await?;
    let (kind, header_len) = parse_prefix(&prefix, limits)?;
    let mut header = vec![0u8; header_len];
    source.read_exact(&mut header).await?;
    decode_header(kind, &header, limits)
}

/// Reads the payload `msg` announces.
pub async fn read_payload<R: ReadExact>(source: &mut R, msg: &Message) -> Result<Vec<f32>, WireError> {
    let mut bytes = vec![0u8; msg.payload_bytes() as usize];
    source.read_exact(&mut bytes).await?;
    Ok(decode_payload(msg, &bytes))
}

/// The little-endian bytes of a slice of f32 (a plain view on little-endian hosts).
pub fn f32s_to_le_bytes(values: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(values))
    } else {
        std::borrow::Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// f32 values from little-endian bytes (length must be a multiple of 4; extra bytes are ignored).
pub fn le_bytes_to_f32s(bytes: &[u8]) -> Vec<f32> {
    let n = bytes.len() / 4;
    let mut out = vec![0f32; n];
    bytemuck::cast_slice_mut::<f32, u8>(&mut out).copy_from_slice(&bytes[..n * 4]);
    from_le_in_place(&mut out);
    out
}

/// Converts values just read as raw little-endian bytes into native order (a no-op on little-endian hosts).
pub fn from_le_in_place(values: &mut [f32]) {
    if cfg!(target_endian = "big") {
        for v in values.iter_mut() {
            *v = f32::from_bits(u32::from_le(v.to_bits()));
        }
    }
}
