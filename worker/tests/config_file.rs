//! `gaps-worker --config FILE`: the binary's own command line reads the file (the parsing is tested in
//! gaps-transport; this checks the binary is wired to it).

use std::process::Command;

#[test]
fn gaps_worker_reads_its_config_file_and_refuses_a_bad_one() {
    let dir = gaps_common::scratch_dir("gaps-worker-config").expect("temp dir");
    let file = dir.join("gaps.toml");
    let config = format!("--config={}", file.display());
    std::fs::write(&file, "[worker]\nsteps = \"lots\"\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_gaps-worker")).arg(&config).output().expect("run gaps-worker");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--steps") && stderr.contains("lots") && stderr.contains("gaps.toml"), "{stderr}");
    std::fs::write(&file, "[worker]\nstepz = 3\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_gaps-worker")).arg(&config).output().expect("run gaps-worker");
    assert!(String::from_utf8_lossy(&out.stderr).contains("stepz"));
    // Valid settings reach the program: with every required flag in the file, it gets as far as loading
    // the certificate the file names.
    let missing = dir.join("no-such-ca.pem");
    std::fs::write(
        &file,
        format!(
            "coordinator = \"127.0.0.1:9\"\nca = \"{0}\"\n[worker]\ncert = \"{0}\"\nkey = \"{0}\"\nsteps = 1\n",
            missing.display()
        ),
    )
    .expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_gaps-worker")).arg(&config).output().expect("run gaps-worker");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("no-such-ca.pem"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
