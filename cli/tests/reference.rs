//! docs/reference/flags.md is what `gaps reference` prints: the checked-in flag reference is current.

#[test]
fn the_flag_reference_is_current() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gaps")).arg("reference").output().expect("run gaps");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8(out.stdout).expect("utf-8");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reference/flags.md");
    let kept = std::fs::read_to_string(&path).expect("docs/reference/flags.md");
    if printed != kept {
        let line = printed.lines().zip(kept.lines()).position(|(a, b)| a != b).map_or_else(
            || {
                format!(
                    "the files differ in length ({} against {} lines)",
                    printed.lines().count(),
                    kept.lines().count()
                )
            },
            |i| format!("first difference at line {}", i + 1),
        );
        panic!(
            "docs/reference/flags.md is not current ({line}): run `cargo run -p gaps-cli -- reference > \
             docs/reference/flags.md` and commit it"
        );
    }
    for section in ["## `gaps local`", "## `gaps server`", "## `gaps worker`", "## `gaps sim sweep`", "--gba-hold"] {
        assert!(kept.contains(section), "{section} is missing from the reference");
    }
}

/// `gaps reference --json server` lists `gaps server`'s flags (the Python launcher builds its shard flags from
/// it), with the server's own defaults; an unknown command is an error.
#[test]
fn one_commands_flags_as_json() {
    let gaps = env!("CARGO_BIN_EXE_gaps");
    let out = std::process::Command::new(gaps).args(["reference", "--json", "server"]).output().expect("run gaps");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let flags: Vec<gaps_cli::reference::Flag> = serde_json::from_slice(&out.stdout).expect("a list of flags");
    let lr = flags.iter().find(|f| f.long.as_deref() == Some("lr")).expect("--lr");
    assert_eq!((lr.value.as_deref(), lr.env.as_deref()), (Some("<LR>"), Some("GAPS_LR")), "{lr:?}");
    assert_eq!(lr.default.len(), 1, "{lr:?}");
    assert!(flags.iter().any(|f| f.long.as_deref() == Some("momentum")), "the shared groups are flattened in");
    let out = std::process::Command::new(gaps).args(["reference", "--json", "nosuch"]).output().expect("run gaps");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no command `gaps nosuch`"));
}
