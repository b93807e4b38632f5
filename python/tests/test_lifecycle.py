"""A user's script as a process: `gaps.testing` through `import gaps`, Ctrl-C during a blocked call, no shard
left behind by a killed script, the client's log records in Python's logging, and same-size wrong shapes."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import gaps


def script(tmp_path, body: str) -> list[str]:
    path = tmp_path / "user_script.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def test_gaps_testing_is_reached_through_import_gaps(tmp_path):
    # The README's spelling, in a fresh interpreter (this test's own imports would hide the bug).
    out = subprocess.run(
        script(tmp_path, "import gaps\nprint(gaps.testing.local_cluster.__name__)\n"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "local_cluster"


def test_ctrl_c_interrupts_a_call_blocked_on_a_dead_shard(tmp_path, layout_file):
    cmd = script(
        tmp_path,
        f"""
        import signal, time, gaps
        # Ctrl-C as a terminal gives it: a test run started in the background by a shell without job
        # control hands its children SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with gaps.testing.local_cluster({str(layout_file)!r}, servers=2) as c:
            client = gaps.Client(c.coordinator, c.ca, c.cert, c.key, shard_down_timeout=600.0)
            client.pull_all()
            c.kill_shard(1)
            print("blocking", flush=True)
            started = time.monotonic()
            try:
                client.pull_all()
                print("returned", flush=True)
            except KeyboardInterrupt:
                print(f"interrupted after {{time.monotonic() - started:.2f}} s", flush=True)
        """,
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Should the interrupt not come, the script is killed (its output ends) rather than the test hanging.
    watchdog = threading.Timer(90, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout.readline().strip() == "blocking"
        time.sleep(1.0)  # well inside the 600 s the call would wait for the shard
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        line = proc.stdout.readline().strip()
        waited = time.monotonic() - sent
        print(f"{line}; KeyboardInterrupt {waited:.2f} s after SIGINT")
        assert line.startswith("interrupted"), (line, proc.stderr.read() if proc.poll() is not None else "")
        assert waited < 30, f"the interrupt came {waited:.1f} s after the signal"
        assert proc.wait(timeout=60) == 0
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_killed_script_leaves_no_shard_behind(tmp_path, layout_file, how, survivors):
    cmd = script(
        tmp_path,
        f"""
        import os, signal, time, gaps
        with gaps.testing.local_cluster({str(layout_file)!r}, servers=2) as c:
            print(" ".join(str(p.pid) for p in c.shards), flush=True)
            os.kill(os.getpid(), signal.{how})
            time.sleep(60)
        """,
    )
    # A script killed this way cannot remove its cluster's directory: it goes under the test's own.
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == -getattr(signal, how), out
    assert any(tmp_path.glob("gaps-cluster-*")), "the cluster's directory is not under the test's"
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2, out
    left = survivors(pids)
    assert not left, f"shards {left} outlived the script killed with {how}"


def test_the_clients_log_records_reach_pythons_logging(layout_file, caplog):
    caplog.set_level(logging.INFO, logger="gaps")
    with gaps.testing.local_cluster(layout_file, servers=2) as c:
        client = gaps.Client(c.coordinator, c.ca, c.cert, c.key, shard_down_timeout=2.0, rpc_timeout=5.0)
        client.pull_all()
        c.kill_shard(1)
        # The block's error is the one raised; leaving (which fails too, shard 1 is gone) is only logged.
        with pytest.raises(gaps.UnavailableError, match="shard 1"):
            with client:
                client.pull_all()
    waiting = [r for r in caplog.records if r.name == "gaps" and "shard unreachable" in r.getMessage()]
    assert waiting, [r.getMessage() for r in caplog.records]
    assert waiting[0].levelno == logging.WARNING
    assert "shard=1" in waiting[0].getMessage()
    assert any("leaving the cluster after an error failed" in r.getMessage() for r in caplog.records)


def test_a_gradient_of_the_right_size_but_another_shape_is_refused(cluster):
    with gaps.Client(cluster.coordinator, cluster.ca, cluster.cert, cluster.key, rpc_timeout=10.0) as client:
        before = client.pull_all()
        g = np.ones((5, 4), np.float32)
        with pytest.raises(gaps.ShapeError, match=r"\(5, 4\)"):
            client.push({"w": g.T.copy(), "b": np.zeros(4, np.float32)})
        # Flat in row-major order is still taken.
        client.push({"w": g.reshape(-1) * 0, "b": np.zeros(4, np.float32)})
        np.testing.assert_array_equal(client.pull_all()["w"], before["w"])


def test_mistakes_raise_their_own_error_classes(cluster):
    with gaps.Client(cluster.coordinator, cluster.ca, cluster.cert, cluster.key, rpc_timeout=10.0) as client:
        g = {"w": np.zeros((5, 4), np.float32), "b": np.zeros(4, np.float32)}
        with pytest.raises(gaps.OrderError, match="pull first"):
            client.push(g)
        with pytest.raises(gaps.OrderError, match="pull_rows"):
            client.push_rows("emb", np.array([1, 2], np.uint64), np.zeros((2, 3), np.float32))
        with pytest.raises(gaps.IdError, match="negative"):
            client.pull_rows("emb", np.array([3, -1]))
        ids = np.array([5, 6], np.uint64)
        client.pull_rows("emb", ids)
        bad = np.zeros((2, 3), np.float32)
        bad[1, 2] = np.nan
        with pytest.raises(gaps.NonFiniteError, match='"emb"'):
            client.push_rows("emb", ids, bad)
    with gaps.Client(cluster.coordinator, cluster.ca, cluster.cert, cluster.key, observer=True) as observer:
        observer.pull_all()
        with pytest.raises(gaps.UnauthorizedError, match="observer"):
            observer.push({"w": np.zeros((5, 4), np.float32), "b": np.zeros(4, np.float32)})
        observer.pull_rows("emb", np.array([5], np.uint64), create=False)
        with pytest.raises(gaps.UnauthorizedError, match="observer"):
            observer.push_rows("emb", np.array([5], np.uint64), np.zeros((1, 3), np.float32))


def test_a_certificate_from_another_ca_fails_at_once_with_the_reason(cluster, tmp_path):
    other = tmp_path / "other"
    subprocess.run([gaps.testing.find_gaps(), "certs", "--out", str(other), "--shards", "1"], check=True, capture_output=True)
    cases = {
        # The shard refuses the client's certificate.
        "our CA, their certificate": (cluster.ca, str(other / "worker.pem"), str(other / "worker.key")),
        # The client refuses the shard's certificate.
        "their CA, our certificate": (str(other / "ca.pem"), cluster.cert, cluster.key),
    }
    for what, (ca, cert, key) in cases.items():
        started = time.monotonic()
        with pytest.raises(gaps.CertificateError) as raised:
            gaps.Client(cluster.coordinator, ca, cert, key, connect_timeout=60.0)
        took = time.monotonic() - started
        print(f"{what}: CertificateError after {took:.2f} s: {raised.value}")
        assert "TLS alert" in str(raised.value) or "certificate" in str(raised.value), (what, str(raised.value))
        assert took < 30, f"{what}: retried for {took:.1f} s with files that cannot work"


def test_a_shard_that_cannot_start_says_why_first(layout_file):
    with pytest.raises(RuntimeError) as raised:
        with gaps.testing.local_cluster(layout_file, servers=1, lr=-1.0):
            pass
    message = str(raised.value)
    assert "lr must be a positive number" in message.splitlines()[0], message
    assert "Stack backtrace" not in message, message


def test_checkpoints_from_python_and_a_shard_restored_from_one(layout_file, tmp_path):
    with gaps.testing.local_cluster(layout_file, servers=2, lr=0.5, checkpoint_dir=tmp_path / "ckpt") as c:
        with gaps.Client(c.coordinator, c.ca, c.cert, c.key) as client:
            client.pull_all()
            client.push({"w": np.full((5, 4), 0.1, np.float32), "b": np.ones(4, np.float32)})
            with pytest.raises(gaps.UnauthorizedError, match="coordinator"):
                client.checkpoint()  # a worker's certificate may not
            values = client.pull_all()
        done = c.checkpoint()
        assert [s["shard"] for s in done["shards"]] == [0, 1], done
        assert all(os.path.exists(s["path"]) for s in done["shards"]), done
        c.kill_shard(1)
        c.restart_shard(1)  # restores its newest checkpoint and rejoins
        with gaps.Client(c.coordinator, c.ca, c.cert, c.key, rpc_timeout=20.0) as client:
            again = client.pull_all()
        for name in values:
            np.testing.assert_array_equal(again[name], values[name])


def test_the_public_data_reader_and_metrics():
    test = gaps.data.held_out("synthetic", 200)
    assert len(test) == 200 and test.ids.shape == (200, 26) and test.ints.shape == (200, 13)
    reader = gaps.data.CriteoReader("synthetic", part=0, parts=1)
    batches = list(reader.batches(64, count=3))
    assert [len(b) for b in batches] == [64, 64, 64]
    assert not np.array_equal(batches[0].ids, batches[1].ids)
    assert gaps.metrics.auc([0.1, 0.9, 0.8, 0.3], [0, 1, 1, 0]) == 1.0
    assert gaps.metrics.auc([0.9, 0.1], [0, 1]) == 0.0
    assert abs(gaps.metrics.logloss([0.5, 0.5], [0, 1]) - np.log(2)) < 1e-9
    with pytest.raises(gaps.ShapeError):
        gaps.metrics.auc([0.1], [0, 1])


def test_a_table_and_the_dense_tensors_export_and_import_into_a_fresh_cluster_unchanged(layout_file, tmp_path):
    ids = np.array([3, 10**12, 7, 42, 2**63 + 5], np.uint64)
    with gaps.testing.local_cluster(layout_file, servers=2, lr=0.5) as c:
        with gaps.Client(c.coordinator, c.ca, c.cert, c.key) as client:
            client.pull_all()
            client.push({"w": np.full((5, 4), 0.3, np.float32), "b": np.arange(4, dtype=np.float32)})
            client.pull_rows("emb", ids)
            client.push_rows("emb", ids, np.arange(15, dtype=np.float32).reshape(5, 3) / 10)
            rows = client.pull_rows("emb", ids, create=False).copy()
            dense = client.pull_all()
            assert client.export_table("emb", tmp_path / "emb.rows") == 5
            np.savez(tmp_path / "dense.npz", **dense)
    back_ids, back_rows = gaps.read_rows(tmp_path / "emb.rows")
    order = np.argsort(back_ids)
    np.testing.assert_array_equal(back_ids[order], np.sort(ids))
    np.testing.assert_array_equal(back_rows[order], rows[np.argsort(ids)])
    with gaps.testing.local_cluster(layout_file, servers=2, lr=0.5) as c:
        with gaps.Client(c.coordinator, c.ca, c.cert, c.key) as client:
            assert client.import_table("emb", tmp_path / "emb.rows") == (5, 0)
            assert client.import_table("emb", tmp_path / "emb.rows") == (0, 5), "held rows are kept"
            taken, kept = client.initialize(dict(np.load(tmp_path / "dense.npz")))
            assert kept == 0 and taken > 0
            np.testing.assert_array_equal(client.pull_rows("emb", ids, create=False), rows)
            again = client.pull_all()
            for name in dense:
                np.testing.assert_array_equal(again[name], dense[name])
    (tmp_path / "bad.rows").write_bytes(b"NOTROWS!" + bytes(8))
    with pytest.raises(gaps.ConfigError, match="not a gaps rows file"):
        gaps.read_rows(tmp_path / "bad.rows")
