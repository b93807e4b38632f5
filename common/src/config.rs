//! Small parsers shared by every command line.

use std::time::Duration;

/// Parses a duration: humantime's forms (`250ms`, `30s`, `2m`, `1h 30m`, `2days`) or a plain number of
/// seconds (`1.5`). Negative, non-finite and absurdly long durations are refused.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let parsed = match t.parse::<f64>() {
        Ok(seconds) if seconds.is_finite() && (0.0..=1e9).contains(&seconds) => Duration::from_secs_f64(seconds),
        Ok(_) => return Err(format!("duration {text:?} is out of range")),
        Err(_) => humantime::parse_duration(t)
            .map_err(|e| format!("{text:?} is not a duration ({e}; try 500ms, 30s, 2m or 1h 30m)"))?,
    };
    if parsed > Duration::from_secs(1_000_000_000) {
        return Err(format!("duration {text:?} is out of range"));
    }
    Ok(parsed)
}

/// The multiplier of a unit suffix, as its name says: binary for `Ki`, `Mi`, `Gi`, `Ti` (and with `B`:
/// `KiB` …), decimal for `k`/`K`, `M`, `G`, `T` (and `KB`, `MB`, `GB`, `TB`), as Kubernetes quantities
/// read them. `bytes` allows a trailing `B` (and a bare `B`).
fn unit_scale(unit: &str, bytes: bool) -> Option<f64> {
    let unit = if bytes { unit.strip_suffix('B').unwrap_or(unit) } else { unit };
    Some(match unit {
        "" => 1.0,
        "k" | "K" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "Ki" => 1024.0,
        "Mi" => 1_048_576.0,
        "Gi" => 1_073_741_824.0,
        "Ti" => 1_099_511_627_776.0,
        _ => return None,
    })
}

/// Splits `text` into its number and its unit (the first letter on).
fn number_and_unit(text: &str) -> (&str, &str) {
    let t = text.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    (t[..split].trim(), t[split..].trim())
}

/// Parses a byte count: `2GiB`, `512MiB`, `64KiB`, `1Gi` (binary), `100MB`, `1G`, `500k` (decimal), or a
/// plain number of bytes. Zero, negative and absurd sizes are refused.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let (number, unit) = number_and_unit(text);
    let value: f64 = number.parse().map_err(|_| format!("{text:?} is not a size (try 512MiB or 2GB)"))?;
    let scale = unit_scale(unit, true).ok_or_else(|| {
        format!("unknown size unit {unit:?} in {text:?} (binary: KiB, MiB, GiB, TiB; decimal: KB, MB, GB, TB)")
    })?;
    let bytes = value * scale;
    if !(1.0..1e18).contains(&bytes) {
        return Err(format!("size {text:?} is out of range"));
    }
    Ok(bytes as u64)
}

/// Parses a count: `65536`, `64Ki`, `16Mi` (binary), `10k`, `1M` (decimal); whole numbers from 1 to 2^31.
pub fn parse_count(text: &str) -> Result<usize, String> {
    let (number, unit) = number_and_unit(text);
    let value: u64 = number.parse().map_err(|_| format!("{text:?} is not a count (try 65536, 64Ki or 16Mi)"))?;
    let scale = unit_scale(unit, false)
        .ok_or_else(|| format!("unknown unit {unit:?} in {text:?} (binary: Ki, Mi, Gi; decimal: k, M, G)"))?;
    let n = value as f64 * scale;
    if !(1.0..=2_147_483_648.0).contains(&n) {
        return Err(format!("{text:?} is out of range (1 ..= 2Gi)"));
    }
    Ok(n as usize)
}

/// A straggler as every command writes it: `W:F` (worker `W` is `F` times slower; `F` > 0, below 1 a
/// faster worker) or `W:F:T` (only until time `T`, which the caller reads: a duration for real runs).
/// Returns (W, F, T as written).
pub fn parse_straggler(text: &str) -> Result<(u32, f64, Option<&str>), String> {
    let parts: Vec<&str> = text.split(':').collect();
    let bad = || format!("{text:?}: expected W:F or W:F:T, e.g. 1:4 or 1:4:20s");
    if !(2..=3).contains(&parts.len()) {
        return Err(bad());
    }
    let worker = parts[0].trim().parse().map_err(|_| bad())?;
    let factor: f64 = parts[1].trim().parse().map_err(|_| bad())?;
    if !(factor.is_finite() && factor > 0.0) {
        return Err(format!("{text:?}: the factor must be a positive number"));
    }
    Ok((worker, factor, parts.get(2).map(|t| t.trim())))
}

/// The one table of the words that name an enum's unit variants on the command line and in reports:
/// generates `name()` (variant → word), `NAMES` (every word, in order) and `FromStr` (word → variant; an
/// unknown word is refused with every known one listed, wrapped by `$err` into the type's error).
///
/// ```
/// #[derive(Debug, Clone, Copy, PartialEq)]
/// enum Colour { Red, Blue }
/// gaps_common::named_variants!(Colour, "colour", String, |m: String| m, { Red => "red", Blue => "blue" });
/// assert_eq!("blue".parse::<Colour>(), Ok(Colour::Blue));
/// assert_eq!(Colour::Red.name(), "red");
/// assert_eq!("green".parse::<Colour>().unwrap_err(), "unknown colour \"green\"; use red or blue");
/// ```
#[macro_export]
macro_rules! named_variants {
    ($ty:ident, $what:literal, $err:ty, $wrap:expr, { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            /// Every word, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($name),+];

            /// Its word on the command line and in reports.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)+
                }
            }
        }

        impl ::std::str::FromStr for $ty {
            type Err = $err;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($name => Ok($ty::$variant),)+
                    other => Err(($wrap)($crate::config::unknown_word($what, other, Self::NAMES))),
                }
            }
        }
    };
}

/// "unknown `what` "`word`"; use a, b or c": the refusal of [`named_variants!`].
pub fn unknown_word(what: &str, word: &str, names: &[&str]) -> String {
    let list = match names {
        [] => String::new(),
        [one] => (*one).to_string(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    };
    format!("unknown {what} {word:?}; use {list}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_straggler_grammar() {
        assert_eq!(parse_straggler("1:4"), Ok((1, 4.0, None)));
        assert_eq!(parse_straggler("2:0.5"), Ok((2, 0.5, None)));
        assert_eq!(parse_straggler("1:10:1500ms"), Ok((1, 10.0, Some("1500ms"))));
        for bad in ["1", "1:", "x:4", "1:0", "1:-2", "1:inf", "1:4:5:6"] {
            assert!(parse_straggler(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sizes_and_counts_read_their_units_as_their_names_say() {
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("512Mi"), Ok(512 << 20));
        assert_eq!(parse_bytes("100MB"), Ok(100_000_000));
        assert_eq!(parse_bytes("1G"), Ok(1_000_000_000));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5KiB"), Ok(1536));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes(" 64 KiB "), Ok(64 << 10));
        for bad in ["", "MiB", "12 parsecs", "-1MiB", "0", "1e30", "5Xi"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_count("16Mi"), Ok(16 << 20));
        assert_eq!(parse_count("64Ki"), Ok(65536));
        assert_eq!(parse_count("10k"), Ok(10_000));
        assert_eq!(parse_count("1000"), Ok(1000));
        for bad in ["0", "3Gi", "1.5Ki", "12KiB", "lots"] {
            assert!(parse_count(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn durations_parse_and_garbage_is_refused() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("-1s").is_err());
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
        assert!(parse_duration("3 fortnights").is_err());
        assert!(parse_duration("inf").is_err());
        assert!(parse_duration("100000years").is_err());
    }
}
