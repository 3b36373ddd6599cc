//! Lines of text read with a bound on each: a file without line breaks (`/dev/zero`, a binary
//! given by mistake) is an error at the bound, not a read of all of memory.

use std::io::{BufRead, Read};

/// The lines of `reader`, each at most `max_bytes` long (its line break not counted); a longer
/// one ends the iteration with an `InvalidData` error saying so. Like [`BufRead::lines`], line
/// breaks (`\n`, `\r\n`) are stripped and invalid UTF-8 is an error.
pub fn bounded_lines<R: BufRead>(
    reader: R,
    max_bytes: usize,
) -> impl Iterator<Item = std::io::Result<String>> {
    let mut reader = reader;
    let mut failed = false;
    std::iter::from_fn(move || {
        if failed {
            return None;
        }
        let mut buf = Vec::new();
        // One byte over the bound, plus the line break itself.
        let read = (&mut reader)
            .take(max_bytes as u64 + 2)
            .read_until(b'\n', &mut buf);
        let line = match read {
            Ok(0) => return None,
            Ok(_) => {
                if buf.last() == Some(&b'\n') {
                    buf.pop();
                    if buf.last() == Some(&b'\r') {
                        buf.pop();
                    }
                }
                if buf.len() > max_bytes {
                    Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("a line longer than {max_bytes} bytes"),
                    ))
                } else {
                    String::from_utf8(buf)
                        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
                }
            }
            Err(e) => Err(e),
        };
        failed = line.is_err();
        Some(line)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_split_as_bufread_splits_them_and_a_long_one_stops_the_read() {
        let text = "a\nbb\r\n\nccc";
        let lines: Vec<String> = bounded_lines(text.as_bytes(), 3)
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(lines, ["a", "bb", "", "ccc"]);
        let mut long = bounded_lines("ok\nfour\nnever".as_bytes(), 3);
        assert_eq!(long.next().unwrap().unwrap(), "ok");
        let err = long.next().unwrap().unwrap_err();
        assert!(err.to_string().contains("longer than 3 bytes"), "{err}");
        assert!(long.next().is_none());
        // An endless line is read only to the bound.
        let endless = std::io::BufReader::new(std::io::repeat(b'0'));
        assert!(bounded_lines(endless, 1 << 10).next().unwrap().is_err());
    }
}
