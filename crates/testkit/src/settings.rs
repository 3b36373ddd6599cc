//! Benchmark settings read from the environment. A value that does not parse stops the
//! benchmark with its name and what was expected: measuring the default in its place, as a
//! silent fallback would, reports a figure for something nobody asked for.

use std::str::FromStr;

/// `name` from the environment parsed as `T` (surrounding blanks ignored), or `default` when it
/// is unset. Exits (status 2) naming the setting when it is set but does not parse.
pub fn setting<T: FromStr>(name: &str, default: T) -> T {
    parse_setting(read(name).as_deref(), default)
        .unwrap_or_else(|value| refuse(name, value, std::any::type_name::<T>()))
}

/// [`setting`] for a number that must be finite and at least `min` (a rate, a duration):
/// exits naming the setting otherwise (`NaN`, `inf` and negative values parse as `f64`).
pub fn setting_at_least(name: &str, default: f64, min: f64) -> f64 {
    let value = setting(name, default);
    if !(value.is_finite() && value >= min) {
        refuse(
            name,
            &value.to_string(),
            &format!("a finite number of at least {min}"),
        );
    }
    value
}

/// The value of `name` (`None` when unset). Exits naming it when it is set but not UTF-8, so
/// that such a value is not taken for unset.
fn read(name: &str) -> Option<String> {
    match std::env::var(name) {
        Ok(value) => Some(value),
        Err(std::env::VarError::NotPresent) => None,
        Err(std::env::VarError::NotUnicode(value)) => {
            refuse(name, &value.to_string_lossy(), "UTF-8 text")
        }
    }
}

/// [`setting`]'s reading of a value (`None`: unset): the value parsed, the default when
/// unset, or the value that did not parse.
fn parse_setting<T: FromStr>(value: Option<&str>, default: T) -> Result<T, &str> {
    match value {
        Some(value) => value.trim().parse().map_err(|_| value),
        None => Ok(default),
    }
}

/// Each comma-separated part of `name` (or of `default` when it is unset) parsed by `parse`,
/// empty parts skipped. Exits (status 2) naming the setting and `expected` when a part does
/// not parse (`parse` returns `None`), or when it is set and no part is left.
pub fn setting_list<T>(
    name: &str,
    default: &str,
    expected: &str,
    parse: impl Fn(&str) -> Option<T>,
) -> Vec<T> {
    let value = read(name);
    parse_list(value.as_deref(), default, &parse)
        .unwrap_or_else(|| refuse(name, value.as_deref().unwrap_or(default), expected))
}

/// [`setting_list`]'s reading of a value (`None`: unset, so `default`): every part parsed, or
/// `None` when one does not parse or a value set leaves no part.
fn parse_list<T>(
    value: Option<&str>,
    default: &str,
    parse: impl Fn(&str) -> Option<T>,
) -> Option<Vec<T>> {
    let parts: Vec<T> = value
        .unwrap_or(default)
        .split(',')
        .map(str::trim)
        .filter(|part| !part.is_empty())
        .map(parse)
        .collect::<Option<_>>()?;
    (value.is_none() || !parts.is_empty()).then_some(parts)
}

/// Stops the process on a setting it cannot read, naming it and what was expected.
pub fn refuse(name: &str, value: &str, expected: &str) -> ! {
    eprintln!("{name}={value:?}: expected {expected}");
    std::process::exit(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_that_does_not_parse_is_refused_not_replaced_by_the_default() {
        assert_eq!(parse_setting(Some(" 12 "), 64usize), Ok(12));
        assert_eq!(parse_setting(None, 64usize), Ok(64));
        assert_eq!(parse_setting(Some("1e6"), 64usize), Err("1e6"));
        assert_eq!(parse_setting(Some(""), 8.0f64), Err(""));
    }

    #[test]
    fn a_list_with_one_bad_part_or_nothing_in_it_is_refused() {
        let positive = |p: &str| p.parse().ok().filter(|&n: &u32| n > 0);
        assert_eq!(parse_list(None, "16,64", positive), Some(vec![16, 64]));
        assert_eq!(parse_list(Some("4, ,8"), "16", positive), Some(vec![4, 8]));
        assert_eq!(parse_list(Some("4,0"), "16", positive), None);
        assert_eq!(parse_list(Some("4,x"), "16", positive), None);
        assert_eq!(parse_list(Some(" , "), "16", positive), None);
        // An empty default is a valid "nothing chosen" when unset.
        assert_eq!(parse_list(None, "", positive), Some(vec![]));
    }
}
