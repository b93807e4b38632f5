#[test]
fn first_non_finite_agrees_with_a_plain_scan_at_every_position() {
    use super::first_non_finite;
    let bad = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::from_bits(0xffc0_0001), f32::from_bits(0x7f80_0001)];
    assert_eq!(first_non_finite(&[]), None);
    let clean: Vec<f32> = (0..1500).map(|i| (i as f32 - 700.0) * 1e30 * if i % 3 == 0 { -1.0 } else { 1.0 }).collect();
    let clean: Vec<f32> = clean.iter().map(|v| if v.is_finite() { *v } else { f32::MAX }).collect();
    assert_eq!(first_non_finite(&clean), None);
    assert_eq!(first_non_finite(&[f32::MAX, -f32::MAX, f32::MIN_POSITIVE, 0.0, -0.0]), None);
    for pos in [0, 1, 511, 512, 513, 1023, 1499] {
        for b in bad {
            let mut v = clean.clone();
            v[pos] = b;
            if pos + 7 < v.len() {
                v[pos + 7] = f32::NAN;
            }
            assert_eq!(first_non_finite(&v), Some(pos), "{b} at {pos}");
        }
    }
}

use super::*;

#[test]
fn decoding_with_the_finite_check_flags_exactly_the_payloads_holding_nan_or_infinity() {
    let clean: Vec<f32> = (0..10_000).map(|i| (i as f32 - 5000.0) * 0.37).collect();
    assert!(all_finite(&clean) && all_finite(&[]) && all_finite(&[f32::MAX, -0.0, 1e-45]));
    for dtype in [WireDtype::F32, WireDtype::Bf16, WireDtype::F16] {
        let mut out = Vec::new();
        assert!(decode_extend_finite(dtype, &encode_bulk(dtype, &clean), &mut out), "{dtype}");
        let mut plain = Vec::new();
        decode_extend(dtype, &encode_bulk(dtype, &clean), &mut plain);
        assert_eq!(out, plain, "{dtype}: the same values as without the check");
        for pos in [0, 4095, 4096, 9999] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut v = clean.clone();
                v[pos] = bad;
                assert!(!all_finite(&v), "{bad} at {pos}");
                let mut out = Vec::new();
                assert!(!decode_extend_finite(dtype, &encode_bulk(dtype, &v), &mut out), "{dtype} {bad} at {pos}");
                assert_eq!(out.len(), v.len());
            }
        }
    }
    // A value that overflows half precision becomes infinite on the way: flagged.
    let mut out = Vec::new();
    assert!(!decode_extend_finite(WireDtype::F16, &encode_bulk(WireDtype::F16, &[1e6]), &mut out));
}

/// Every finite half value as f64, ascending, from the definition (sign, exponent, fraction).
fn half_values() -> Vec<(f64, u16)> {
    let mut v: Vec<(f64, u16)> = (0u16..0x7c00)
        .map(|h| {
            let exp = i32::from(h >> 10);
            let frac = f64::from(h & 0x3ff);
            let mag = if exp == 0 { frac * 2f64.powi(-24) } else { (1.0 + frac / 1024.0) * 2f64.powi(exp - 15) };
            (mag, h)
        })
        .collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// The nearest half (ties to the even bit pattern) by search over all of them; infinity above the
/// overflow threshold (65,520).
fn reference_f16(table: &[(f64, u16)], x: f32) -> u16 {
    let sign = if x.is_sign_negative() { 0x8000 } else { 0 };
    let a = f64::from(x.abs());
    if a >= 65520.0 {
        return sign | 0x7c00;
    }
    let i = table.partition_point(|(v, _)| *v < a);
    let pick = if i == 0 {
        table[0].1
    } else if i == table.len() {
        table[i - 1].1
    } else {
        let (lo, hi) = (table[i - 1], table[i]);
        let (dl, dh) = (a - lo.0, hi.0 - a);
        if dl < dh || (dl == dh && lo.1 & 1 == 0) {
            lo.1
        } else {
            hi.1
        }
    };
    sign | pick
}

fn samples() -> Vec<f32> {
    let mut rng = crate::rng::Rng::new(7);
    let mut v: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        65504.0,
        65519.99,
        65520.0,
        1e9,
        6.1035156e-5,
        6.097555e-5,
        5.9604645e-8,
        2.9802322e-8,
        2.9802326e-8,
        1e-10,
        0.1,
        1.0009766,
        1.0004883,
        1.0014648,
        f32::MAX,
        f32::MIN_POSITIVE,
    ];
    for _ in 0..20_000 {
        // Magnitudes spread over the whole half range and beyond, both signs.
        let e = (rng.uniform() * 50.0 - 30.0) as i32;
        let m = 1.0 + rng.uniform();
        let s = if rng.uniform() < 0.5 { -1.0 } else { 1.0 };
        v.push((s * m * 2f64.powi(e)) as f32);
    }
    v
}

