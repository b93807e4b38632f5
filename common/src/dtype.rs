//! 16-bit wire formats for tensor payloads: bfloat16 and IEEE 754 half precision.
//!
//! A shard keeps its state in f32; a tensor may travel as 16-bit values to halve its bytes on the wire.
//! Conversions round to nearest, ties to even, keep infinities, keep NaN a NaN (quiet) and, for half
//! precision, produce subnormals and overflow to infinity as IEEE 754 does. The loops are written
//! branch-free over plain integers so the compiler vectorizes them (AVX2 on the development machine).

/// How a tensor's values travel on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, bincode::Encode, bincode::Decode)]
pub enum WireDtype {
    /// 32-bit IEEE floats (the values as the shard holds them).
    #[default]
    F32,
    /// bfloat16: f32's exponent range, 8 bits of precision.
    Bf16,
    /// IEEE 754 binary16: 11 bits of precision, magnitudes up to 65,504.
    F16,
}

impl WireDtype {
    /// Bytes per value on the wire.
    pub fn bytes(self) -> usize {
        match self {
            WireDtype::F32 => 4,
            WireDtype::Bf16 | WireDtype::F16 => 2,
        }
    }

    /// The flag and file spelling.
    pub fn name(self) -> &'static str {
        match self {
            WireDtype::F32 => "f32",
            WireDtype::Bf16 => "bf16",
            WireDtype::F16 => "f16",
        }
    }
}

impl std::str::FromStr for WireDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(WireDtype::F32),
            "bf16" | "bfloat16" => Ok(WireDtype::Bf16),
            "f16" | "float16" | "half" => Ok(WireDtype::F16),
            other => Err(format!("unknown wire dtype {other:?}: expected f32, bf16 or f16")),
        }
    }
}

impl std::fmt::Display for WireDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One f32 as bfloat16 bits (round to nearest, ties to even; NaN stays a quiet NaN).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let is_nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    let nan = (bits >> 16) | 0x0040;
    (if is_nan { nan } else { rounded }) as u16
}

/// One bfloat16 as f32 (exact).
#[inline]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// One f32 as IEEE half bits (round to nearest, ties to even; overflow to infinity; subnormals; NaN stays a
/// quiet NaN).
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let abs = bits & 0x7fff_ffff;
    let out = if abs > 0x7f80_0000 {
        // NaN: keep the top payload bits, force quiet.
        0x7e00 | ((abs >> 13) & 0x03ff) as u16
    } else if abs >= 0x477f_f000 {
        // Rounds to a magnitude of 65,520 or more: infinity (also for infinity itself).
        0x7c00
    } else if abs >= 0x3880_0000 {
        // Normal half (|x| >= 2^-14): re-bias the exponent, round the 13 dropped mantissa bits.
        let rebased = abs - 0x3800_0000;
        let round = 0x0fff + ((rebased >> 13) & 1);
        ((rebased + round) >> 13) as u16
    } else if abs >= 0x3300_0000 {
        // Subnormal half (2^-25 <= |x| < 2^-14): shift the full significand into place and round.
        let exp = abs >> 23;
        let mant = (abs & 0x007f_ffff) | 0x0080_0000;
        let shift = 126 - exp; // 14..=24 for exp in 102..=112
        let half_way = 1u32 << (shift - 1);
        let kept = mant >> shift;
        let rest = mant & ((1u32 << shift) - 1);
        let up = rest > half_way || (rest == half_way && kept & 1 == 1);
        (kept + u32::from(up)) as u16
    } else {
        // Below half the smallest subnormal: zero.
        0
    };
    sign | out
}

/// One IEEE half as f32 (exact).
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let mant = u32::from(h & 0x03ff);
    let bits = if exp == 0x1f {
        0x7f80_0000 | (mant << 13)
    } else if exp != 0 {
        ((exp + 112) << 23) | (mant << 13)
    } else if mant == 0 {
        0
    } else {
        // Subnormal: value = mant × 2^-24, exact in f32.
        let v = mant as f32 * f32::from_bits(0x3380_0000);
        return if sign != 0 { -v } else { v };
    };
    f32::from_bits(sign | bits)
}

/// Rounds `values` in place to what survives a trip through `dtype` (nothing changes for f32).
pub fn round_trip(dtype: WireDtype, values: &mut [f32]) {
    match dtype {
        WireDtype::F32 => {}
        WireDtype::Bf16 => values.iter_mut().for_each(|v| *v = bf16_to_f32(f32_to_bf16(*v))),
        WireDtype::F16 => values.iter_mut().for_each(|v| *v = f16_to_f32(f32_to_f16(*v))),
    }
}

