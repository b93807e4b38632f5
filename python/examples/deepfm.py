"""A DeepFM written as a plain PyTorch module — one embedding table shared by the 26 categorical fields, looked
up once per field — trained either by one plain PyTorch process or, unchanged, by gaps worker processes.

One plain PyTorch process (the baseline)::

    python python/examples/deepfm.py --plain --steps 300

The same model through gaps, 2 worker processes started by the launcher (the layout comes from the module:
its two nn.Embedding tables become sharded tables, everything else dense tensors)::

    cd python/examples && python -m gaps.launch --servers 2 --workers 2 --module deepfm:DeepFM \\
        --rule sgd --lr 0.1 --sparse-rule sgd --sparse-lr 0.1 \\
        deepfm.py --steps 150 --out /tmp/deepfm

Both train with SGD on the synthetic Criteo-layout data (a planted teacher) and print one JSON line with
the held-out AUC and log-loss; through gaps, rank 0 evaluates once every worker is done (files in --out).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import numpy as np
import torch

import gaps
import gaps.torch as gt
from gaps.data import CriteoReader, held_out, torch_batch
from gaps.metrics import auc, logloss

FIELDS, INTS = 26, 13
#: Feature ids are hashed into this many rows (so one plain nn.Embedding can hold them).
VOCAB = 1 << 16


class DeepFM(torch.nn.Module):
    """First-order weights and an FM of the fields' embeddings (one shared table each), plus an MLP."""

    def __init__(self, dim: int = 8, hidden: int = 32):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, dim)  # shared by every field
        self.lin = torch.nn.Embedding(VOCAB, 1)  # first-order weight of each id, shared too
        torch.nn.init.normal_(self.emb.weight, std=0.01)  # what the shards give a new row
        torch.nn.init.normal_(self.lin.weight, std=0.01)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(FIELDS * dim + INTS, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )

    def forward(self, ints: torch.Tensor, ids: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        mask = present.to(ints.dtype)
        embs = torch.stack([self.emb(ids[:, f]) * mask[:, f : f + 1] for f in range(FIELDS)], dim=1)
        first = sum(self.lin(ids[:, f]).squeeze(1) * mask[:, f] for f in range(FIELDS))
        fm = 0.5 * (embs.sum(1).pow(2) - embs.pow(2).sum(1)).sum(1)
        deep = self.mlp(torch.cat([embs.flatten(1), ints], dim=1)).squeeze(1)
        return first + fm + deep


def tensors(batch):
    labels, ints, ids, present = torch_batch(batch)
    return labels, ints, ids % VOCAB, present


def evaluate(model: torch.nn.Module, n: int) -> dict:
    labels, ints, ids, present = tensors(held_out("synthetic", n))
    with torch.no_grad():
        p = torch.sigmoid(model(ints, ids, present)).numpy()
    return {"auc": round(auc(p, labels.numpy()), 4), "logloss": round(logloss(p, labels.numpy()), 4)}


def plain(args) -> dict:
    """One PyTorch process: the same batches every worker would read, one after another."""
    torch.manual_seed(args.seed)
    model = DeepFM()
    rows = list(model.emb.parameters()) + list(model.lin.parameters())
    dense = [p for n, p in model.named_parameters() if not n.startswith(("emb.", "lin."))]
    opt = torch.optim.SGD([{"params": dense, "lr": args.lr}, {"params": rows, "lr": args.rows_lr}])
    readers = [CriteoReader("synthetic", part=r, parts=args.workers) for r in range(args.workers)]
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for _ in range(args.steps):
        for reader in readers:
            labels, ints, ids, present = tensors(reader.next_batch(args.batch))
            opt.zero_grad()
            loss_fn(model(ints, ids, present), labels).backward()
            opt.step()
    return evaluate(model, args.eval_samples)


def worker(args) -> dict | None:
    """One gaps worker (started by ``python -m gaps.launch``): the model's own forward, its embeddings and
    parameters on the shards."""
    rank, world = int(os.environ["GAPS_RANK"]), int(os.environ["GAPS_WORLD_SIZE"])
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = DeepFM()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with gaps.Client.from_env() as client:
        tables = gt.shard_embeddings(model, client)  # gaps: the two tables live on the shards
        dense = gt.DenseParameters(client, model)  # gaps: so do the other parameters
        dense.initialize()  # gaps: the module's own initialisation, uploaded once
        reader = CriteoReader("synthetic", part=rank, parts=world)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        started = time.perf_counter()
        for _ in range(args.steps):
            labels, ints, ids, present = tensors(reader.next_batch(args.batch))
            loss_fn(model(ints, ids, present), labels).backward()  # gaps: pushes each table's rows once
            dense.push(pull=True)  # gaps: pushes the dense gradients, brings the new values
        (out / f"done-{rank}").write_text(str(time.perf_counter() - started))
        for t in tables.values():
            t.close()
    if rank != 0:
        return None
    while len(list(out.glob("done-*"))) < world:  # every worker finished its steps
        time.sleep(0.1)
    with gaps.Client.from_env(observer=True) as observer:  # reads the model; creates no rows
        model = DeepFM()
        gt.shard_embeddings(model, observer)
        gt.DenseParameters(observer, model).pull()
        return evaluate(model, args.eval_samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plain", action="store_true", help="train in one plain PyTorch process")
    p.add_argument("--workers", type=int, default=2, help="--plain: the workers whose batches to read")
    p.add_argument("--steps", type=int, default=150, help="steps per worker")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.1, help="--plain: the dense parameters' SGD rate")
    p.add_argument("--rows-lr", type=float, default=0.1, help="--plain: the embedding rows' SGD rate")
    p.add_argument("--eval-samples", type=int, default=5000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="deepfm-out", help="through gaps: where workers say they are done")
    args = p.parse_args()
    result = plain(args) if args.plain else worker(args)
    if result is not None:
        print(json.dumps({"mode": "plain" if args.plain else "gaps", **result}), flush=True)


if __name__ == "__main__":
    main()
