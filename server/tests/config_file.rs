//! `gaps-server --config FILE`: the binary's own command line reads the file (the parsing is tested in
//! gaps-transport; this checks the binary is wired to it).

use std::process::Command;

#[test]
fn gaps_server_reads_its_config_file_and_refuses_a_bad_one() {
    let dir = gaps_common::scratch_dir("gaps-server-config").expect("temp dir");
    let file = dir.join("gaps.toml");
    let config = format!("--config={}", file.display());
    std::fs::write(&file, "[server]\nlisen = \"0.0.0.0:7000\"\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_gaps-server")).arg(&config).output().expect("run gaps-server");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("lisen") && stderr.contains("gaps.toml"), "{stderr}");
    // Required flags from the file: the server gets as far as reading the CA the file names.
    let missing = dir.join("no-such-ca.pem");
    std::fs::write(
        &file,
        format!(
            "ca = \"{0}\"\nlayout = \"{0}\"\n[server]\ncert = \"{0}\"\nkey = \"{0}\"\nlisten = \"127.0.0.1:0\"\n",
            missing.display()
        ),
    )
    .expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_gaps-server")).arg(&config).output().expect("run gaps-server");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("no-such-ca.pem"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
