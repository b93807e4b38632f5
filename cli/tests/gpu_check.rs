//! `scripts/gpu-check`, the GPU kit, must fail loudly where there is no GPU: never a green report that ran
//! nothing. A stand-in `nvidia-smi` that lists no GPU is put first on the PATH, so this holds on any machine,
//! a GPU machine too.

use std::path::Path;
use std::process::Command;

#[test]
fn gpu_check_fails_with_the_reason_and_a_failing_report_when_no_gpu_is_listed() {
    let dir = gaps_common::scratch_dir("gaps-gpu-check").expect("temporary folder");
    let smi = dir.join("nvidia-smi");
    std::fs::write(&smi, "#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n").expect("stand-in nvidia-smi");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let report = dir.join("report.md");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu-check");
    let path = format!("{}:{}", dir.display(), std::env::var("PATH").unwrap_or_default());
    let out = Command::new("bash")
        .arg(&script)
        .arg("--report")
        .arg(&report)
        .env("PATH", path)
        .output()
        .expect("run scripts/gpu-check");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "gpu-check must fail without a GPU:\n{stderr}");
    assert!(stderr.contains("FAIL: no NVIDIA GPU"), "the reason is said:\n{stderr}");
    let text = std::fs::read_to_string(&report).expect("a report is written");
    assert!(text.contains("**FAIL: no NVIDIA GPU on this machine; no GPU check ran.**"), "{text}");
    assert!(!text.contains("PASS"), "nothing passes: {text}");
    let _ = std::fs::remove_dir_all(&dir);
}
