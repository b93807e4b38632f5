"""Dynamic data sharding from Python: two worker processes train a logistic regression on splits the
coordinator deals; the shards' own per-grant sample counts (not the workers' reports) show every training
line of both passes used exactly once."""

import os
import subprocess
import sys
import textwrap

import gaps
from gaps.testing import local_cluster

LINES = 3000
SPLIT = 250
BAD = {17, 1234}

LAYOUT = """
chunk_elems = 16

[[tensor]]
name = "w"
shape = [13]

[[tensor]]
name = "b"
shape = [1]
"""

WORKER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import gaps

    coordinator, ca, cert, key, data = sys.argv[1:6]
    with gaps.Client(coordinator, ca, cert, key, worker_name="py-dealt") as client:
        params = client.pull_all()
        dealt = 0
        for split in client.splits(data):
            dealt += 1
            for batch in split.batches(64):
                z = batch.ints @ params["w"] + params["b"][0]
                err = (1.0 / (1.0 + np.exp(-z)) - batch.labels) / len(batch)
                grads = {"w": (batch.ints.T @ err).astype(np.float32), "b": np.array([err.sum()], np.float32)}
                params = client.push_pull(grads)
        print(dealt)
    """
)


def criteo_line(i: int) -> str:
    # The Criteo layout (label, 13 integers, 26 hex categories); some fields empty, as in the real data.
    ints = [str((i * (j + 3)) % 50 - (1 if j == 2 else 0)) if (i + j) % 7 else "" for j in range(13)]
    cats = [format((i * 2654435761 + c * 40503) % (1 << 32), "08x") if (i + c) % 9 else "" for c in range(26)]
    return "\t".join([str(i % 3 == 0 and 1 or 0)] + ints + cats)


def test_two_python_workers_train_every_line_once_a_pass_through_the_dealer(layout_file, tmp_path):
    layout = tmp_path / "lr.toml"
    layout.write_text(LAYOUT)
    data = tmp_path / "train.tsv"
    lines = ["1\tnot a sample" if n in BAD else criteo_line(n) for n in range(1, LINES + 1)]
    data.write_text("\n".join(lines) + "\n")
    args = ["--data", str(data), "--split-lines", str(SPLIT), "--data-epochs", "2"]
    with local_cluster(layout, servers=2, rule="sgd", lr=0.1, coordinator_args=args) as c:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER, c.coordinator, c.ca, c.cert, c.key, str(data)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        dealt = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
            dealt.append(int(out.split()[-1]))
        with gaps.Client(c.coordinator, c.ca, c.cert, c.key, observer=True) as observer:
            status = observer.data_status()
    splits = LINES // SPLIT
    expected = {
        k: sum(1 for n in range(k * SPLIT + 1, (k + 1) * SPLIT + 1) if n % 10 != 0 and n not in BAD)
        for k in range(splits)
    }
    dealer = status[0]["dealer"]
    assert dealer["finished"], dealer
    assert dealer["splits_per_epoch"] == splits
    finished = {}
    for grant, key in dealer["completed"]:
        finished.setdefault(key, []).append(grant)
    assert sorted(finished) == sorted((e << 32) | k for e in range(2) for k in range(splits)), dealer
    for shard in status:
        counts = {g: n for g, _, n in shard["counts"]}
        for key, grants in finished.items():
            assert len(grants) == 1, (key, grants)
            assert counts.get(grants[0], 0) == expected[key & 0xFFFFFFFF], (shard["shard"], key)
    # Between them the workers took every split of both passes, each as many as it asked for.
    assert sum(dealt) == 2 * splits, dealt
    assert dealer["samples_replayed"] == 0


def test_a_split_request_needs_a_dealing_coordinator(layout_file):
    with local_cluster(layout_file, servers=1) as c:
        with gaps.Client(c.coordinator, c.ca, c.cert, c.key) as client:
            try:
                next(client.splits("synthetic"))
            except gaps.GapsError as e:
                assert "deals no data" in str(e), e
            else:
                raise AssertionError("a coordinator without --data dealt a split")
