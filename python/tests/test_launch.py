"""`python -m gaps.launch`: a cluster and N worker processes from one command, their output prefixed by
rank, one summary line; SIGTERM or Ctrl-C of the launcher leaves no process behind."""

import json
import signal
import subprocess
import sys
import textwrap
import time

WORKER = """
import os, sys, time
import numpy as np
import gaps

rank, world = int(os.environ["GAPS_RANK"]), int(os.environ["GAPS_WORLD_SIZE"])
with gaps.Client.from_env() as client:
    print(f"pid {os.getpid()} rank {rank} of {world}", flush=True)
    if len(sys.argv) > 1 and sys.argv[1] == "sleep":
        time.sleep(600)
    client.pull_all()
    for _ in range(5):
        client.push_pull({"w": np.full((5, 4), 0.01, np.float32), "b": np.zeros(4, np.float32)})
    print("done", flush=True)
"""


def launch(tmp_path, layout_file, *script_args, **popen):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(WORKER))
    cmd = [sys.executable, "-m", "gaps.launch", "--servers", "2", "--workers", "2", "--layout", str(layout_file)]
    return subprocess.Popen([*cmd, str(script), *script_args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_the_launcher_runs_every_worker_and_sums_up(tmp_path, layout_file):
    proc = launch(tmp_path, layout_file)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (out, err)
    lines = out.splitlines()
    for rank in (0, 1):
        assert any(line.startswith(f"[{rank}] pid ") and f"rank {rank} of 2" in line for line in lines), out
        assert f"[{rank}] done" in lines, out
    summary = json.loads(lines[-1])
    assert summary["event"] == "launch_done" and summary["exit_codes"] == [0, 0], summary
    # 2 workers × 5 push-pulls × 2 shards, each applied once.
    assert summary["pushes_applied"] == 20 and summary["pushes_applied_twice"] == 0, summary


def test_a_failing_worker_stops_the_others_and_the_exit_code_says_so(tmp_path, layout_file):
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys, time\nif os.environ['GAPS_RANK'] == '1':\n    sys.exit(3)\ntime.sleep(600)\n")
    cmd = [sys.executable, "-m", "gaps.launch", "--workers", "2", "--layout", str(layout_file), "--grace", "2", str(bad)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 3, out
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["exit_codes"][1] == 3 and summary["exit_codes"][0] != 0, summary


def test_sigterm_of_the_launcher_leaves_no_process_behind(tmp_path, layout_file, survivors):
    proc = launch(tmp_path, layout_file, "sleep")
    pids = []
    deadline = time.monotonic() + 120
    while len(pids) < 4 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("[launch]"):
            pids += [int(p) for p in line.split("(pids ")[1].rstrip(")\n").split()]
        elif " pid " in line:
            pids.append(int(line.split(" pid ")[1].split()[0]))
    assert len(pids) == 4, pids  # 2 shards and 2 workers
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, (out, err)
    assert json.loads(out.splitlines()[-1])["stopped_by"] == "SIGTERM", out
    left = survivors(pids)
    assert not left, f"processes {left} outlived the launcher"


def test_from_env_says_what_is_missing(monkeypatch):
    import gaps

    for name in ("GAPS_COORDINATOR", "GAPS_CA", "GAPS_CERT", "GAPS_KEY"):
        monkeypatch.delenv(name, raising=False)
    try:
        gaps.Client.from_env()
    except gaps.ConfigError as e:
        assert "GAPS_COORDINATOR" in str(e) and "gaps.launch" in str(e)
    else:
        raise AssertionError("from_env connected without credentials")


def test_the_shards_flags_are_gaps_servers_own_passed_through_and_checked_by_it(tmp_path, layout_file):
    """The launcher declares none of the server's flags: it lists `gaps server`'s (with the server's
    defaults), passes the given ones to every shard, and a bad value is refused by the server's own check."""
    base = [sys.executable, "-m", "gaps.launch", "--workers", "1", "--layout", str(layout_file)]
    shown = subprocess.run([sys.executable, "-m", "gaps.launch", "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown
    for flag in ("--rule RULE", "--gba-hold GBA_HOLD", "--momentum MOMENTUM", "--sparse-lr SPARSE_LR"):
        assert flag in shown.stdout, (flag, shown.stdout)
    assert "--shard-index" not in shown.stdout and "default: 0.5" in shown.stdout.replace("\n", " "), shown.stdout

    script = tmp_path / "one_step.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import gaps
        with gaps.Client.from_env() as client:
            client.pull_all()
            client.push({"w": np.ones((5, 4), np.float32), "b": np.ones(4, np.float32)})
            print("b", float(client.pull_all()["b"][0]), flush=True)
    """))
    # Plain SGD at η 0.25 from zeros: one unit gradient moves every value to -0.25 (the server's own default,
    # momentum at 0.1, would give -0.1).
    run = subprocess.run([*base, "--rule", "sgd", "--lr=0.25", "--init-std", "0", str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert "[0] b -0.25" in run.stdout.splitlines(), run.stdout

    bad = subprocess.run([*base, "--lr", "-1", str(script)], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "lr must be a positive number" in bad.stdout + bad.stderr, bad
    joined = subprocess.run(
        [*base, "--coordinator", "127.0.0.1:1", "--ca", "a", "--cert", "b", "--key", "c", "--mode", "sync", str(script)],
        capture_output=True, text=True, timeout=60,
    )
    assert joined.returncode != 0 and "already running" in joined.stderr, joined
