//! Command-line numbers that become durations or intervals (`500ms`, `10s`, `2m`, seconds, rates), checked when parsed: a value that
//! is not a number, is negative, or is too large for a duration is a clear error, not a panic
//! deep in the command (`Duration::from_secs_f64` panics past 2⁶⁴ seconds, on NaN and below 0).

/// The most seconds a command-line duration may say (about 31 years, as the router's
/// configuration allows).
const MAX_SECONDS: f64 = 1e9;

/// Seconds: a number within 0–1e9.
pub(crate) fn seconds(text: &str) -> Result<f64, String> {
    let value: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    if !(0.0..=MAX_SECONDS).contains(&value) {
        return Err(format!("{text:?} must be within 0–{MAX_SECONDS} seconds"));
    }
    Ok(value)
}

/// Seconds, above 0 (a timeout).
pub(crate) fn positive_seconds(text: &str) -> Result<f64, String> {
    let value = seconds(text)?;
    if value > 0.0 {
        Ok(value)
    } else {
        Err(format!("{text:?} must be above 0 seconds"))
    }
}

/// A rate, per second, whose interval is a duration: within 1e-6–1e6.
pub(crate) fn rate(text: &str) -> Result<f64, String> {
    let value: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a rate"))?;
    if !(1e-6..=1e6).contains(&value) {
        return Err(format!("{text:?} must be within 1e-6–1e6 per second"));
    }
    Ok(value)
}

/// Parses durations such as `500ms`, `10s`, `2m`.
pub(crate) fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration like 500ms, 10s or 2m"))?;
    let seconds = match unit {
        "ms" => value / 1000.0,
        "s" | "" => value,
        "m" => value * 60.0,
        _ => return Err(format!("unknown unit {unit:?} in {text:?}: use ms, s or m")),
    };
    duration_of(seconds).map_err(|e| format!("{text:?}: {e}"))
}

/// `seconds` as a duration; one of at most [`MAX_SECONDS`].
pub(crate) fn duration_of(seconds: f64) -> Result<std::time::Duration, String> {
    if !(0.0..=MAX_SECONDS).contains(&seconds) {
        return Err(format!(
            "{seconds} s is not a duration within 0–{MAX_SECONDS} s"
        ));
    }
    std::time::Duration::try_from_secs_f64(seconds).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_that_cannot_be_durations_are_refused() {
        for bad in ["NaN", "inf", "-1", "1e30", "x", ""] {
            assert!(seconds(bad).is_err(), "{bad}");
        }
        assert_eq!(seconds("0"), Ok(0.0));
        assert!(positive_seconds("0").is_err());
        assert_eq!(positive_seconds("2.5"), Ok(2.5));
        for bad in ["1e-300", "0", "NaN", "inf", "-3", "1e7"] {
            assert!(rate(bad).is_err(), "{bad}");
        }
        assert_eq!(rate("20"), Ok(20.0));
        assert!(duration_of(1e20).is_err());
        assert!(duration_of(f64::NAN).is_err());
        assert_eq!(duration_of(1.5), Ok(std::time::Duration::from_millis(1500)));
    }
}