/// Encodes `src` as `dtype` values for the wire, in one pass: f32 stays as it is (a copy), 16-bit
/// formats are converted with SIMD (AVX2 or F16C where the CPU has them, checked at run time). The result
/// holds little-endian bytes: `bytes()` of each value.
pub fn encode_bulk(dtype: WireDtype, src: &[f32]) -> Vec<u8> {
    match dtype {
        WireDtype::F32 => crate::wire::f32s_to_le_bytes(src).into_owned(),
        WireDtype::Bf16 | WireDtype::F16 => {
            let mut out = vec![0u16; src.len()];
            encode_u16(dtype, src, &mut out);
            if cfg!(target_endian = "big") {
                out.iter_mut().for_each(|h| *h = h.to_le());
            }
            bytemuck::cast_slice(&out).to_vec()
        }
    }
}

/// Encodes `src` into 16-bit patterns (native order) of `dtype` (which must be a 16-bit format; f32 is
/// refused as `false`). `dst` must have `src`'s length.
pub fn encode_u16(dtype: WireDtype, src: &[f32], dst: &mut [u16]) -> bool {
    // SAFETY: `MaybeUninit<u16>` has `u16`'s layout, and the encoder only writes initialized values.
    #[allow(unsafe_code)]
    let dst = unsafe { &mut *(dst as *mut [u16] as *mut [std::mem::MaybeUninit<u16>]) };
    encode_u16_uninit(dtype, src, dst)
}

/// [`encode_u16`] into memory that need not be initialized (a vector's spare room): every element of
/// `dst` is written when it returns true.
pub fn encode_u16_uninit(dtype: WireDtype, src: &[f32], dst: &mut [std::mem::MaybeUninit<u16>]) -> bool {
    if dst.len() != src.len() || dtype == WireDtype::F32 {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    if simd::available(dtype) {
        #[allow(unsafe_code)]
        // SAFETY: the features the kernels need (AVX2, or AVX-512BW where `wide` says so, and F16C for half)
        // were checked just now.
        unsafe {
            match dtype {
                WireDtype::Bf16 if simd::wide() => simd::encode_bf16_wide(src, dst),
                WireDtype::Bf16 => simd::encode_bf16(src, dst),
                _ => simd::encode_f16(src, dst),
            }
        }
        return true;
    }
    match dtype {
        WireDtype::Bf16 => dst.iter_mut().zip(src).for_each(|(d, x)| {
            d.write(f32_to_bf16(*x));
        }),
        _ => dst.iter_mut().zip(src).for_each(|(d, x)| {
            d.write(f32_to_f16(*x));
        }),
    }
    true
}

/// Decodes whole little-endian `dtype` values from `bytes` (any alignment) into `dst`, whose length must be
/// `bytes.len() / dtype.bytes()`; returns false (writing nothing) when it is not.
pub fn decode_into(dtype: WireDtype, bytes: &[u8], dst: &mut [f32]) -> bool {
    decode_into_uninit(dtype, bytes, as_uninit(dst))
}

/// Initialized values viewed as memory a decoder may overwrite (it only ever writes initialized values).
fn as_uninit(dst: &mut [f32]) -> &mut [std::mem::MaybeUninit<f32>] {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and the decoders only write initialized values.
    #[allow(unsafe_code)]
    unsafe {
        &mut *(dst as *mut [f32] as *mut [std::mem::MaybeUninit<f32>])
    }
}

/// [`decode_into`] into memory that need not be initialized (a vector's spare room): every element of
/// `dst` is written when it returns true.
pub fn decode_into_uninit(dtype: WireDtype, bytes: &[u8], dst: &mut [std::mem::MaybeUninit<f32>]) -> bool {
    if bytes.len() != dst.len() * dtype.bytes() {
        return false;
    }
    match dtype {
        WireDtype::F32 => {
            // SAFETY: `dst` holds exactly `bytes.len()` bytes (checked above); the regions are distinct.
            #[allow(unsafe_code)]
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.as_mut_ptr().cast::<u8>(), bytes.len())
            };
            if cfg!(target_endian = "big") {
                for d in dst.iter_mut() {
                    // SAFETY: every value was written by the copy above.
                    #[allow(unsafe_code)]
                    let v = unsafe { d.assume_init() };
                    d.write(f32::from_bits(u32::from_le(v.to_bits())));
                }
            }
        }
        _ => {
            #[cfg(target_arch = "x86_64")]
            if simd::available(dtype) {
                #[allow(unsafe_code)]
                // SAFETY: the features the kernels need were checked just now; lengths match.
                unsafe {
                    match dtype {
                        WireDtype::Bf16 => simd::decode_bf16(bytes, dst),
                        _ => simd::decode_f16(bytes, dst),
                    }
                }
                return true;
            }
            let halves = bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]]));
            match dtype {
                WireDtype::Bf16 => dst.iter_mut().zip(halves).for_each(|(d, h)| {
                    d.write(bf16_to_f32(h));
                }),
                _ => dst.iter_mut().zip(halves).for_each(|(d, h)| {
                    d.write(f16_to_f32(h));
                }),
            }
        }
    }
    true
}