#[test]
fn half_matches_the_nearest_representable_value() {
    let table = half_values();
    for x in samples() {
        assert_eq!(f32_to_f16(x), reference_f16(&table, x), "{x:e} ({:#010x})", x.to_bits());
    }
    assert_eq!(f32_to_f16(f32::INFINITY), 0x7c00);
    assert_eq!(f32_to_f16(f32::NEG_INFINITY), 0xfc00);
    assert!(f16_to_f32(f32_to_f16(f32::NAN)).is_nan());
}

#[test]
fn every_half_and_bfloat16_round_trips_exactly() {
    for h in 0u16..=u16::MAX {
        let x = f16_to_f32(h);
        if x.is_nan() {
            assert!(f16_to_f32(f32_to_f16(x)).is_nan());
        } else {
            assert_eq!(f32_to_f16(x), h, "half {h:#06x} = {x:e}");
        }
        let y = bf16_to_f32(h);
        if y.is_nan() {
            assert!(bf16_to_f32(f32_to_bf16(y)).is_nan());
        } else {
            assert_eq!(f32_to_bf16(y), h, "bf16 {h:#06x}");
        }
    }
}

#[test]
fn bfloat16_rounds_to_nearest_even() {
    for x in samples() {
        let h = f32_to_bf16(x);
        let got = f64::from(bf16_to_f32(h));
        if got.is_infinite() {
            // Overflow: at or beyond the largest bf16 plus half a step, (2 - 2^-8) × 2^127.
            assert!(f64::from(x.abs()) >= (2.0 - 2f64.powi(-8)) * 2f64.powi(127), "{x:e} overflowed");
            continue;
        }
        // Neighbours one bf16 step either side are no closer.
        for n in [h.wrapping_sub(1), h.wrapping_add(1)] {
            let other = f64::from(bf16_to_f32(n));
            if other.is_finite() && (other.signum() == got.signum() || got == 0.0) {
                let (d_got, d_other) = ((got - f64::from(x)).abs(), (other - f64::from(x)).abs());
                assert!(d_got < d_other || (d_got == d_other && h & 1 == 0), "{x:e} -> {got:e}, {other:e} closer");
            }
        }
    }
    assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80, "a tie goes to the even pattern");
    assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82, "a tie goes to the even pattern");
    assert_eq!(f32_to_bf16(f32::MAX), 0x7f80, "rounds up to infinity");
}

#[test]
fn streaming_decodes_write_what_plain_decodes_write_at_every_alignment() {
    // Every 16-bit pattern (NaNs compared as NaN: a vector conversion may quiet a signalling one) and
    // f32 values with odd bits, into destinations starting at each of 16 offsets from a 64-byte line.
    let halves: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
    let words: Vec<u8> = (0..70_000u32).flat_map(|i| i.wrapping_mul(0x9E37_79B9).to_le_bytes()).collect();
    for dtype in [WireDtype::F32, WireDtype::Bf16, WireDtype::F16] {
        let source = if dtype == WireDtype::F32 { &words } else { &halves };
        for len in [0usize, 1, 15, 16, 17, 100, 4099, 65536] {
            for offset in 0..16 {
                let bytes = &source[..len * dtype.bytes()];
                let mut plain = vec![0f32; len];
                assert!(decode_into(dtype, bytes, &mut plain));
                let mut room = vec![-1f32; len + 32];
                let start = (16 - room.as_ptr() as usize % 64 / 4) % 16 + offset;
                assert!(decode_into_streaming(dtype, bytes, &mut room[start..start + len]));
                for (i, (a, b)) in plain.iter().zip(&room[start..start + len]).enumerate() {
                    assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{dtype} {i}: {a} {b}");
                }
                assert!(room[..start].iter().chain(&room[start + len..]).all(|v| *v == -1.0), "{dtype}");
                if len > 0 {
                    assert!(!decode_into_streaming(dtype, bytes, &mut plain[1..]), "a length mismatch is refused");
                }
            }
        }
    }
}

