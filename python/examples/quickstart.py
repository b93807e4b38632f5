"""The README's Python example: a numpy training loop as a gaps worker (least squares on a 2-shard local
cluster). Prints the loss as it falls."""

import pathlib
import tempfile

import numpy as np

import gaps
from gaps.testing import local_cluster

LAYOUT = """
chunk_elems = 64
[[tensor]]
name = "w"
shape = [10, 3]
[[tensor]]
name = "b"
shape = [3]
"""

rng = np.random.default_rng(0)
w_true = rng.normal(size=(10, 3)).astype(np.float32)

with tempfile.TemporaryDirectory() as d:
    layout = pathlib.Path(d) / "layout.toml"
    layout.write_text(LAYOUT)
    with local_cluster(layout, servers=2, rule="sgd", lr=0.1) as c:
        with gaps.Client(c.coordinator, c.ca, c.cert, c.key) as client:
            for step in range(100):
                params = client.pull_all()  # {"w": (10, 3) float32, "b": (3,) float32}
                x = rng.normal(size=(64, 10)).astype(np.float32)
                err = x @ params["w"] + params["b"] - x @ w_true
                client.push({"w": x.T @ err / len(x), "b": err.mean(axis=0)})  # gradients of ½·mean(err²)
                if step % 20 == 0 or step == 99:
                    print(f"step {step:3d}  loss {float(np.mean(err**2)):.4f}")
