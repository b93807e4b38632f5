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