#[test]
fn checks_on_wire_bytes_agree_with_checks_on_decoded_values() {
    // Every 16-bit pattern on its own, and f32 patterns around every class (zero, subnormal, normal,
    // the largest finite, ±∞, NaNs), each appended after a clean run and decoded both ways.
    let halves: Vec<u16> = (0..=u16::MAX).collect();
    let special = [0u32, 1, 0x0080_0000, 0x3f80_0000, 0x7f7f_ffff, 0x7f80_0000, 0x7f80_0001, 0x7fc0_0000];
    let words: Vec<u32> = special.iter().flat_map(|w| [*w, w | 0x8000_0000]).collect();
    for dtype in [WireDtype::F32, WireDtype::Bf16, WireDtype::F16] {
        let patterns: Vec<Vec<u8>> = if dtype == WireDtype::F32 {
            words.iter().map(|w| w.to_le_bytes().to_vec()).collect()
        } else {
            halves.iter().map(|h| h.to_le_bytes().to_vec()).collect()
        };
        let clean = encode_bulk(dtype, &(0..37).map(|i| i as f32 - 18.5).collect::<Vec<_>>());
        for p in patterns {
            let bytes: Vec<u8> = clean.iter().chain(&p).copied().collect();
            let (mut a, mut b) = (vec![9.0f32], vec![9.0f32]);
            let plain = decode_extend_finite(dtype, &bytes, &mut a);
            let streamed = decode_extend_finite_streaming(dtype, &bytes, &mut b);
            assert_eq!(plain, streamed, "{dtype} {p:02x?}");
            assert_eq!(plain, wire_all_finite(dtype, &p), "{dtype} {p:02x?}");
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(&b) {
                assert!(x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()), "{dtype} {p:02x?}");
            }
        }
    }
}

#[test]
fn buffers_encode_and_decode() {
    let xs: Vec<f32> = samples().into_iter().filter(|x| x.abs() < 60000.0).take(1000).collect();
    for dtype in [WireDtype::F32, WireDtype::Bf16, WireDtype::F16] {
        let bytes = encode_bulk(dtype, &xs);
        assert_eq!(bytes.len(), xs.len() * dtype.bytes());
        let mut back = vec![0f32; xs.len()];
        assert!(decode_into(dtype, &bytes, &mut back));
        for (x, y) in xs.iter().zip(&back) {
            let tol = match dtype {
                WireDtype::F32 => 0.0,
                WireDtype::Bf16 => x.abs() / 256.0,
                WireDtype::F16 => (x.abs() / 2048.0).max(3e-8),
            };
            assert!((x - y).abs() <= tol, "{dtype}: {x:e} -> {y:e}");
        }
        assert!(!decode_into(dtype, &bytes[1..], &mut back), "a length mismatch is refused");
        assert_eq!(dtype.name().parse::<WireDtype>(), Ok(dtype));
    }
    assert!("f8".parse::<WireDtype>().is_err());
}

#[test]
fn decoding_appends_after_what_the_vector_holds_and_ignores_a_partial_value() {
    use super::{bf16_to_f32, decode_extend, encode_bulk, f16_to_f32, WireDtype};
    let xs: Vec<f32> = samples().into_iter().take(4099).collect();
    for dtype in [WireDtype::F32, WireDtype::Bf16, WireDtype::F16] {
        let bytes = encode_bulk(dtype, &xs);
        let expected: Vec<f32> = bytes
            .chunks_exact(dtype.bytes())
            .map(|b| match dtype {
                WireDtype::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                WireDtype::Bf16 => bf16_to_f32(u16::from_le_bytes([b[0], b[1]])),
                WireDtype::F16 => f16_to_f32(u16::from_le_bytes([b[0], b[1]])),
            })
            .collect();
        // Already holding values, with spare room and without; a trailing partial value is not decoded.
        for spare in [0usize, 10_000] {
            let mut out = Vec::with_capacity(3 + spare);
            out.extend_from_slice(&[1.5f32, -2.5, 7.0]);
            decode_extend(dtype, &bytes[..bytes.len() - 1], &mut out);
            assert_eq!(out.len(), 3 + xs.len() - 1, "{dtype}");
            assert_eq!(&out[..3], &[1.5, -2.5, 7.0], "{dtype}: what was there stays");
            let got: Vec<u32> = out[3..].iter().map(|v| v.to_bits()).collect();
            let want: Vec<u32> = expected[..xs.len() - 1].iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{dtype}");
        }
    }
}

