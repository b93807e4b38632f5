"""A DLRM-style click model in plain PyTorch, trained by several worker processes through gaps.

The model is the one `gaps local --model dlrm` trains (13 integer features as log(1 + x) and one embedding
per categorical field, concatenated, then a ReLU layer and a logit); here it is an ordinary
`torch.nn.Module`, and gaps holds its parameters and its embedding table. On the synthetic Criteo-layout
data (the same generator, seed and held-out set as `gaps local`) or on a Criteo TSV file:

    GAPS_BIN_DIR=target/release python python/examples/torch_dlrm.py --workers 4 --steps 300
    python python/examples/torch_dlrm.py --data day_0.tsv

It prints the held-out AUC and log-loss, and training samples per second.
"""

import argparse
import concurrent.futures
import multiprocessing as mp
import pathlib
import tempfile
import time

import numpy as np
import torch

import gaps
import gaps.torch as gt
from gaps.testing import local_cluster

NUM_INT, NUM_CAT = 13, 26
MISSING = gaps.data.MISSING


class DLRM(torch.nn.Module):
    def __init__(self, embedding_dim: int, hidden: int):
        super().__init__()
        self.w1 = torch.nn.Linear(NUM_INT + NUM_CAT * embedding_dim, hidden)
        self.w2 = torch.nn.Linear(hidden, 1)

    def forward(self, ints: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        z = torch.cat([ints, embedded.flatten(1)], dim=1)
        return self.w2(torch.relu(self.w1(z))).squeeze(1)


def arrays(batch):
    """(labels, ints, ids, present) of a gaps.CriteoBatch."""
    present = batch.ids != MISSING
    return batch.labels, batch.ints, np.where(present, batch.ids, 0).astype(np.int64, copy=False), present


def embed(emb, ids, present):
    """Embeddings of the present ids, zeros where a field is missing (as the built-in model does)."""
    return emb(torch.from_numpy(ids)) * torch.from_numpy(present).unsqueeze(-1)


# ---- the few lines that make a PyTorch loop a gaps worker are marked "gaps:" ----
def worker(rank: int, args, creds, results):
    torch.set_num_threads(1)
    model = DLRM(args.embedding_dim, args.hidden)
    with gaps.Client(*creds, worker_name=f"torch-{rank}") as client:  # gaps: join the cluster
        emb = gt.ShardedEmbedding(client, "emb")  # gaps: the table lives on the shards
        dense = gt.DenseParameters(client, model)  # gaps: so do the dense parameters
        stream = gaps.data.CriteoReader(args.data, part=rank, parts=args.workers, seed=args.seed)
        reader = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # the next batch is read meanwhile
        loss_fn = torch.nn.BCEWithLogitsLoss()
        started = time.perf_counter()
        cur, nxt = arrays(stream.next_batch(args.batch)), arrays(stream.next_batch(args.batch))
        later = reader.submit(stream.next_batch, args.batch)
        dense.pull()  # gaps: shards -> parameters
        for step in range(args.steps):
            labels, ints, ids, present = cur
            emb.prefetch(nxt[2])  # gaps: the next batch's rows arrive while this one computes
            logits = model(torch.from_numpy(ints), embed(emb, ids, present))
            loss = loss_fn(logits, torch.from_numpy(labels))
            loss.backward()  # (gaps: pushes the rows' gradients)
            # gaps: pushes the dense gradients; the answer brings the next step's parameters
            dense.push(pull=step + 1 < args.steps)
            cur, nxt = nxt, arrays(later.result())
            later = reader.submit(stream.next_batch, args.batch)
        elapsed = time.perf_counter() - started
        emb.close()
    results.put((rank, args.steps * args.batch, elapsed))


def evaluate(args, creds, layout_model):
    """Held-out AUC and log-loss of the cluster's model (read by an observer)."""
    labels, ints, ids, present = arrays(gaps.data.held_out(args.data, args.eval_samples, seed=args.seed))
    with gaps.Client(*creds, observer=True) as client, torch.no_grad():
        dense = gt.DenseParameters(client, layout_model)
        dense.pull()
        scores = []
        for lo in range(0, len(labels), 4096):
            sl = slice(lo, lo + 4096)
            uniq = np.unique(ids[sl][present[sl]])
            rows = client.pull_rows("emb", uniq.astype(np.uint64), create=False)  # unseen ids read as 0
            table = dict(zip(uniq.tolist(), range(len(uniq))))
            idx = np.vectorize(lambda i: table.get(i, 0))(ids[sl]) if len(uniq) else np.zeros_like(ids[sl])
            e = torch.from_numpy(rows)[torch.from_numpy(idx)] * torch.from_numpy(present[sl]).unsqueeze(-1)
            scores.append(torch.sigmoid(layout_model(torch.from_numpy(ints[sl]), e)).numpy())
    p = np.concatenate(scores).astype(np.float32)
    auc = gaps.metrics.auc(p, labels)
    eps = 1e-7
    logloss = float(-np.mean(labels * np.log(p + eps) + (1 - labels) * np.log(1 - p + eps)))
    return auc, logloss


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--embedding-dim", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--data", default="synthetic", help="'synthetic' or a Criteo-layout TSV file")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--eval-samples", type=int, default=20_000)
    ap.add_argument("--lr", type=float, default=0.02, help="dense Adagrad learning rate (as gaps local)")
    args = ap.parse_args()

    model = DLRM(args.embedding_dim, args.hidden)
    with tempfile.TemporaryDirectory() as d:
        layout = pathlib.Path(d) / "dlrm.toml"
        layout.write_text(gt.layout_for(model, {"emb": args.embedding_dim}, chunk_elems=4096))
        # The shards' flags match `gaps local --model dlrm`: Adagrad, lr 0.02, dense init N(0, 0.05²),
        # embedding rows Adagrad lr 0.05, init N(0, 0.01²).
        with local_cluster(layout, servers=args.servers, rule="adagrad", lr=args.lr, init_std=0.05) as c:
            creds = (c.coordinator, c.ca, c.cert, c.key)
            ctx = mp.get_context("spawn")
            results = ctx.Queue()
            procs = [ctx.Process(target=worker, args=(r, args, creds, results)) for r in range(args.workers)]
            started = time.perf_counter()
            for p in procs:
                p.start()
            done = [results.get() for _ in procs]
            for p in procs:
                p.join()
                if p.exitcode != 0:
                    raise SystemExit(f"a worker failed (exit {p.exitcode})")
            wall = time.perf_counter() - started
            auc, logloss = evaluate(args, creds, model)
    samples = sum(n for _, n, _ in done)
    print(
        f"held-out AUC {auc:.4f}, log-loss {logloss:.4f}; {samples} training samples in {wall:.1f} s "
        f"({samples / wall:,.0f} samples/s with process start-up, "
        f"{samples / max(t for *_, t in done):,.0f} samples/s in the loops)"
    )


if __name__ == "__main__":
    main()
