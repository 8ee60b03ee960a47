//! The one parser for each kind of scalar kvtier reads from text: booleans and whole numbers.
//! Configuration layers, the remote URL's options and the Python bindings' adapter keys all call
//! these, so a value accepted in one place is accepted (and means the same) everywhere.

/// A boolean as text: `true/false`, `1/0`, `yes/no`, `on/off` (case-insensitive, surrounding
/// spaces ignored); the empty string is `false` (an exported but empty variable). `None` for
/// anything else.
pub fn parse_bool(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" | "" => Some(false),
        _ => None,
    }
}

/// The reason [`parse_bool`] refused `text`, for error messages.
pub fn bool_reason(text: &str) -> String {
    format!("`{text}` is not a boolean (true/false, 1/0, yes/no, on/off)")
}

/// A whole number >= 0 as text; `_` separators are allowed (`1_000_000`).
pub fn parse_u64(text: &str) -> Option<u64> {
    let t = text.trim().replace('_', "");
    if t.is_empty() || t.starts_with('+') {
        return None;
    }
    t.parse::<u64>().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn booleans() {
        for t in ["1", "true", "TRUE", " yes ", "On"] {
            assert_eq!(parse_bool(t), Some(true), "{t}");
        }
        for t in ["0", "false", "No", "off", ""] {
            assert_eq!(parse_bool(t), Some(false), "{t}");
        }
        for t in ["2", "maybe", "tru", "y"] {
            assert_eq!(parse_bool(t), None, "{t}");
        }
    }

    #[test]
    fn whole_numbers() {
        assert_eq!(parse_u64("1_000"), Some(1000));
        assert_eq!(parse_u64(" 7 "), Some(7));
        assert_eq!(parse_u64("-1"), None);
        assert_eq!(parse_u64("+1"), None);
        assert_eq!(parse_u64("1.5"), None);
        assert_eq!(parse_u64(""), None);
    }
}
