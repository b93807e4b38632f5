"""PyTorch integration: embedding rows and dense parameters that live on the gaps shards.

A single-process loop changes by a few lines::

    client = gaps.Client(coordinator, ca, cert, key)
    emb = gaps.torch.ShardedEmbedding(client, "emb")          # rows on the shards
    dense = gaps.torch.DenseParameters(client, model)          # model's parameters on the shards
    dense.pull()                                               # shards -> model parameters
    for ids, x, y in batches:
        loss = loss_fn(model(emb(ids), x), y)
        loss.backward()                                        # pushes the rows' gradients
        dense.push(pull=True)                                  # pushes the dense gradients; the
                                                               # answer brings the new parameters

``emb.prefetch(next_ids)`` pulls the next batch's rows in the background while this one computes.
"""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import torch

from . import Client, ShapeError, UnknownNameError

__all__ = ["ShardedEmbedding", "ShardedEmbeddingBag", "DenseParameters", "layout_for"]


class _PullRows:
    """Pulls rows in a background thread (the native client releases the GIL during I/O)."""

    def __init__(self, client: Client, table: str):
        self._client = client
        self._table = table
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"gaps-{table}")
        self._pending: dict[bytes, concurrent.futures.Future] = {}

    def start(self, unique: np.ndarray) -> None:
        key = unique.tobytes()
        if key not in self._pending:
            self._pending[key] = self._pool.submit(self._client.pull_rows, self._table, unique)

    def get(self, unique: np.ndarray) -> np.ndarray:
        future = self._pending.pop(unique.tobytes(), None)
        if future is not None:
            return future.result()
        return self._client.pull_rows(self._table, unique)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._pending.clear()


class ShardedEmbedding(torch.nn.Module):
    """Embedding rows of table ``table`` that live on the shards.

    ``forward(ids)`` takes an integer tensor of any shape (ids ≥ 0), pulls each distinct id's row once,
    and returns ``ids.shape + (dim,)`` (or, with ``mode="sum"``/``"mean"``, reduces over the last axis of
    ``ids`` like ``torch.nn.EmbeddingBag``). The backward pass pushes the summed gradient of every distinct
    row once. Rows are created on the shards on first use.
    """

    def __init__(self, client: Client, table: str, mode: str | None = None):
        super().__init__()
        if table not in client.layout.tables:
            raise UnknownNameError(f"the cluster serves no table {table!r}")
        if mode not in (None, "sum", "mean"):
            raise ValueError(f"mode must be None, 'sum' or 'mean', not {mode!r}")
        self.client = client
        self.table = table
        self.dim = client.layout.tables[table].dim
        self.mode = mode
        self._rows = _PullRows(client, table)

    @staticmethod
    def _unique(ids) -> tuple[np.ndarray, torch.Tensor]:
        ids = torch.as_tensor(ids)
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(f"ids must be integers, not {ids.dtype}")
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        if unique.numel() and int(unique[0]) < 0:
            raise ShapeError("ids must not be negative")
        return unique.cpu().numpy().astype(np.uint64), inverse

    def prefetch(self, ids) -> None:
        """Starts pulling the rows of a later batch's ``ids`` now."""
        unique, _ = self._unique(ids)
        self._rows.start(unique)

    def forward(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids)
        unique, inverse = self._unique(ids)
        rows = torch.from_numpy(self._rows.get(unique))
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            client, table = self.client, self.table

            def push(grad: torch.Tensor) -> None:
                client.push_rows(table, unique, grad.detach().cpu().numpy().astype(np.float32, copy=False))

            rows.register_hook(push)
        out = rows[inverse].reshape(*ids.shape, self.dim)
        if self.mode == "sum":
            out = out.sum(dim=-2)
        elif self.mode == "mean":
            out = out.mean(dim=-2)
        return out

    def close(self) -> None:
        """Stops the prefetching thread."""
        self._rows.close()


class ShardedEmbeddingBag(ShardedEmbedding):
    """``torch.nn.EmbeddingBag`` over a table on the shards: sums (or, ``mode="mean"``, averages) the rows of
    each bag, the last axis of ``ids``."""

    def __init__(self, client: Client, table: str, mode: str = "sum"):
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean', not {mode!r}")
        super().__init__(client, table, mode=mode)


class DenseParameters:
    """Keeps ``module``'s parameters on the shards: :meth:`pull` before forward, :meth:`push` after backward.

    The layout's tensor names must be the module's parameter names (``module.named_parameters()``;
    :func:`layout_for` writes such a layout), shapes equal. A parameter without a gradient pushes zeros.
    """

    def __init__(self, client: Client, module: torch.nn.Module):
        self.client = client
        self.params = dict(module.named_parameters())
        served = client.layout.tensors
        missing = [n for n in served if n not in self.params]
        if missing:
            raise UnknownNameError(f"the cluster serves {missing[0]!r}, which the module does not have")
        extra = [n for n in self.params if n not in served]
        if extra:
            raise UnknownNameError(f"the module's parameter {extra[0]!r} is not served by the cluster")
        for name, p in self.params.items():
            scalar = p.dim() == 0 and served[name].size == 1
            if tuple(p.shape) != served[name].shape and not scalar:
                # Same size is not enough: a transposed weight would be filled in the wrong order.
                raise ShapeError(f"{name}: the module has shape {tuple(p.shape)}, the cluster {served[name].shape}")
        self._pulled_at: float | None = None

    @torch.no_grad()
    def pull(self) -> None:
        """Copies the shards' values into the module's parameters."""
        self._copy_in(self.client.pull_all())

    def push(self, *, zero_grad: bool = True, pull: bool = False) -> None:
        """Pushes the parameters' gradients (computed on the last pull) and, by default, clears them. With
        ``pull=True`` the shards answer the push with the new values, copied into the parameters as
        :meth:`pull` would (one request per shard instead of two; the next step needs no :meth:`pull`)."""
        grads = {}
        for name, p in self.params.items():
            g = p.grad
            grads[name] = (
                np.zeros(tuple(p.shape), np.float32)
                if g is None
                else g.detach().cpu().numpy().astype(np.float32, copy=False)
            )
        compute = None if self._pulled_at is None else time.monotonic() - self._pulled_at
        if pull:
            self._copy_in(self.client.push_pull(grads, compute_seconds=compute))
        else:
            self.client.push(grads, compute_seconds=compute)
        if zero_grad:
            for p in self.params.values():
                p.grad = None

    @torch.no_grad()
    def _copy_in(self, values: dict) -> None:
        for name, p in self.params.items():
            p.copy_(torch.from_numpy(values[name]).reshape(p.shape))
        self._pulled_at = time.monotonic()


def layout_for(module: torch.nn.Module, tables: dict[str, int] | None = None, chunk_elems: int = 65536) -> str:
    """A layout file (TOML) serving ``module``'s parameters and the embedding ``tables`` (name -> dim)."""
    lines = [f"chunk_elems = {int(chunk_elems)}", ""]
    for name, p in module.named_parameters():
        shape = ", ".join(str(int(d)) for d in p.shape) or "1"
        lines += ["[[tensor]]", f'name = "{name}"', f"shape = [{shape}]", ""]
    for name, dim in (tables or {}).items():
        lines += ["[[table]]", f'name = "{name}"', f"dim = {int(dim)}", ""]
    return "\n".join(lines)
