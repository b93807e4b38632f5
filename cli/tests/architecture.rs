//! The architecture invariants that the dependency graph states, checked with `cargo tree` and
//! `cargo metadata` on the real workspace (ARCHITECTURE.md names each of these tests).

use std::process::Command;

fn cargo(args: &[&str]) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let out = Command::new(cargo).args(args).current_dir(root).output().expect("running cargo");
    assert!(out.status.success(), "cargo {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("cargo prints UTF-8")
}

/// The package names in `package`'s normal (non-dev, non-build) dependency tree.
fn normal_deps(package: &str) -> Vec<String> {
    let tree = cargo(&["tree", "--offline", "-p", package, "-e", "normal", "--prefix", "none", "--format", "{p}"]);
    tree.lines().filter_map(|l| l.split_whitespace().next()).map(str::to_string).collect()
}

fn assert_absent(package: &str, forbidden: &[&str]) {
    let deps = normal_deps(package);
    assert!(deps.iter().any(|d| d == package), "cargo tree did not list {package} itself: {deps:?}");
    for f in forbidden {
        assert!(!deps.iter().any(|d| d == f), "{package} depends on {f}: {deps:?}");
    }
}

#[test]
fn sans_io_dependencies() {
    // The shard core builds without a runtime, a network stack, metrics or a flag parser.
    assert_absent("gaps-shard", &["tokio", "quinn", "quinn-proto", "metrics", "clap", "rustls", "gaps-transport"]);
    // The bottom crates know nothing of the network either.
    assert_absent("gaps-common", &["tokio", "quinn", "rustls", "rcgen"]);
    assert_absent("gaps-kernels", &["tokio", "quinn"]);
    assert_absent("gaps-models", &["tokio", "quinn", "gaps-transport"]);
    assert_absent("gaps-sim", &["tokio", "quinn", "gaps-transport", "gaps-server", "gaps-worker"]);
}

#[test]
fn the_server_links_no_worker_models_or_data() {
    assert_absent("gaps-server", &["gaps-worker", "gaps-models"]);
    // Both sides share the one transport crate.
    assert!(normal_deps("gaps-server").iter().any(|d| d == "gaps-transport"));
    assert!(normal_deps("gaps-worker").iter().any(|d| d == "gaps-transport"));
    assert_absent("gaps-worker", &["gaps-server", "gaps-shard"]);
}

#[test]
fn the_transport_carries_bytes_and_nothing_a_binary_sets_up() {
    // Flags, config files, logging set-up and certificate issuance are gaps-setup's; the transport loads
    // TLS material and speaks QUIC.
    assert_absent("gaps-transport", &["clap", "tracing-subscriber", "rcgen", "gaps-setup"]);
    let setup = normal_deps("gaps-setup");
    for wanted in ["clap", "rcgen", "tracing-subscriber", "gaps-transport"] {
        assert!(setup.iter().any(|d| d == wanted), "gaps-setup lacks {wanted}: {setup:?}");
    }
}

#[test]
fn benches_hold_benches_and_the_front_door_is_its_own_crate() {
    let meta: serde_json::Value =
        serde_json::from_str(&cargo(&["metadata", "--offline", "--no-deps", "--format-version", "1"]))
            .expect("cargo metadata is JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let bins_of = |name: &str| -> Vec<String> {
        let package = packages.iter().find(|p| p["name"] == name).unwrap_or_else(|| panic!("no package {name}"));
        let targets = package["targets"].as_array().expect("targets");
        targets
            .iter()
            .filter(|t| t["kind"].as_array().is_some_and(|k| k.iter().any(|k| k == "bin")))
            .map(|t| t["name"].as_str().unwrap_or_default().to_string())
            .collect()
    };
    assert!(bins_of("gaps-benches").is_empty(), "gaps-benches has binaries: {:?}", bins_of("gaps-benches"));
    assert_eq!(bins_of("gaps-cli"), vec!["gaps".to_string()]);
    assert_eq!(bins_of("gaps-server"), vec!["gaps-server".to_string()]);
    assert_eq!(bins_of("gaps-worker"), vec!["gaps-worker".to_string()]);
}

