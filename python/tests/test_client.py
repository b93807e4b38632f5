"""The gaps Python client against a real local cluster of `gaps server` processes."""

import numpy as np
import pytest

import gaps
from gaps.testing import local_cluster


def connect(c, **kw):
    return gaps.Client(c.coordinator, c.ca, c.cert, c.key, rpc_timeout=10.0, **kw)


def test_layout_and_dense_round_trip(cluster):
    with connect(cluster) as client:
        assert list(client.layout.tensors) == ["w", "b"]
        assert client.layout.tensors["w"].shape == (5, 4)
        assert client.layout.tables["emb"].dim == 3
        before = client.pull_all()
        assert before["w"].shape == (5, 4) and before["w"].dtype == np.float32
        assert before["w"].flags.writeable
        grads = {"w": np.full((5, 4), 0.2, np.float32), "b": np.arange(4, dtype=np.float32)}
        client.push(grads)
        after = client.pull_all()
        # SGD with lr 0.5 on this fresh tensor: exactly θ - 0.5·g (no other worker pushes to this cluster's
        # model concurrently in this test).
        np.testing.assert_allclose(after["w"], before["w"] - 0.5 * grads["w"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(after["b"], before["b"] - 0.5 * grads["b"], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(client.pull("b"), after["b"])


def test_push_pull_returns_what_a_pull_right_after_reads(cluster):
    with connect(cluster) as client:
        before = client.pull_all()
        g = {"w": np.full((5, 4), 0.25, np.float32), "b": np.arange(4, dtype=np.float32) / 4}
        after = client.push_pull(g)
        assert after["w"].shape == (5, 4) and after["w"].dtype == np.float32
        np.testing.assert_allclose(after["w"], before["w"] - 0.5 * g["w"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(after["b"], before["b"] - 0.5 * g["b"], rtol=0, atol=1e-6)
        # The next push is computed on what push_pull returned.
        again = client.push_pull(g)
        np.testing.assert_allclose(again["b"], after["b"] - 0.5 * g["b"], rtol=0, atol=1e-6)
        pulled = client.pull_all()
        for name in ("w", "b"):
            np.testing.assert_array_equal(again[name], pulled[name])
        # Bad input raises before anything is sent, as push does.
        nan = np.full((5, 4), 0.1, np.float32)
        nan[2, 3] = np.nan
        with pytest.raises(gaps.NonFiniteError):
            client.push_pull({"w": nan, "b": g["b"]})
        with pytest.raises(gaps.ShapeError):
            client.push_pull({"w": g["w"]})
        np.testing.assert_array_equal(client.pull_all()["w"], pulled["w"])


def test_sparse_rows_round_trip(cluster):
    with connect(cluster) as client:
        ids = np.array([3, 10**12, 7, 42], dtype=np.uint64)
        rows = client.pull_rows("emb", ids)
        assert rows.shape == (4, 3) and rows.dtype == np.float32
        g = np.ones((4, 3), np.float32)
        client.push_rows("emb", ids, g)
        again = client.pull_rows("emb", ids, create=False)
        assert again.shape == (4, 3)
        assert not np.array_equal(again, rows), "the rows moved"
        assert np.all(np.isfinite(again))


def test_exactly_once_across_a_dropped_connection(cluster):
    with connect(cluster) as client:
        before = client.pull_all()
        acked = client._native.pushes_acknowledged()
        applied = sum(s["pushes_applied"] for s in client.stats())
        # The next two requests are sent, then their connection is cut before the reply: the client
        # retries them with the same sequence numbers, and the shards apply each once.
        client._native.inject_connection_drops(2)
        g = {"w": np.full((5, 4), 0.1, np.float32), "b": np.full(4, 0.1, np.float32)}
        client.push(g)
        after = client.pull_all()
        np.testing.assert_allclose(after["w"], before["w"] - 0.5 * g["w"], atol=1e-6)
        stats = client.stats()
        assert sum(s["pushes_applied"] for s in stats) == applied + 2, stats
        assert client._native.pushes_acknowledged() == acked + 2


def test_bad_input_raises_the_right_error_and_changes_nothing(cluster):
    with connect(cluster) as client:
        before = client.pull_all()
        ok = {"w": np.zeros((5, 4), np.float32), "b": np.zeros(4, np.float32)}
        with pytest.raises(gaps.DTypeError):
            client.push({**ok, "w": np.zeros((5, 4), np.float64)})
        with pytest.raises(gaps.ShapeError):
            client.push({**ok, "b": np.zeros(5, np.float32)})
        with pytest.raises(gaps.UnknownNameError):
            client.push({**ok, "nope": np.zeros(1, np.float32)})
        with pytest.raises(gaps.UnknownNameError):
            client.pull("nope")
        with pytest.raises(gaps.UnknownNameError):
            client.pull_rows("nope", np.array([1], np.uint64))
        nan = np.zeros((5, 4), np.float32)
        nan[2, 1] = np.nan
        with pytest.raises(gaps.NonFiniteError, match="element 9"):
            client.push({**ok, "w": nan})
        with pytest.raises(gaps.DTypeError):
            client.pull_rows("emb", np.array([1.5]))
        with pytest.raises(gaps.OrderError):  # rows that were never pulled
            client.push_rows("emb", np.array([1, 2], np.uint64), np.zeros((2, 3), np.float32))
        rows_ids = np.array([5], np.uint64)
        client.pull_rows("emb", rows_ids)
        with pytest.raises(gaps.NonFiniteError):
            client.push_rows("emb", rows_ids, np.full((1, 3), np.inf, np.float32))
        with pytest.raises(gaps.GapsError):
            client.push_rows("emb", rows_ids, np.zeros((2, 3), np.float32))
        # Nothing was applied: the model is as it was, and the client still works.
        after = client.pull_all()
        for name in before:
            np.testing.assert_array_equal(after[name], before[name])
        client.push(ok)
    with pytest.raises(gaps.ConfigError):
        gaps.Client(cluster.coordinator, cluster.ca, cluster.ca, cluster.key)
    for lanes in (0, 65):
        with pytest.raises(gaps.ConfigError):
            connect(cluster, lanes=lanes)


def test_a_client_with_several_lanes_reads_what_a_plain_one_reads(cluster):
    with connect(cluster, lanes=3) as striped, connect(cluster, observer=True) as plain:
        mine, theirs = striped.pull_all(), plain.pull_all()
        for name in mine:
            np.testing.assert_array_equal(mine[name], theirs[name])


def test_closed_client_and_unreachable_cluster(cluster):
    client = connect(cluster)
    client.close()
    client.close()
    with pytest.raises(gaps.ClosedError):
        client.pull_all()
    with pytest.raises(gaps.UnavailableError):
        gaps.Client("127.0.0.1:9", cluster.ca, cluster.cert, cluster.key, connect_timeout=1.0)


def test_a_training_loop_lowers_the_loss(layout_file, tmp_path):
    # Least squares y = x·W* on the dense tensor "w" (5×4), plus "b".
    layout = tmp_path / "model.toml"
    layout.write_text('chunk_elems = 8\n[[tensor]]\nname = "w"\nshape = [5, 4]\n[[tensor]]\nname = "b"\nshape = [4]\n')
    rng = np.random.default_rng(0)
    w_true = rng.normal(size=(5, 4)).astype(np.float32)
    with local_cluster(layout, servers=2, rule="sgd", lr=0.1) as c, connect(c) as client:
        losses = []
        for step in range(60):
            p = client.pull_all()
            x = rng.normal(size=(32, 5)).astype(np.float32)
            y = x @ w_true
            err = x @ p["w"] + p["b"] - y
            losses.append(float(np.mean(err**2)))
            client.push({"w": (x.T @ err / len(x)).astype(np.float32), "b": err.mean(0).astype(np.float32)})
        assert losses[-1] < losses[0] / 10, losses[::10]