/// [`decode_into`] for a destination that will not be read again soon and is larger than the caches (a
/// pulled model of megabytes): where the CPU has AVX2 and F16C, the values go to memory with non-temporal
/// stores, which skip reading each destination line into the cache before overwriting it (measured by
/// `cargo bench --bench codec`: 1.6–2.6× the values per second of [`decode_into`] into cold memory).
/// Elsewhere it is [`decode_into`].
pub fn decode_into_streaming(dtype: WireDtype, bytes: &[u8], dst: &mut [f32]) -> bool {
    decode_into_streaming_uninit(dtype, bytes, as_uninit(dst))
}

/// [`decode_into_streaming`] into memory that need not be initialized: every element of `dst` is written
/// when it returns true.
pub fn decode_into_streaming_uninit(dtype: WireDtype, bytes: &[u8], dst: &mut [std::mem::MaybeUninit<f32>]) -> bool {
    if bytes.len() != dst.len() * dtype.bytes() {
        return false;
    }
    #[cfg(all(target_arch = "x86_64", target_endian = "little"))]
    if simd::available(WireDtype::F16) {
        // SAFETY: AVX2 and F16C were checked just now; lengths match.
        #[allow(unsafe_code)]
        unsafe {
            simd::decode_streaming(dtype, bytes, dst)
        };
        return true;
    }
    decode_into_uninit(dtype, bytes, dst)
}

/// Whether every value `bytes` encodes in `dtype` is finite, read from the wire patterns themselves (NaN
/// and ±∞ are the patterns whose exponent bits are all set, in each format): a receiver that writes the
/// decoded values past the cache checks them here, on the bytes it just received.
pub fn wire_all_finite(dtype: WireDtype, bytes: &[u8]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd::available(WireDtype::Bf16) {
        // SAFETY: AVX2 was checked just now.
        #[allow(unsafe_code)]
        return unsafe { simd::wire_all_finite(dtype, bytes) };
    }
    wire_all_finite_portable(dtype, bytes)
}

/// [`wire_all_finite`] as plain code (a branch-free min the compiler vectorizes).
#[inline(always)]
fn wire_all_finite_portable(dtype: WireDtype, bytes: &[u8]) -> bool {
    match dtype {
        WireDtype::F32 => {
            const INF: u32 = 0x7f80_0000;
            bytes
                .chunks_exact(4)
                .fold(u32::MAX, |m, b| m.min((u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & INF) ^ INF))
                != 0
        }
        WireDtype::Bf16 | WireDtype::F16 => {
            let inf: u16 = if dtype == WireDtype::Bf16 { 0x7f80 } else { 0x7c00 };
            bytes.chunks_exact(2).fold(u16::MAX, |m, b| m.min((u16::from_le_bytes([b[0], b[1]]) & inf) ^ inf)) != 0
        }
    }
}

/// Decodes whole `dtype` values from `bytes` and appends them to `out`, written straight into its spare
/// room (no zero-filling first, no staging buffer).
pub fn decode_extend(dtype: WireDtype, bytes: &[u8], out: &mut Vec<f32>) {
    extend_with(dtype, bytes, out, decode_into_uninit);
}

/// Appends the whole values of `bytes` to `out`, decoded by `decode` straight into its spare room.
fn extend_with(
    dtype: WireDtype,
    bytes: &[u8],
    out: &mut Vec<f32>,
    decode: fn(WireDtype, &[u8], &mut [std::mem::MaybeUninit<f32>]) -> bool,
) {
    let n = bytes.len() / dtype.bytes();
    out.reserve(n);
    let start = out.len();
    if decode(dtype, &bytes[..n * dtype.bytes()], &mut out.spare_capacity_mut()[..n]) {
        // SAFETY: `decode` wrote all `n` values after `start` (it returned true: the decoders write every
        // element then), within the capacity reserved above.
        #[allow(unsafe_code)]
        unsafe {
            out.set_len(start + n)
        };
    }
}

