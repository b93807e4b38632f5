//! Frame payloads as quinn sends them: tensors as little-endian bytes without a copy where the host allows,
//! 16-bit encodings, a message's payload parts, and writing a frame.

use super::*;

/// Tensor data owned elsewhere (a `Vec<f32>`, a slice of shared tensors) seen as little-endian bytes.
struct F32Owner<T>(T);

impl<T: AsRef<[f32]>> AsRef<[u8]> for F32Owner<T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(self.0.as_ref())
    }
}

/// `values` as a frame payload part. On little-endian hosts the bytes are the values' own memory, handed
/// to quinn's send queue without a copy (the owner is dropped once the peer acknowledged them).
pub fn f32_bytes<T: AsRef<[f32]> + Send + 'static>(values: T) -> Bytes {
    if cfg!(target_endian = "little") {
        Bytes::from_owner(F32Owner(values))
    } else {
        Bytes::from(wire::f32s_to_le_bytes(values.as_ref()).into_owned())
    }
}

/// A copy of `values` as a frame payload part (for small or borrowed data).
pub fn f32_bytes_copied(values: &[f32]) -> Bytes {
    Bytes::copy_from_slice(&wire::f32s_to_le_bytes(values))
}

/// `values` encoded as `dtype` for the wire: f32 without a copy ([`f32_bytes`]), 16-bit formats
/// converted (SIMD) into a new buffer ([`encode_slice`]).
pub fn dtype_bytes<T: AsRef<[f32]> + Send + 'static>(dtype: gaps_common::dtype::WireDtype, values: T) -> Bytes {
    match dtype {
        gaps_common::dtype::WireDtype::F32 => f32_bytes(values),
        other => encode_slice(other, values.as_ref()),
    }
}

/// 16-bit values held in an f32 buffer from the recycler (so that very large ones are reused rather than
/// faulted in afresh each round), seen as their first `bytes` bytes.
struct HalfOwner {
    buf: gaps_common::buffers::Recycled,
    bytes: usize,
}

impl AsRef<[u8]> for HalfOwner {
    fn as_ref(&self) -> &[u8] {
        &bytemuck::cast_slice::<f32, u8>(&self.buf.0)[..self.bytes]
    }
}

/// A copy of `values` in `dtype`'s wire bytes, in one conversion pass (16-bit formats into a recycled
/// buffer; f32 copied).
pub fn encode_slice(dtype: gaps_common::dtype::WireDtype, values: &[f32]) -> Bytes {
    encode_blocks(dtype, values, |_| {})
}

/// [`encode_slice`] into a 16-bit format, also telling whether every value of `values` is finite: each
/// block of the source is checked right after it was converted, while it is in the cache, instead of in a
/// pass of its own. (f32 is copied and checked.)
pub fn encode_slice_finite(dtype: gaps_common::dtype::WireDtype, values: &[f32]) -> (Bytes, bool) {
    let mut finite = true;
    let bytes = encode_blocks(dtype, values, |block| finite &= gaps_common::dtype::all_finite(block));
    (bytes, finite)
}

/// `values` in a 16-bit `dtype`'s little-endian wire bytes, converted block by block through a stack buffer
/// into a buffer from the recycler (no zero-fill first, [`gaps_common::dtype::Packer`]), with `each` called
/// on every source block right after it was converted (while it is in the cache).
fn encode_blocks(dtype: gaps_common::dtype::WireDtype, values: &[f32], mut each: impl FnMut(&[f32])) -> Bytes {
    if dtype == gaps_common::dtype::WireDtype::F32 {
        each(values);
        return f32_bytes_copied(values);
    }
    let n = values.len();
    // The 16-bit values' bytes, in order, held in the f32 slots of a recycled buffer (two per slot).
    let mut packer = gaps_common::dtype::Packer::new(gaps_common::buffers::take(n.div_ceil(2)));
    packer.push_with(dtype, values, each);
    Bytes::from_owner(HalfOwner { buf: gaps_common::buffers::Recycled(packer.finish()), bytes: 2 * n })
}

/// The payload parts of a frame whose values are `values`, in the formats `msg`'s sections declare: the
/// values' own memory when every section is f32 (very large buffers go back to the recycler once sent),
/// converted copies otherwise.
pub fn payload_parts(msg: &Message, values: Vec<f32>) -> Result<Vec<Bytes>, WireError> {
    let sections = msg.payload_sections();
    if sections.iter().all(|(_, d)| *d == gaps_common::dtype::WireDtype::F32) {
        let declared: u64 = sections.iter().map(|(n, _)| n).sum();
        if declared != values.len() as u64 {
            return Err(WireError::ElementCountMismatch { expected: declared, got: values.len() as u64 });
        }
        return Ok(vec![f32_bytes(gaps_common::buffers::Recycled(values))]);
    }
    let declared: u64 = sections.iter().map(|(n, _)| n).sum();
    if declared != values.len() as u64 {
        return Err(WireError::ElementCountMismatch { expected: declared, got: values.len() as u64 });
    }
    // Runs of sections in one format become one part each.
    let mut parts = Vec::new();
    let (mut start, mut at) = (0usize, 0usize);
    for (i, (n, dtype)) in sections.iter().enumerate() {
        at += *n as usize;
        if sections.get(i + 1).is_none_or(|next| next.1 != *dtype) {
            parts.push(encode_slice(*dtype, &values[start..at]));
            start = at;
        }
    }
    gaps_common::buffers::give(values);
    Ok(parts)
}

/// The payload parts of a frame whose values were packed for the wire by [`gaps_common::dtype::Packer`]
/// (the shard's pull replies): slices of the one buffer, sent without a copy or a conversion.
pub fn packed_parts(msg: &Message, packed: Vec<f32>) -> Result<Vec<Bytes>, WireError> {
    let (runs, slots) = gaps_common::dtype::packed_runs(&msg.payload_sections());
    if packed.len() != slots {
        return Err(WireError::ElementCountMismatch { expected: slots as u64, got: packed.len() as u64 });
    }
    if runs.iter().all(|(d, _, _)| *d == gaps_common::dtype::WireDtype::F32) {
        return payload_parts(msg, packed);
    }
    let all = f32_bytes(gaps_common::buffers::Recycled(packed));
    Ok(runs.into_iter().map(|(_, range, bytes)| all.slice(4 * range.start..4 * range.start + bytes)).collect())
}

/// Writes one frame whose payload is the concatenation of `payload` parts, already in the formats the
/// header's sections declare (as made by [`f32_bytes`] or [`dtype_bytes`]); the byte count must match.
/// The parts go to quinn by reference count, not copied.
pub async fn write_frame(send: &mut quinn::SendStream, msg: &Message, payload: &[Bytes]) -> Result<u64, WireError> {
    let bytes: usize = payload.iter().map(|p| p.len()).sum();
    if bytes as u64 != msg.payload_bytes() {
        return Err(WireError::Io(format!(
            "a payload of {bytes} bytes where the header declares {} bytes",
            msg.payload_bytes()
        )));
    }
    let header = wire::encode_header(msg, msg.payload_elems() as usize)?;
    let io = |e: quinn::WriteError| WireError::Io(e.to_string());
    send.write_all(&header).await.map_err(io)?;
    for part in payload {
        if !part.is_empty() {
            send.write_chunk(part.clone()).await.map_err(io)?;
        }
    }
    Ok((header.len() + bytes) as u64)
}
