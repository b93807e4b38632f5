"""A single-process PyTorch DLRM of the shape `gaps local --model dlrm` trains, on the same data, with no
parameter server: the yardstick a cluster has to beat (`gaps bench e2e --torch PYTHON` runs it beside the
cluster shapes, at 1 and 2 threads, in the same sitting).

    python python/benches/torch_baseline.py --steps 300 --threads 1

The same model as `gaps local --model dlrm` (13 integer features as log(1 + x), one 8-float embedding per
categorical field, concatenated, a 32-unit ReLU layer and a logit), the same synthetic stream (worker 0
of 1, seed 1, read through `gaps.data`, batches of 256 made inside the timed loop as a worker makes
them), the same optimizers: Adagrad with lr 0.02 on the dense weights (init N(0, 0.05²)), Adagrad with lr
0.05 on embedding rows (init N(0, 0.01²)). One difference, the usual one for PyTorch: ids are hashed into
a fixed table of `--rows` rows (gaps keeps one row per distinct id), so the table is allocated up front
and a batch's rows are looked up without a hash map.

Prints one JSON line: case, threads, steps, samples, samples_per_s (training loop only) and the held-out
AUC and log-loss on the cluster's held-out samples.
"""

import argparse
import json
import time
import warnings

import numpy as np
import torch

import gaps
import gaps.data
import gaps.metrics

NUM_INT, NUM_CAT = 13, 26


class DLRM(torch.nn.Module):
    def __init__(self, rows: int, embedding_dim: int, hidden: int):
        super().__init__()
        self.emb = torch.nn.Embedding(rows, embedding_dim, sparse=True)
        torch.nn.init.normal_(self.emb.weight, std=0.01)
        self.w1 = torch.nn.Linear(NUM_INT + NUM_CAT * embedding_dim, hidden)
        self.w2 = torch.nn.Linear(hidden, 1)
        for p in [self.w1.weight, self.w1.bias, self.w2.weight, self.w2.bias]:
            torch.nn.init.normal_(p, std=0.05)

    def forward(self, ints: torch.Tensor, rows: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        # Missing fields embed as zeros, as the built-in model does.
        embedded = self.emb(rows) * present.unsqueeze(-1)
        z = torch.cat([ints, embedded.flatten(1)], dim=1)
        return self.w2(torch.relu(self.w1(z))).squeeze(1)


def tensors(batch, rows: int):
    """(labels, ints, row indices, present) of a gaps.CriteoBatch as tensors."""
    present = batch.ids != gaps.data.MISSING
    # Every bit of the 64-bit id reaches the row (a plain id % 2^k would drop the high bits).
    mixed = (batch.ids * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(17)
    idx = np.where(present, mixed % np.uint64(rows), 0).astype(np.int64)
    return (
        torch.from_numpy(batch.labels),
        torch.from_numpy(batch.ints),
        torch.from_numpy(idx),
        torch.from_numpy(present.astype(np.float32)),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (intra-op threads)")
    ap.add_argument("--rows", type=int, default=1 << 22, help="embedding rows ids are hashed into")
    ap.add_argument("--embedding-dim", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--eval-samples", type=int, default=4096)
    args = ap.parse_args()
    if args.steps < 1 or args.batch < 1 or args.threads < 1 or args.rows < 1:
        ap.error("--steps, --batch, --threads and --rows must be at least 1")
    # Sparse Adagrad's note that it skips sparse-tensor invariant checks is not news here.
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = DLRM(args.rows, args.embedding_dim, args.hidden)
    dense = [p for n, p in model.named_parameters() if not n.startswith("emb.")]
    opt_dense = torch.optim.Adagrad(dense, lr=0.02)
    opt_rows = torch.optim.Adagrad([model.emb.weight], lr=0.05)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    stream = gaps.data.CriteoReader("synthetic", part=0, parts=1, seed=args.seed)

    started = time.perf_counter()
    for _ in range(args.steps):
        labels, ints, rows, present = tensors(stream.next_batch(args.batch), args.rows)
        opt_dense.zero_grad(set_to_none=True)
        opt_rows.zero_grad(set_to_none=True)
        loss = loss_fn(model(ints, rows, present), labels)
        loss.backward()
        opt_dense.step()
        opt_rows.step()
    elapsed = time.perf_counter() - started

    labels, ints, rows, present = tensors(gaps.data.held_out("synthetic", args.eval_samples, seed=args.seed), args.rows)
    with torch.no_grad():
        p = torch.sigmoid(model(ints, rows, present)).numpy().astype(np.float32)
    y = labels.numpy()
    eps = 1e-7
    print(json.dumps({
        "case": f"torch_dlrm_{args.threads}t",
        "threads": args.threads,
        "steps": args.steps,
        "samples": args.steps * args.batch,
        "samples_per_s": round(args.steps * args.batch / max(elapsed, 1e-9)),
        "auc": round(float(gaps.metrics.auc(p, y)), 4),
        "logloss": round(float(-np.mean(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps))), 4),
        "torch": torch.__version__,
    }), flush=True)


if __name__ == "__main__":
    main()
