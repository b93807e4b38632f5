//! A CPU hog for benches: busy processes beside the measured work, so that a bench shows what gaps does on a
//! machine other programs load (`gaps bench transport --hog N`). Processes, not threads: the transport
//! bench counts its own process's CPU time (`getrusage`), which must not include the hog's.

use std::process::{Child, Command, Stdio};

/// `n` busy shell loops at normal priority until dropped (then killed and reaped). Each also stops by itself
/// once the process that started it is gone (a bench interrupted by a signal runs no `Drop`).
#[derive(Debug)]
pub struct CpuHog {
    children: Vec<Child>,
}

impl CpuHog {
    /// Starts `n` busy processes (none for 0).
    pub fn start(n: usize) -> std::io::Result<CpuHog> {
        let mut hog = CpuHog { children: Vec::with_capacity(n) };
        for _ in 0..n {
            // On an error the ones started so far are killed when `hog` is dropped.
            let child = Command::new("/bin/sh")
                .args(["-c", "while kill -0 $PPID 2>/dev/null; do :; done"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?;
            hog.children.push(child);
        }
        Ok(hog)
    }

    /// Busy processes running.
    pub fn processes(&self) -> usize {
        self.children.len()
    }
}

impl Drop for CpuHog {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hog_runs_its_processes_and_stops_them_when_dropped() {
        let mut hog = CpuHog::start(2).expect("processes");
        assert_eq!(hog.processes(), 2);
        for child in &mut hog.children {
            assert!(child.try_wait().expect("status").is_none(), "still busy");
        }
        let pids: Vec<u32> = hog.children.iter().map(Child::id).collect();
        drop(hog);
        for pid in pids {
            // Reaped: no such process any more (or, rarely, the pid reused by another).
            let alive = std::path::Path::new(&format!("/proc/{pid}/cmdline")).exists()
                && std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.starts_with(b"/bin/sh"));
            assert!(!alive, "process {pid} still runs");
        }
        assert_eq!(CpuHog::start(0).expect("none").processes(), 0);
    }
}
