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
