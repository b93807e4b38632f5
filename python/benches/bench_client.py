"""The Python binding's cost over the Rust client: the same dense pull+push and sparse row round trips,
through ``gaps.Client`` (numpy in and out) and as a Rust loop inside the native module on the same
connection, on the same local cluster in the same run. Prints a table; ``--quick`` for a smoke run.

    GAPS_BIN_DIR=target/release python python/benches/bench_client.py [--quick]
"""

import argparse
import pathlib
import tempfile
import time

import numpy as np

import gaps
from gaps.testing import local_cluster


def layout(params: int, dim: int) -> str:
    rows = params // 1024
    return (
        "chunk_elems = 262144\n"
        f'[[tensor]]\nname = "w"\nshape = [{rows}, 1024]\n'
        f'[[tensor]]\nname = "b"\nshape = [1024]\n'
        f'[[table]]\nname = "emb"\ndim = {dim}\n'
    )


def python_dense(client, n):
    zeros = None
    started = time.perf_counter()
    for _ in range(n):
        params = client.pull_all()
        if zeros is None:
            zeros = {k: np.zeros_like(v) for k, v in params.items()}
        client.push(zeros)
    return time.perf_counter() - started


def python_rows(client, ids, dim, n):
    grads = np.zeros((len(ids), dim), np.float32)
    started = time.perf_counter()
    for _ in range(n):
        client.pull_rows("emb", ids)
        client.push_rows("emb", ids, grads)
    return time.perf_counter() - started


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--params", type=int, default=4 << 20, help="dense float32 parameters")
    ap.add_argument("--rows", type=int, default=4096, help="distinct ids per row round trip")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n = 2 if args.quick else 20
    repeats = 1 if args.quick else args.repeats
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "bench.toml"
        path.write_text(layout(args.params, args.dim))
        with local_cluster(path, servers=2, rule="sgd", lr=1e-9) as c, gaps.Client(
            c.coordinator, c.ca, c.cert, c.key, rpc_timeout=120.0
        ) as client:
            ids = np.arange(args.rows, dtype=np.uint64) * 7919
            client.pull_rows("emb", ids)  # create the rows
            python_dense(client, 1)
            rows = {"dense": [], "sparse": []}
            for _ in range(repeats):
                # Alternate, so drift of the machine hits both sides alike.
                rows["dense"].append((client._native.bench_dense(n), python_dense(client, n)))
                ids_bytes = ids.tobytes()
                rows["sparse"].append(
                    (client._native.bench_rows("emb", ids_bytes, n), python_rows(client, ids, args.dim, n))
                )
    mb = args.params * 4 / 1e6
    print(f"{'round trip':<44} {'rust s/iter':>12} {'python s/iter':>14} {'python/rust':>12}")
    for what, label in [
        ("dense", f"dense pull+push, {mb:.0f} MB each way"),
        ("sparse", f"rows pull+push, {args.rows} ids × {args.dim}"),
    ]:
        rust = min(r for r, _ in rows[what]) / n
        py = min(p for _, p in rows[what]) / n
        print(f"{label:<44} {rust:>12.4f} {py:>14.4f} {py / rust:>12.2f}")


if __name__ == "__main__":
    main()
