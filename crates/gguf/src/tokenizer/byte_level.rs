//! GPT-2's byte-level alphabet: every byte is shown as a printable character
//! (`' '` as `'Ġ'`, `'\n'` as `'Ċ'`...) so that vocabulary entries are text.

use std::sync::OnceLock;

/// The character that stands for each byte.
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next_extra = 256u32;
    for byte in 0..=255u8 {
        let printable = matches!(byte, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(byte)
        } else {
            let code = next_extra;
            next_extra += 1;
            code
        };
        // Codes are below 256 + 256, all valid scalar values.
        table[usize::from(byte)] = char::from_u32(code).unwrap_or('\0');
    }
    table
}

/// The byte a byte-level character stands for, if it is one.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    static TABLE: OnceLock<[Option<u8>; 324]> = OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut table = [None; 324];
        for (byte, c) in (0..=255u8).zip(byte_to_char_table()) {
            // All table characters are below 324.
            if let Some(slot) = table.get_mut(c as usize) {
                *slot = Some(byte);
            }
        }
        table
    });
    table.get(c as usize).copied().flatten()
}

/// Decodes a byte-level vocabulary string to the bytes it stands for;
/// characters outside the alphabet are kept as their UTF-8.
pub(crate) fn decode(text: &str, out: &mut Vec<u8>) {
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_a_bijection() {
        let table = byte_to_char_table();
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(table[usize::from(b)]), Some(b), "byte {b}");
        }
        assert_eq!(table[usize::from(b' ')], 'Ġ');
        assert_eq!(table[usize::from(b'\n')], 'Ċ');
        assert_eq!(table[usize::from(b'\t')], 'ĉ');
        assert_eq!(table[usize::from(b'a')], 'a');
        assert_eq!(char_to_byte('€'), None);
        let mut out = Vec::new();
        decode("ĠhelloĊ€", &mut out);
        assert_eq!(out, b" hello\n\xe2\x82\xac");
    }
}
