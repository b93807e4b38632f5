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

from . import Client, IdError, ShapeError, UnknownNameError, _native

__all__ = ["ShardedEmbedding", "ShardedEmbeddingBag", "DenseParameters", "layout_for", "shard_embeddings", "state_dict"]


class _PullRows:
    """Pulls rows in a background thread (the native client releases the GIL during I/O)."""

    def __init__(self, client: Client, table: str):
        self._client = client
        self._table = table
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"gaps-{table}")

    def pull(self, unique: np.ndarray, create: bool, remember: bool):
        return _native(self._client._native.pull_rows_tagged, self._table, unique.tobytes(), create, remember)

    def submit(self, work):
        return self._pool.submit(work)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _in_backward() -> bool:
    """True while an autograd backward pass runs on this thread."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


class _RowStep:
    """One table's row traffic of one step, shared by every lookup of the table through one client: the
    pulls read (tokens), and the gradients backward produced for them, summed per id and pushed **once**,
    when the backward pass ends (a callback queued on the autograd engine). A second backward over the same
    forward (another loss) pushes its own gradients the same way; the next forward starts a new step."""

    def __init__(self, client: Client, table: str, dim: int):
        self.client, self.table, self.dim = client, table, dim
        self.tokens: list[int] = []
        self.ids: list[np.ndarray] = []
        self.grads: list[np.ndarray] = []
        self.pushed = False
        # The push goes out on a thread of its own, beside the next step's compute; its error, if any, is
        # raised at a later `wait()` (the next `Client.pull_rows`, `close()`, a sync step's dense push).
        # In async training with a DenseParameters on the client, the push is held until the dense push has
        # been answered, so the dense reply the worker waits for is not queued behind the rows at a shard;
        # in sync and gba a step's rows go before its dense push.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"gaps-push-{table}")
        self._in_flight: list[concurrent.futures.Future] = []
        self._held: tuple | None = None

    def release(self) -> None:
        """Sends the held push, if any."""
        held, self._held = self._held, None
        if held is not None:
            self._in_flight.append(self._pool.submit(_native, self.client._native.push_rows_merged, *held))

    def wait(self) -> None:
        """Sends the held push and waits for everything in flight; raises the first error."""
        self.release()
        futures, self._in_flight = self._in_flight, []
        for future in futures:
            future.result()

    @staticmethod
    def of(client: Client, table: str, dim: int) -> "_RowStep":
        steps = client.__dict__.setdefault("_gaps_row_steps", {})
        if table not in steps:
            steps[table] = _RowStep(client, table, dim)
        return steps[table]

    def read(self, token: int) -> None:
        # A push that failed is raised at the next step, not only at close.
        failed = [f for f in self._in_flight if f.done() and f.exception() is not None]
        self._in_flight = [f for f in self._in_flight if not f.done()]
        if failed:
            raise failed[0].exception()
        if self.ids and not _in_backward():
            # Gradients of a backward that raised before its end (its push callback never ran): dropped,
            # not mixed into the next step's push.
            self.ids, self.grads = [], []
        if self.pushed:  # a new step: the last one's pulls are forgotten once its push has used them
            self.release()
            if self.tokens:
                self._in_flight.append(self._pool.submit(_native, self.client._native.forget_rows, self.tokens))
            self.tokens, self.pushed = [], False
        self.tokens.append(token)

    def gradient(self, unique: np.ndarray, grad: np.ndarray) -> None:
        self.ids.append(unique)
        self.grads.append(grad)
        # One callback per lookup's gradient: the first, at the end of the backward pass, pushes everything
        # the pass accumulated; the others find nothing left (no flag that a failed backward could leave set).
        torch.autograd.Variable._execution_engine.queue_callback(self.push)

    def push(self) -> None:
        if not self.ids:
            return
        if len(self.ids) == 1:  # one lookup this step: its ids are distinct already
            unique, summed = self.ids[0], self.grads[0]
        else:
            ids = np.concatenate(self.ids)
            unique, inverse = np.unique(ids, return_inverse=True)
            summed = torch.zeros((len(unique), self.dim), dtype=torch.float32)
            summed.index_add_(0, torch.from_numpy(inverse.reshape(-1)), torch.from_numpy(np.concatenate(self.grads)))
            summed = summed.numpy()
        self.ids, self.grads = [], []
        self.pushed = True
        self.release()  # a second backward's push goes after the first
        self._held = (
            self.table,
            list(self.tokens),
            np.ascontiguousarray(unique, dtype="<u8").tobytes(),
            np.ascontiguousarray(summed, dtype="<f4").tobytes(),
        )
        dense_follows = self.client.__dict__.get("_gaps_dense_parameters", False)
        if not dense_follows or _native(self.client._native.synchronous):
            self.release()


class ShardedEmbedding(torch.nn.Module):
    """Embedding rows of table ``table`` that live on the shards.

    ``forward(ids)`` takes an integer tensor of any shape (ids ≥ 0), pulls each distinct id's row once,
    and returns ``ids.shape + (dim,)`` (or, with ``mode="sum"``/``"mean"``, reduces over the last axis of
    ``ids`` like ``torch.nn.EmbeddingBag``). A table may be looked up any number of times per step, through
    one module or several (one shared table looked up per field, say): the backward pass sums each row's
    gradients over every lookup and pushes them once per table. Rows are created on the shards on first use
    in training; a lookup with gradients off (evaluation, ``torch.no_grad()``), from an observer client, or
    with ``create=False`` never creates rows (a missing row reads as the initial value it would get, and is
    not stored) and pushes nothing.
    """

    def __init__(self, client: Client, table: str, mode: str | None = None, *, create: bool = True):
        super().__init__()
        if table not in client.layout.tables:
            raise UnknownNameError(f"the cluster serves no table {table!r}")
        if mode not in (None, "sum", "mean"):
            raise ValueError(f"mode must be None, 'sum' or 'mean', not {mode!r}")
        self.client = client
        self.table = table
        self.dim = client.layout.tables[table].dim
        self.mode = mode
        self.create = create
        self._rows = _PullRows(client, table)
        self._prefetched: dict = {}

    @staticmethod
    def _unique(ids) -> tuple[np.ndarray, torch.Tensor]:
        ids = torch.as_tensor(ids)
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(f"ids must be integers, not {ids.dtype}")
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        if unique.numel() and int(unique[0]) < 0:
            raise IdError("ids must not be negative")
        return unique.cpu().numpy().astype(np.uint64), inverse

    def _training(self) -> bool:
        return torch.is_grad_enabled() and self.client.worker_id is not None

    @staticmethod
    def _key(ids: torch.Tensor):
        return (tuple(ids.shape), ids.dtype, ids.numpy().tobytes())

    def prefetch(self, ids) -> None:
        """Starts pulling the rows of a later batch's ``ids`` now, on the pull thread (its distinct ids are
        found there too), for a training step."""
        ids = torch.as_tensor(ids).cpu()
        key = self._key(ids)
        if key in self._prefetched:
            return
        ids = ids.clone()

        def work():
            unique, inverse = self._unique(ids)
            return (unique, inverse, *self._rows.pull(unique, self.create, True))

        self._prefetched[key] = self._rows.submit(work)
        while len(self._prefetched) > 4:  # a few batches ahead at most: the oldest is dropped
            self._forget(self._prefetched.pop(next(iter(self._prefetched))))

    def _forget(self, future) -> None:
        if future.done() and future.exception() is None and future.result()[3] is not None:
            _native(self.client._native.forget_rows, [future.result()[3]])

    def _lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of the distinct ids (a leaf whose gradient is pushed) and the index of each id."""
        training = self._training()
        hit = self._prefetched.pop(self._key(ids), None) if self._prefetched and ids.device.type == "cpu" else None
        if hit is not None:
            unique, inverse, raw, token = hit.result()
            if not training and token is not None:
                _native(self.client._native.forget_rows, [token])
                token = None
        else:
            unique, inverse = self._unique(ids)
            raw, token = self._rows.pull(unique, self.create and training, training)
        rows = torch.from_numpy(np.frombuffer(raw, dtype="<f4").reshape(len(unique), self.dim))
        if training and token is not None:
            step = _RowStep.of(self.client, self.table, self.dim)
            step.read(token)
            rows.requires_grad_(True)

            def gradient(grad: torch.Tensor) -> None:
                step.gradient(unique, grad.detach().cpu().numpy().astype(np.float32, copy=False))

            rows.register_hook(gradient)
        return rows, inverse

    def forward(self, ids, offsets=None) -> torch.Tensor:
        ids = torch.as_tensor(ids)
        rows, inverse = self._lookup(ids)
        if offsets is not None:
            return self._bags(rows[inverse], ids, torch.as_tensor(offsets))
        out = rows[inverse].reshape(*ids.shape, self.dim)
        if self.mode == "sum":
            out = out.sum(dim=-2)
        elif self.mode == "mean":
            out = out.mean(dim=-2)
        return out

    def _bags(self, values: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Ragged bags as ``torch.nn.EmbeddingBag`` takes them: 1-d ``ids``, ``offsets`` the start of each bag."""
        if self.mode is None:
            raise ValueError("offsets need a reducing mode: ShardedEmbeddingBag, or mode='sum' or 'mean'")
        if ids.dim() != 1 or offsets.dim() != 1:
            raise ShapeError(f"with offsets, ids and offsets are 1-d (got {tuple(ids.shape)} and {tuple(offsets.shape)})")
        n = ids.numel()
        starts = offsets.to(torch.int64)
        if starts.numel() and (int(starts[0]) != 0 or bool((starts[1:] < starts[:-1]).any()) or int(starts[-1]) > n):
            raise ShapeError("offsets must start at 0, never decrease and stay within the ids")
        bag = torch.bucketize(torch.arange(n), starts, right=True) - 1
        out = torch.zeros(starts.numel(), self.dim, dtype=values.dtype).index_add(0, bag, values)
        if self.mode == "mean":
            counts = torch.bincount(bag, minlength=starts.numel()).clamp(min=1).to(values.dtype)
            out = out / counts.unsqueeze(1)
        return out

    def close(self) -> None:
        """Waits for the table's row push in flight (raising its error), then stops the threads."""
        self.client._wait_row_pushes()
        self._rows.close()
        for future in self._prefetched.values():
            self._forget(future)
        self._prefetched.clear()


class ShardedEmbeddingBag(ShardedEmbedding):
    """``torch.nn.EmbeddingBag`` over a table on the shards: sums (or, ``mode="mean"``, averages) the rows of
    each bag — the last axis of ``ids``, or ragged bags given by ``offsets`` (1-d ids, the start of each
    bag), as ``torch.nn.EmbeddingBag(ids, offsets)`` takes them."""

    def __init__(self, client: Client, table: str, mode: str = "sum", *, create: bool = True):
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean', not {mode!r}")
        super().__init__(client, table, mode=mode, create=create)


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
        client.__dict__["_gaps_dense_parameters"] = True  # row pushes may wait for the dense push (async)

    @torch.no_grad()
    def initialize(self) -> bool:
        """Uploads the module's own initial values (its ``nn.init``), then pulls: the first worker to call it
        sets the cluster's starting point, the others adopt it (every worker starts from the same values).
        True when this call's values were taken."""
        values = {
            name: p.detach().cpu().numpy().astype(np.float32, copy=False).reshape(self.client.layout.tensors[name].shape)
            for name, p in self.params.items()
        }
        taken, _ = self.client.initialize(values)
        self.pull()
        return taken > 0

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
        steps = self.client.__dict__.get("_gaps_row_steps", {}).values()
        if _native(self.client._native.synchronous):
            # In sync and gba a step's rows must reach the shards before the dense push that ends it.
            self.client._wait_row_pushes()
        try:
            if pull:
                self._copy_in(self.client.push_pull(grads, compute_seconds=compute))
            else:
                self.client.push(grads, compute_seconds=compute)
        finally:
            for step in steps:  # async: the rows held for this dense push go out now
                step.release()
        if zero_grad:
            for p in self.params.values():
                p.grad = None

    @torch.no_grad()
    def _copy_in(self, values: dict) -> None:
        for name, p in self.params.items():
            p.copy_(torch.from_numpy(values[name]).reshape(p.shape))
        self._pulled_at = time.monotonic()


def _embedding_modules(module: torch.nn.Module) -> dict:
    """The ``nn.Embedding`` / ``nn.EmbeddingBag`` submodules of ``module`` by their path."""
    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    return {name: m for name, m in module.named_modules() if name and isinstance(m, kinds)}


def layout_for(module: torch.nn.Module, tables: dict[str, int] | None = None, chunk_elems: int = 65536) -> str:
    """A layout file (TOML) serving ``module``: its ``nn.Embedding`` and ``nn.EmbeddingBag`` submodules become
    embedding tables named by their path (``"emb"``, ``"towers.0.emb"``; dim = ``embedding_dim``), every other
    parameter a dense tensor of its name and shape; ``tables`` (name -> dim) adds tables of its own. Swap the
    embeddings for their shards with :func:`shard_embeddings`."""
    embedded = _embedding_modules(module)
    lines = [f"chunk_elems = {int(chunk_elems)}", ""]
    owned = {f"{name}.{p}" for name, m in embedded.items() for p, _ in m.named_parameters(recurse=False)}
    for name, p in module.named_parameters():
        if name in owned:
            continue
        shape = ", ".join(str(int(d)) for d in p.shape) or "1"
        lines += ["[[tensor]]", f'name = "{name}"', f"shape = [{shape}]", ""]
    for name, dim in {**{n: m.embedding_dim for n, m in embedded.items()}, **(tables or {})}.items():
        lines += ["[[table]]", f'name = "{name}"', f"dim = {int(dim)}", ""]
    return "\n".join(lines)


def shard_embeddings(module: torch.nn.Module, client: Client, *, create: bool = True) -> dict:
    """Replaces, in place, every ``nn.Embedding`` / ``nn.EmbeddingBag`` submodule of ``module`` that the
    cluster serves as a table of its path (what :func:`layout_for` writes) by a :class:`ShardedEmbedding` /
    :class:`ShardedEmbeddingBag` of that table, so the model's own ``forward`` looks its rows up on the
    shards unchanged (any number of times per step). Returns the new modules by path. The module's other
    parameters are then what :class:`DenseParameters` serves."""
    replaced = {}
    for name, m in _embedding_modules(module).items():
        table = client.layout.tables.get(name)
        if table is None:
            raise UnknownNameError(f"the cluster serves no table {name!r} for the module's {type(m).__name__}")
        if table.dim != m.embedding_dim:
            raise ShapeError(f"{name}: the module's embedding_dim is {m.embedding_dim}, the cluster's table {table.dim}")
        if isinstance(m, torch.nn.EmbeddingBag):
            if m.mode not in ("sum", "mean"):
                raise ValueError(f"{name}: EmbeddingBag mode {m.mode!r} is not served (sum or mean)")
            new = ShardedEmbeddingBag(client, name, mode=m.mode, create=create)
        else:
            new = ShardedEmbedding(client, name, create=create)
        parent_name, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, child, new)
        replaced[name] = new
    return replaced


def state_dict(client: Client) -> dict:
    """The cluster's dense tensors as a ``state_dict`` (name -> ``torch.Tensor``) — what a serving copy of the
    module loads with ``load_state_dict(..., strict=False)`` (its tables go through
    :meth:`gaps.Client.export_table`)."""
    return {name: torch.from_numpy(np.array(value)) for name, value in client.pull_all().items()}
