//! The layout file: the model a shard serves, written by a user (or by `gaps layout`) in TOML or JSON.
//!
//! ```toml
//! chunk_elems = 65536          # optional: elements per chunk, the unit of partitioning
//!
//! [[tensor]]
//! name = "mlp.w1"
//! shape = [64, 13]
//! rule = "momentum"            # optional: the shard's --rule otherwise
//! lr = 0.05                    # optional: momentum, weight_decay, dc_lambda, dc_ms_decay likewise
//! wire_dtype = "bf16"          # optional: f32, bf16 or f16 on the wire; the shard's --wire-dtype otherwise
//!
//! [[table]]
//! name = "emb"
//! dim = 16
//! rule = "adagrad"             # optional: the shard's --sparse-rule otherwise
//! lr = 0.05
//! ```
//!
//! JSON has the same structure (`{"chunk_elems": …, "tensor": [{…}], "table": [{…}]}`). Unknown keys are
//! errors, so a misspelt setting is never silently ignored. These file types are separate from the wire
//! types in [`crate::layout`]; [`parse`] converts and validates.

use crate::layout::{Layout, RuleOverride, SparseSpec, TensorSpec};
use serde::{Deserialize, Serialize};

/// Elements per chunk when the file does not say.
pub const DEFAULT_CHUNK_ELEMS: u32 = 65_536;

/// Why a layout file was refused.
#[derive(Debug, thiserror::Error)]
pub enum LayoutFileError {
    /// The text is not valid TOML or JSON of the expected structure.
    #[error("parsing the layout file: {0}")]
    Syntax(String),
    /// The structure is fine but the layout is not.
    #[error("{0}")]
    Layout(#[from] crate::layout::LayoutError),
}

/// The file's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// TOML (`.toml`).
    Toml,
    /// JSON (`.json`).
    Json,
}

