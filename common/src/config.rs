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

#[cfg(test)]
mod tests {
    use super::*;

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