/// Wire values laid out in an f32 buffer ("packed"), as a sender hands them to the transport without a
/// second pass: every run of consecutive sections in one format starts at a new slot; f32 runs hold their
/// values, 16-bit runs their little-endian halves two to a slot (the first half in the slot's low-address
/// bytes), the last slot of an odd run padded with zero. [`packed_runs`] tells where each run lies.
#[derive(Debug)]
pub struct Packer {
    out: Vec<f32>,
    run: Option<WireDtype>,
    /// A 16-bit run's last half while it waits for its pair.
    pending: Option<u16>,
}

/// Two little-endian 16-bit values as the f32 slot whose bytes they are.
fn pair(first: u16, second: u16) -> f32 {
    bytemuck::cast::<[u16; 2], f32>([first.to_le(), second.to_le()])
}

impl Packer {
    /// Appends to `out` (usually an empty buffer from the recycler).
    pub fn new(out: Vec<f32>) -> Self {
        Packer { out, run: None, pending: None }
    }

    fn end_run(&mut self) {
        if let Some(h) = self.pending.take() {
            self.out.push(pair(h, 0));
        }
    }

    /// Appends `values` in `dtype`: converted block by block through a stack buffer (16-bit formats), or
    /// copied (f32). A change of format starts a new run.
    pub fn push(&mut self, dtype: WireDtype, values: &[f32]) {
        self.push_with(dtype, values, |_| {});
    }

    /// [`Packer::push`], calling `each` on every block of `values` right after it was converted (while it
    /// is in the cache; once on all of `values` for f32).
    pub fn push_with(&mut self, dtype: WireDtype, values: &[f32], mut each: impl FnMut(&[f32])) {
        if self.run != Some(dtype) {
            self.end_run();
            self.run = Some(dtype);
        }
        if dtype == WireDtype::F32 {
            each(values);
            self.out.extend_from_slice(values);
            return;
        }
        const BLOCK: usize = 4096;
        self.out.reserve(values.len().div_ceil(2));
        if let Some(first) = self.pending.take() {
            // One half behind (an odd chunk earlier in the run): pair across the slots, through a stage.
            let mut carry = Some(first);
            let mut stage = [0u16; BLOCK];
            for src in values.chunks(BLOCK) {
                let halves = &mut stage[..src.len()];
                encode_u16(dtype, src, halves);
                each(src);
                for h in halves.iter() {
                    match carry.take() {
                        Some(c) => self.out.push(pair(c, *h)),
                        None => carry = Some(*h),
                    }
                }
            }
            self.pending = carry;
            return;
        }
        // In step with the slots: halves converted straight into the buffer's spare room, block by block
        // (`BLOCK` is even, so only the last block can leave a half over, kept for the next chunk).
        for src in values.chunks(BLOCK) {
            let slots = src.len().div_ceil(2);
            let start = self.out.len();
            let room = &mut self.out.spare_capacity_mut()[..slots];
            // SAFETY: `MaybeUninit<f32>` slots viewed as twice as many `MaybeUninit<u16>` (same alignment or
            // weaker, same bytes).
            #[allow(unsafe_code)]
            let halves = unsafe {
                std::slice::from_raw_parts_mut(room.as_mut_ptr().cast::<std::mem::MaybeUninit<u16>>(), 2 * slots)
            };
            encode_u16_uninit(dtype, src, &mut halves[..src.len()]);
            each(src);
            let whole = src.len() / 2;
            if src.len() % 2 == 1 {
                // SAFETY: the encoder wrote all `src.len()` halves; this is the last of them.
                #[allow(unsafe_code)]
                let last = unsafe { halves[src.len() - 1].assume_init() };
                self.pending = Some(last);
            }
            if cfg!(target_endian = "big") {
                for h in &mut halves[..2 * whole] {
                    // SAFETY: the encoder wrote these halves.
                    #[allow(unsafe_code)]
                    let native = unsafe { h.assume_init() };
                    h.write(native.to_le());
                }
            }
            // SAFETY: the first `whole` slots after `start` hold two encoded halves each.
            #[allow(unsafe_code)]
            unsafe {
                self.out.set_len(start + whole)
            };
        }
    }