impl Format {
    /// The format a path's extension names (TOML unless it ends in `.json`).
    pub fn of_path(path: &std::path::Path) -> Format {
        match path.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("json") => Format::Json,
            _ => Format::Toml,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileLayout {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    chunk_elems: Option<u32>,
    #[serde(default, rename = "tensor")]
    tensors: Vec<FileTensor>,
    #[serde(default, rename = "table", skip_serializing_if = "Vec::is_empty")]
    tables: Vec<FileTable>,
}

/// A `[[tensor]]` or `[[table]]` entry: its own fields, then the optional keys that override the shard's rule
/// (each left out of the file when unset). Declared by a macro because serde cannot flatten a shared struct
/// into one that refuses unknown keys.
macro_rules! file_entry {
    ($name:ident { $($field:ident: $ty:ty),* } optional { $($opt:ident: $opt_ty:ty),* }) => {
        #[derive(Debug, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct $name {
            $($field: $ty,)*
            $(#[serde(default, skip_serializing_if = "Option::is_none")] $opt: Option<$opt_ty>,)*
        }
    };
}

file_entry!(FileTensor { name: String, shape: Vec<u64> } optional {
    rule: String, lr: f32, momentum: f32, weight_decay: f32, dc_lambda: f32, dc_ms_decay: f32, wire_dtype: String
});
file_entry!(FileTable { name: String, dim: u32 } optional { rule: String, lr: f32, momentum: f32, weight_decay: f32 });

/// Parses and validates a layout file's text.
pub fn parse(text: &str, format: Format) -> Result<Layout, LayoutFileError> {
    let file: FileLayout = match format {
        Format::Toml => toml::from_str(text).map_err(|e| LayoutFileError::Syntax(e.to_string()))?,
        Format::Json => serde_json::from_str(text).map_err(|e| LayoutFileError::Syntax(e.to_string()))?,
    };
    let tensors = file
        .tensors
        .into_iter()
        .map(|t| {
            let wire_dtype = match t.wire_dtype {
                None => None,
                Some(d) => Some(
                    d.parse::<crate::dtype::WireDtype>()
                        .map_err(|e| LayoutFileError::Syntax(format!("tensor {:?}: {e}", t.name)))?,
                ),
            };
            let mut spec = TensorSpec::with_shape(t.name, t.shape);
            spec.wire_dtype = wire_dtype;
            spec.rule = RuleOverride {
                rule: t.rule,
                lr: t.lr,
                momentum: t.momentum,
                weight_decay: t.weight_decay,
                dc_lambda: t.dc_lambda,
                dc_ms_decay: t.dc_ms_decay,
            };
            Ok(spec)
        })
        .collect::<Result<Vec<_>, LayoutFileError>>()?;
    let tables = file
        .tables
        .into_iter()
        .map(|t| SparseSpec {
            name: t.name,
            dim: t.dim,
            rule: RuleOverride {
                rule: t.rule,
                lr: t.lr,
                momentum: t.momentum,
                weight_decay: t.weight_decay,
                ..RuleOverride::default()
            },
        })
        .collect();
    Ok(Layout::with_tables(tensors, file.chunk_elems.unwrap_or(DEFAULT_CHUNK_ELEMS), tables)?)
}

/// Writes a layout as a layout file that [`parse`] reads back to the same layout.
pub fn write(layout: &Layout, format: Format) -> String {
    let file = FileLayout {
        chunk_elems: Some(layout.chunk_elems),
        tensors: layout
            .tensors
            .iter()
            .map(|t| FileTensor {
                name: t.name.clone(),
                shape: t.shape.clone(),
                rule: t.rule.rule.clone(),
                lr: t.rule.lr,
                momentum: t.rule.momentum,
                weight_decay: t.rule.weight_decay,
                dc_lambda: t.rule.dc_lambda,
                dc_ms_decay: t.rule.dc_ms_decay,
                wire_dtype: t.wire_dtype.map(|d| d.to_string()),
            })
            .collect(),
        tables: layout
            .tables
            .iter()
            .map(|t| FileTable {
                name: t.name.clone(),
                dim: t.dim,
                rule: t.rule.rule.clone(),
                lr: t.rule.lr,
                momentum: t.rule.momentum,
                weight_decay: t.rule.weight_decay,
            })
            .collect(),
    };
    match format {
        // Serialising these plain structs cannot fail; an empty string would fail to parse loudly.
        Format::Toml => toml::to_string_pretty(&file).unwrap_or_default(),
        Format::Json => serde_json::to_string_pretty(&file).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../tests/fixtures/example_layout.toml");

    #[test]
    fn toml_and_json_round_trip() {
        let layout = parse(EXAMPLE, Format::Toml).expect("example parses");
        assert_eq!(layout.tensors.len(), 2);
        assert_eq!(layout.tensors[0].len, 64 * 13);
        assert_eq!(layout.tensors[0].rule.rule.as_deref(), Some("momentum"));
        assert_eq!(layout.tensors[0].rule.lr, Some(0.05));
        assert_eq!(layout.tables[0].dim, 16);
        assert_eq!(layout.tensors[0].wire_dtype, None);
        assert_eq!(layout.tensors[1].wire_dtype, Some(crate::dtype::WireDtype::Bf16));
        let mut resolved = layout.clone();
        resolved.resolve_wire_dtype(crate::dtype::WireDtype::F16);
        assert_eq!(resolved.wire_dtype(0), crate::dtype::WireDtype::F16);
        assert_eq!(resolved.wire_dtype(1), crate::dtype::WireDtype::Bf16, "the file's setting wins");
        assert_eq!(resolved.fingerprint(), layout.fingerprint(), "the wire format is not part of the model");
        assert!(resolved.same_model(&layout) && resolved != layout);
        let mut other = layout.clone();
        other.tensors[0].shape = vec![13, 64];
        assert!(!other.same_model(&layout));
        for format in [Format::Toml, Format::Json] {
            let text = write(&layout, format);
            assert_eq!(parse(&text, format).expect("written file parses"), layout, "{format:?}:\n{text}");
        }
    }

    #[test]
    fn bad_files_are_clear_errors() {
        let cases = [
            ("[[tensor]]\nname = \"w\"\nshape = [3]\nlearning_rate = 0.1\n", "unknown field"),
            ("[[tensor]]\nname = \"w\"\n", "missing field"),
            ("[[tensor]]\nname = \"w\"\nshape = [0]\n", "elements"),
            ("[[tensor]]\nname = \"w\"\nshape = []\n", "shape"),
            ("[[tensor]]\nname = \"w\"\nshape = [4294967296, 4294967296]\n", "elements"),
            ("[[tensor]]\nname = \"w\"\nshape = [3]\n[[tensor]]\nname = \"w\"\nshape = [3]\n", "named"),
            ("[[tensor]]\nname = \"w\"\nshape = [3]\nlr = nan\n", "non-finite"),
            ("[[tensor]]\nname = \"w\"\nshape = [3]\n[[table]]\nname = \"e\"\ndim = 0\n", "dim"),
            ("chunk_elems = 0\n[[tensor]]\nname = \"w\"\nshape = [3]\n", "chunk_elems"),
            ("", "no tensors"),
            ("[[tensor]\n", "parsing"),
            ("[[tensor]]\nname = \"w\"\nshape = [3]\nwire_dtype = \"fp8\"\n", "unknown wire dtype"),
        ];
        for (text, wanted) in cases {
            let err = parse(text, Format::Toml).expect_err(text).to_string();
            assert!(err.contains(wanted), "{text:?} gave {err:?}, expected it to mention {wanted:?}");
        }
        assert!(parse("{\"tensor\": [{\"name\": \"w\", \"shape\": [2], \"oops\": 1}]}", Format::Json).is_err());
    }
}
