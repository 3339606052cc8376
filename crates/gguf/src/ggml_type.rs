//! ggml tensor element types and their block layouts.

/// The element type of a tensor.
///
/// The types the rest of Airlock computes with have their own variants; every
/// other ggml type id is kept as [`GgmlType::Other`]. Sizes are known for all
/// ggml types that current llama.cpp writes to files, so tensors of those
/// types still get a correct `byte_len`; a file with an id outside that table
/// is refused by the parser.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    /// Any other ggml type id (Q4_K, BF16, ...), by its raw id.
    Other(u32),
}

/// `(id, name, elements per block, bytes per block)` for every ggml type
/// this crate can size. Ids 4, 5 and 31..=33, 36..=38 were removed from ggml
/// and are deliberately absent. Q8_1 is 36 bytes (two f16 + 32 i8) as in
/// current ggml, not the 40 of old versions.
const TYPE_TABLE: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 36),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
];

impl GgmlType {
    /// The type for a raw ggml type id (never fails; unknown ids become
    /// `Other`).
    pub fn from_id(id: u32) -> GgmlType {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            other => GgmlType::Other(other),
        }
    }

    /// The raw ggml type id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q8_0 => 8,
            GgmlType::Other(id) => id,
        }
    }

    fn entry(self) -> Option<&'static (u32, &'static str, u64, u64)> {
        let id = self.id();
        TYPE_TABLE.iter().find(|e| e.0 == id)
    }

    /// ggml's name for the type (`"Q4_1"`), or `None` for an unknown id.
    pub fn name(self) -> Option<&'static str> {
        self.entry().map(|e| e.1)
    }

    /// Elements per block (1 for plain float/int types, 32 for Q4_0/Q4_1/Q8_0);
    /// `None` for an unknown id.
    pub fn block_size(self) -> Option<u64> {
        self.entry().map(|e| e.2)
    }

    /// Bytes per block (4 for F32, 20 for Q4_1, 34 for Q8_0); `None` for an
    /// unknown id.
    pub fn type_size(self) -> Option<u64> {
        self.entry().map(|e| e.3)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "ggml type {}", self.id()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip() {
        for &(id, name, _, _) in TYPE_TABLE {
            let t = GgmlType::from_id(id);
            assert_eq!(t.id(), id);
            assert_eq!(t.name(), Some(name));
            assert_eq!(t.to_string(), name);
        }
        assert_eq!(GgmlType::from_id(3), GgmlType::Q4_1);
        assert_eq!(GgmlType::from_id(12), GgmlType::Other(12));
        assert_eq!(GgmlType::from_id(4).block_size(), None);
        assert_eq!(GgmlType::from_id(9999).to_string(), "ggml type 9999");
    }

    #[test]
    fn known_sizes() {
        assert_eq!(GgmlType::F32.block_size(), Some(1));
        assert_eq!(GgmlType::F32.type_size(), Some(4));
        assert_eq!(GgmlType::F16.type_size(), Some(2));
        assert_eq!(GgmlType::Q4_0.type_size(), Some(18));
        assert_eq!(GgmlType::Q4_1.block_size(), Some(32));
        assert_eq!(GgmlType::Q4_1.type_size(), Some(20));
        assert_eq!(GgmlType::Q8_0.block_size(), Some(32));
        assert_eq!(GgmlType::Q8_0.type_size(), Some(34));
    }
}