#[test]
fn packed_payloads_hold_each_run_as_its_wire_bytes() {
    use super::{encode_slice_bytes_for_test as wire_bytes, packed_runs, Packer, WireDtype};
    let values: Vec<f32> = (0..9000).map(|i| (i as f32 * 0.37).sin() * 100.0).collect();
    // Chunks of odd and even lengths, formats changing and repeating, an empty section.
    let cases: Vec<Vec<(usize, WireDtype)>> = vec![
        vec![(4097, WireDtype::Bf16), (3, WireDtype::Bf16), (4100, WireDtype::Bf16)],
        vec![(1, WireDtype::F16), (5, WireDtype::F32), (7, WireDtype::Bf16), (0, WireDtype::F32), (9, WireDtype::Bf16)],
        vec![(8192, WireDtype::F32), (1, WireDtype::Bf16)],
        vec![(1, WireDtype::Bf16)],
        // One half behind across several blocks of a long chunk, then back in step.
        vec![(1, WireDtype::Bf16), (5000, WireDtype::Bf16), (2, WireDtype::Bf16), (3, WireDtype::F16)],
    ];
    for sections in cases {
        let mut packer = Packer::new(Vec::new());
        let mut at = 0;
        let mut expected: Vec<Vec<u8>> = Vec::new();
        let mut run: Option<WireDtype> = None;
        for (n, dtype) in &sections {
            packer.push(*dtype, &values[at..at + n]);
            let bytes = wire_bytes(*dtype, &values[at..at + n]);
            match run {
                Some(d) if d == *dtype => expected.last_mut().expect("run").extend(bytes),
                _ => expected.push(bytes),
            }
            run = Some(*dtype);
            at += n;
        }
        let packed = packer.finish();
        let declared: Vec<(u64, WireDtype)> = sections.iter().map(|(n, d)| (*n as u64, *d)).collect();
        let (runs, slots) = packed_runs(&declared);
        assert_eq!(packed.len(), slots, "{sections:?}");
        let got: Vec<Vec<u8>> = runs
            .iter()
            .map(|(_, range, bytes)| bytemuck::cast_slice::<f32, u8>(&packed[range.clone()])[..*bytes].to_vec())
            .collect();
        expected.retain(|b| !b.is_empty());
        assert_eq!(got, expected, "{sections:?}");
    }
}

#[test]
fn bulk_conversions_agree_with_the_scalar_ones_bit_for_bit() {
    let mut xs = samples();
    xs.extend([f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::from_bits(0x7f80_0001)]);
    xs.extend((0..=u16::MAX).map(f16_to_f32));
    for dtype in [WireDtype::Bf16, WireDtype::F16] {
        let scalar: fn(f32) -> u16 = if dtype == WireDtype::Bf16 { f32_to_bf16 } else { f32_to_f16 };
        let back: fn(u16) -> f32 = if dtype == WireDtype::Bf16 { bf16_to_f32 } else { f16_to_f32 };
        // Lengths around the vector width exercise the scalar tails.
        for len in [0, 1, 7, 8, 9, 31, xs.len()] {
            let src = &xs[..len];
            let bytes = encode_bulk(dtype, src);
            assert_eq!(bytes.len(), 2 * len);
            for (x, b) in src.iter().zip(bytes.chunks_exact(2)) {
                let (got, want) = (u16::from_le_bytes([b[0], b[1]]), scalar(*x));
                assert!(
                    got == want || (back(got).is_nan() && back(want).is_nan()),
                    "{dtype} {x:e}: {got:#06x} vs {want:#06x}"
                );
            }
            let mut decoded = vec![0f32; len];
            assert!(decode_into(dtype, &bytes, &mut decoded));
            let mut extended = vec![1.0];
            decode_extend(dtype, &bytes, &mut extended);
            assert_eq!(extended.len(), len + 1);
            for ((b, d), e) in bytes.chunks_exact(2).zip(&decoded).zip(&extended[1..]) {
                let want = back(u16::from_le_bytes([b[0], b[1]]));
                assert!(d.to_bits() == want.to_bits() || (d.is_nan() && want.is_nan()), "{dtype}: {d:e} vs {want:e}");
                assert_eq!(d.to_bits(), e.to_bits());
            }
        }
        // Unaligned input decodes the same.
        let bytes = encode_bulk(dtype, &xs[..100]);
        let mut shifted = vec![0u8; 1];
        shifted.extend_from_slice(&bytes);
        let (mut a, mut b) = (vec![0f32; 100], vec![0f32; 100]);
        assert!(decode_into(dtype, &bytes, &mut a) && decode_into(dtype, &shifted[1..], &mut b));
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        assert!(!decode_into(dtype, &bytes[1..], &mut a), "a length mismatch is refused");
    }
    let f = encode_bulk(WireDtype::F32, &xs[..10]);
    let mut back = vec![0f32; 10];
    assert!(decode_into(WireDtype::F32, &f, &mut back));
    assert!(back.iter().zip(&xs).all(|(a, b)| a.to_bits() == b.to_bits()));
}