    /// The packed buffer.
    pub fn finish(mut self) -> Vec<f32> {
        self.end_run();
        self.out
    }
}

/// Where each run of a packed payload of `sections` lies: its format, its slots in the buffer and its
/// bytes on the wire; and the slots in all.
pub fn packed_runs(sections: &[(u64, WireDtype)]) -> (Vec<(WireDtype, std::ops::Range<usize>, usize)>, usize) {
    let mut runs: Vec<(WireDtype, u64)> = Vec::new();
    for (n, dtype) in sections {
        match runs.last_mut() {
            Some((d, count)) if d == dtype => *count += n,
            _ => runs.push((*dtype, *n)),
        }
    }
    let mut at = 0usize;
    let out = runs
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(dtype, n)| {
            let n = n as usize;
            let slots = if dtype == WireDtype::F32 { n } else { n.div_ceil(2) };
            let range = at..at + slots;
            at += slots;
            (dtype, range, n * dtype.bytes())
        })
        .collect();
    (out, at)
}

/// `values` in `dtype`'s little-endian wire bytes, one value at a time (the tests' reference).
#[cfg(test)]
fn encode_slice_bytes_for_test(dtype: WireDtype, values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|v| match dtype {
            WireDtype::F32 => v.to_le_bytes().to_vec(),
            WireDtype::Bf16 => f32_to_bf16(*v).to_le_bytes().to_vec(),
            WireDtype::F16 => f32_to_f16(*v).to_le_bytes().to_vec(),
        })
        .collect()
}