/// Every `.rs` file the workspace builds outside tests: (path from the root, text). Test files (`tests/`,
/// `tests.rs` child modules), the fuzz workspace, build output and Python's virtual environments are left out.
fn source_files() -> Vec<(String, String)> {
    let root = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let mut out = Vec::new();
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("a readable folder").flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().to_string();
            if path.is_dir() {
                // A crate's `benches/` and `examples/` are not built into the programs; the workspace's
                // `benches` crate (the bench harness `gaps bench` runs) is.
                let skipped = ["target", "tests", "fuzz", "examples"];
                let crate_benches = name == "benches" && dir != root;
                if !skipped.contains(&name.as_str()) && !crate_benches && !name.starts_with('.') {
                    dirs.push(path);
                }
            } else if name.ends_with(".rs") && name != "tests.rs" {
                let rel = path.strip_prefix(&root).expect("under the root").to_string_lossy().to_string();
                out.push((rel, std::fs::read_to_string(&path).expect("a readable file")));
            }
        }
    }
    out.sort();
    out
}

/// (file, first line, name, lines) of every function in `text`: from its `fn` line to the line that closes it
/// at the same indentation (rustfmt's layout).
fn functions(file: &str, text: &str) -> Vec<(String, usize, String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        let mut rest = trimmed;
        for prefix in ["pub(crate) ", "pub(super) ", "pub ", "async ", "unsafe ", "const "] {
            rest = rest.strip_prefix(prefix).unwrap_or(rest);
        }
        let Some(sig) = rest.strip_prefix("fn ") else { continue };
        if line.trim_end().ends_with(';') || line.trim_end().ends_with('}') {
            continue;
        }
        let name: String = sig.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let close = format!("{indent}}}");
        if let Some(end) = lines[i + 1..].iter().position(|l| *l == close) {
            out.push((file.to_string(), i + 1, name, end + 2));
        }
    }
    out
}

/// Issue 36's rooms: no source file over 800 lines, and no function over 120 outside tests and the kernels'
/// per-rule loops (one arm per rule, read side by side with the reference).
#[test]
fn files_and_functions_stay_small() {
    const EXEMPT: [(&str, &str); 2] = [("kernels/src/fast.rs", "apply_loops"), ("kernels/src/reference.rs", "apply")];
    let files = source_files();
    assert!(files.iter().any(|(f, _)| f == "shard/src/core/mod.rs"), "the walk found the sources: {files:?}");
    let mut problems = Vec::new();
    for (file, text) in &files {
        let n = text.lines().count();
        if n > 800 {
            problems.push(format!("{file}: {n} lines (at most 800 outside tests)"));
        }
        for (_, line, name, len) in functions(file, text) {
            if len <= 120 || EXEMPT.contains(&(file.as_str(), name.as_str())) {
                continue;
            }
            problems.push(format!("{file}:{line} {name}: {len} lines (at most 120)"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The `env = "GAPS_…"` names a Rust source file declares for its flags.
fn declared_variables(text: &str) -> Vec<String> {
    text.split("env = \"").skip(1).filter_map(|rest| rest.split('"').next()).map(str::to_string).collect()
}

/// Every `.rs` file below `dir`.
fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a source folder").map(|e| e.expect("an entry").path()) {
        if entry.is_dir() {
            rust_files(&entry, out);
        } else if entry.extension().is_some_and(|e| e == "rs") {
            out.push(entry);
        }
    }
}

#[test]
fn the_shared_flag_groups_are_declared_once_in_gaps_flags() {
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let shared = declared_variables(&std::fs::read_to_string(root.join("flags/src/lib.rs")).expect("gaps-flags"));
    for wanted in ["GAPS_MOMENTUM", "GAPS_SPARSE_RULE", "GAPS_MODE", "GAPS_GBA_THRESHOLD"] {
        assert!(shared.iter().any(|v| v == wanted), "gaps-flags no longer declares {wanted}: {shared:?}");
    }
    let mut files = Vec::new();
    for krate in
        ["common", "kernels", "shard", "transport", "setup", "server", "models", "worker", "sim", "cli", "benches"]
    {
        rust_files(&root.join(krate).join("src"), &mut files);
    }
    for file in files {
        let again: Vec<String> = declared_variables(&std::fs::read_to_string(&file).expect("a source file"))
            .into_iter()
            .filter(|v| shared.contains(v))
            .collect();
        assert!(again.is_empty(), "{} declares gaps-flags' {again:?} again: flatten the group instead", file.display());
    }
}