/// The vector kernels: the scalar conversions compiled for AVX2 (bfloat16 is integer arithmetic the
/// compiler vectorizes) and F16C's conversion instructions (half precision, round to nearest even).
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod simd {
    use super::*;
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    pub(super) fn available(dtype: WireDtype) -> bool {
        std::arch::is_x86_feature_detected!("avx2")
            && (dtype != WireDtype::F16 || std::arch::is_x86_feature_detected!("f16c"))
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn wire_all_finite(dtype: WireDtype, bytes: &[u8]) -> bool {
        wire_all_finite_portable(dtype, bytes)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn all_finite(values: &[f32]) -> bool {
        all_finite_portable(values)
    }

    /// AVX-512BW is there (its 32-to-16-bit packing makes the bfloat16 encoder a third faster).
    pub(super) fn wide() -> bool {
        std::arch::is_x86_feature_detected!("avx512bw")
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn encode_bf16(src: &[f32], dst: &mut [MaybeUninit<u16>]) {
        dst.iter_mut().zip(src).for_each(|(d, x)| {
            d.write(f32_to_bf16(*x));
        });
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn encode_bf16_wide(src: &[f32], dst: &mut [MaybeUninit<u16>]) {
        dst.iter_mut().zip(src).for_each(|(d, x)| {
            d.write(f32_to_bf16(*x));
        });
    }

    /// [`super::decode_into`] with the 32-byte-aligned body of `dst` written by non-temporal stores, 8
    /// values at a time (the few values before and after it as usual), then a store fence. Needs AVX2, and
    /// F16C for half.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn decode_streaming(dtype: WireDtype, bytes: &[u8], dst: &mut [MaybeUninit<f32>]) {
        let width = dtype.bytes();
        let misaligned = dst.as_ptr() as usize % 32;
        let lead = if misaligned == 0 { 0 } else { ((32 - misaligned) / 4).min(dst.len()) };
        let body = (dst.len() - lead) / 8 * 8;
        let (head, rest) = dst.split_at_mut(lead);
        let (middle, tail) = rest.split_at_mut(body);
        super::decode_into_uninit(dtype, &bytes[..lead * width], head);
        let src = &bytes[lead * width..(lead + body) * width];
        for (i, out) in middle.chunks_exact_mut(8).enumerate() {
            let at = src.as_ptr().add(i * 8 * width);
            // SAFETY: `src` holds 8 values of `width` bytes from `at` (unaligned loads); `out` is 8 floats
            // starting on a 32-byte boundary (the lead was cut off so that it does).
            let v = match dtype {
                WireDtype::F32 => _mm256_loadu_si256(at.cast()),
                WireDtype::Bf16 => _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(at.cast()))),
                WireDtype::F16 => _mm256_castps_si256(_mm256_cvtph_ps(_mm_loadu_si128(at.cast()))),
            };
            _mm256_stream_si256(out.as_mut_ptr().cast(), v);
        }
        _mm_sfence();
        super::decode_into_uninit(dtype, &bytes[(lead + body) * width..], tail);
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn decode_bf16(bytes: &[u8], dst: &mut [MaybeUninit<f32>]) {
        for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
            d.write(bf16_to_f32(u16::from_le_bytes([b[0], b[1]])));
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn encode_f16(src: &[f32], dst: &mut [MaybeUninit<u16>]) {
        let whole = src.len() / 8 * 8;
        for (s, d) in src[..whole].chunks_exact(8).zip(dst[..whole].chunks_exact_mut(8)) {
            // SAFETY: each chunk holds 8 values; the loads and stores are unaligned.
            unsafe {
                let v = _mm256_loadu_ps(s.as_ptr());
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
                _mm_storeu_si128(d.as_mut_ptr().cast(), h);
            }
        }
        dst[whole..].iter_mut().zip(&src[whole..]).for_each(|(d, x)| {
            d.write(f32_to_f16(*x));
        });
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn decode_f16(bytes: &[u8], dst: &mut [MaybeUninit<f32>]) {
        let whole = dst.len() / 8 * 8;
        for (b, d) in bytes[..whole * 2].chunks_exact(16).zip(dst[..whole].chunks_exact_mut(8)) {
            // SAFETY: each chunk holds 16 bytes and 8 destination values; unaligned loads and stores.
            unsafe {
                let h = _mm_loadu_si128(b.as_ptr().cast());
                _mm256_storeu_ps(d.as_mut_ptr().cast(), _mm256_cvtph_ps(h));
            }
        }
        for (d, b) in dst[whole..].iter_mut().zip(bytes[whole * 2..].chunks_exact(2)) {
            d.write(f16_to_f32(u16::from_le_bytes([b[0], b[1]])));
        }
    }
}

/// The index of the first value that is NaN or infinite, if any. Every received gradient and parameter goes
/// through this check, so it is written to vectorize: blocks are scanned without an early exit (the largest
/// `|bits|` of a block; NaN and ±∞ are exactly the magnitudes at or above the infinity pattern), and only a
/// block that holds a bad value is searched element by element.
pub fn first_non_finite(values: &[f32]) -> Option<usize> {
    const BLOCK: usize = 512;
    for (b, block) in values.chunks(BLOCK).enumerate() {
        if !all_finite(block) {
            return block.iter().position(|v| !v.is_finite()).map(|i| b * BLOCK + i);
        }
    }
    None
}

/// True when no value of `values` is NaN or infinite: the exponent bits of every value are ORed together as
/// "all ones" flags, without an early exit, so the loop is a few vector instructions per 8 values (AVX2,
/// checked at run time) or 4 (SSE2).
pub fn all_finite(values: &[f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        #[allow(unsafe_code)]
        // SAFETY: AVX2 was detected just now.
        return unsafe { simd::all_finite(values) };
    }
    all_finite_portable(values)
}

#[inline(always)]
fn all_finite_portable(values: &[f32]) -> bool {
    const INF: u32 = 0x7f80_0000;
    // (bits & INF) ^ INF is zero exactly for NaN and ±∞; its minimum over the values is zero iff one is.
    values.iter().fold(u32::MAX, |m, v| m.min((v.to_bits() & INF) ^ INF)) != 0
}

/// [`decode_extend`] that also tells whether every decoded value is finite (true) or some value is NaN or
/// infinite (false): each run is checked right after it is decoded, while it is still in the cache, so the
/// check costs no second pass over memory (a receiver validates a bulk payload this way).
pub fn decode_extend_finite(dtype: WireDtype, bytes: &[u8], out: &mut Vec<f32>) -> bool {
    const STEP: usize = 4096;
    let mut finite = true;
    for piece in bytes.chunks(STEP * dtype.bytes()) {
        let start = out.len();
        decode_extend(dtype, piece, out);
        finite &= all_finite(&out[start..]);
    }
    finite
}

/// [`decode_extend_finite`] for a payload of megabytes that goes past the cache
/// ([`decode_into_streaming`]): each run is checked on its wire bytes ([`wire_all_finite`]) while they are in
/// the cache, then decoded with non-temporal stores.
pub fn decode_extend_finite_streaming(dtype: WireDtype, bytes: &[u8], out: &mut Vec<f32>) -> bool {
    let whole = bytes.len() / dtype.bytes() * dtype.bytes();
    let finite = wire_all_finite(dtype, &bytes[..whole]);
    extend_with(dtype, bytes, out, decode_into_streaming_uninit);
    finite
}

#[cfg(test)]
mod tests;
