"""gaps: the Python client of the gaps parameter server.

A training loop becomes a gaps worker::

    import gaps
    with gaps.Client(coordinator, ca, cert, key) as client:
        params = client.pull_all()                    # dict name -> numpy.float32 array
        grads = compute_gradients(params, batch)      # dict name -> array of the same shape
        client.push(grads)                            # one push, computed on the last pull

Embedding rows live on the shards: ``client.pull_rows(table, ids)`` and ``client.push_rows(table, ids,
grads)``. Errors are :class:`GapsError` subclasses carrying the server's typed reason.

Training data can be dealt by the coordinator (started with ``--data``) to whichever worker asks next, so a
fast worker trains on more of it than a slow one::

    for split in client.splits("train.tsv"):          # the coordinator's --data, in its order
        for batch in split.batches(256):              # numpy arrays of this split's lines
            grads = compute_gradients(params, batch)
            params = client.push_pull(grads)          # one push per batch: tagged with the split
"""

from __future__ import annotations

import logging
import os

import numpy as np

from . import _gaps

__all__ = [
    "Client",
    "Split",
    "CriteoBatch",
    "read_split",
    "Layout",
    "TensorInfo",
    "TableInfo",
    "GapsError",
    "ShapeError",
    "DTypeError",
    "UnknownNameError",
    "NonFiniteError",
    "UnavailableError",
    "UnauthorizedError",
    "ServerError",
    "ClosedError",
    "ConfigError",
    "CertificateError",
    "OrderError",
    "IdError",
    "read_rows",
]


class GapsError(Exception):
    """Any error of the gaps client; ``str(e)`` is the reason the client or the server gave."""


class ShapeError(GapsError, ValueError):
    """An array's size or shape does not match the cluster's layout."""


class DTypeError(GapsError, TypeError):
    """An array is not float32 (values) or uint64 (ids)."""


class UnknownNameError(GapsError, KeyError):
    """The cluster serves no tensor or table of that name."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class NonFiniteError(GapsError, ValueError):
    """A gradient holds NaN or infinity (nothing was sent)."""


class UnavailableError(GapsError, ConnectionError):
    """The cluster could not be reached, or a shard stayed down past the shard-down timeout."""


class UnauthorizedError(GapsError, PermissionError):
    """The certificate or credential does not allow the request."""


class OrderError(GapsError, RuntimeError):
    """A call came out of order: a push before any pull, rows pushed that were not pulled."""


class IdError(GapsError, ValueError):
    """Embedding ids that cannot be ids (negative)."""


class ServerError(GapsError):
    """A shard refused the request for another reason."""


class ClosedError(GapsError):
    """The client was closed."""


class ConfigError(GapsError):
    """Bad client settings or TLS files, or a cluster that does not match them."""


class CertificateError(ConfigError, PermissionError):
    """A certificate was refused (from another CA, expired, of the wrong role): raised at once, with the
    reason, since trying again with the same files cannot succeed."""


_KINDS = {
    "shape": ShapeError,
    "dtype": DTypeError,
    "unknown": UnknownNameError,
    "nonfinite": NonFiniteError,
    "unavailable": UnavailableError,
    "unauthorized": UnauthorizedError,
    "server": ServerError,
    "closed": ClosedError,
    "config": ConfigError,
    "certificate": CertificateError,
    "order": OrderError,
}


def _native(call, *args, **kwargs):
    """Runs a native call, turning its NativeError into the matching GapsError subclass."""
    try:
        return call(*args, **kwargs)
    except _gaps.NativeError as e:
        kind, message = e.args if len(e.args) == 2 else ("server", str(e))
        raise _KINDS.get(kind, GapsError)(message) from None


class TensorInfo:
    """A dense tensor of the cluster's layout."""

    def __init__(self, name: str, shape: tuple[int, ...]):
        self.name = name
        self.shape = tuple(int(d) for d in shape)
        self.size = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    def __repr__(self) -> str:
        return f"TensorInfo({self.name!r}, shape={self.shape})"


class TableInfo:
    """An embedding table of the cluster's layout."""

    def __init__(self, name: str, dim: int):
        self.name = name
        self.dim = int(dim)

    def __repr__(self) -> str:
        return f"TableInfo({self.name!r}, dim={self.dim})"


class Layout:
    """What the cluster serves: ``tensors`` and ``tables`` by name, in layout order."""

    def __init__(self, raw: dict):
        self.tensors = {t["name"]: TensorInfo(t["name"], t["shape"]) for t in raw["tensors"]}
        self.tables = {t["name"]: TableInfo(t["name"], t["dim"]) for t in raw["tables"]}
        self.epoch = raw["epoch"]
        self.shards = raw["shards"]

    def __repr__(self) -> str:
        return f"Layout(tensors={list(self.tensors.values())}, tables={list(self.tables.values())})"


def _float32(name: str, value, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """``value`` as a C-contiguous little-endian float32 array (no copy when it already is one)."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.dtype != np.float32:
        raise DTypeError(f"{name}: expected float32 values, got {array.dtype}")
    # A flat array (or a scalar for a one-element tensor) is taken in row-major order; any other shape must be
    # the tensor's own: a transposed gradient of the same size is refused, not read in the wrong order.
    size = int(np.prod(shape, dtype=np.int64)) if shape is not None else 0
    if shape is not None and array.shape != shape and array.ndim <= 1 and array.size == size:
        array = array.reshape(shape)
    if shape is not None and array.shape != shape:
        raise ShapeError(f"{name}: expected shape {shape}, got {array.shape}")
    return np.ascontiguousarray(array, dtype="<f4")


def _ids(table: str, ids) -> np.ndarray:
    array = np.asarray(ids)
    if array.dtype.kind not in "ui":
        raise DTypeError(f"ids of {table}: expected unsigned 64-bit integers, got {array.dtype}")
    if array.dtype.kind == "i" and array.size and array.min() < 0:
        raise IdError(f"ids of {table}: ids must not be negative")
    if array.ndim != 1:
        raise ShapeError(f"ids of {table}: expected a 1-d array, got shape {array.shape}")
    return np.ascontiguousarray(array, dtype="<u8")


class Client:
    """A worker (or, with ``observer=True``, a read-only client) of a gaps cluster.

    Registers with the coordinator and connects to every shard. Pushes are exactly-once: a push retried
    after a lost connection keeps its sequence number. Heartbeats run in the background. Use it as a
    context manager, or call :meth:`close` (which also leaves the job). ``lanes`` is how many connections
    to each shard a large push or pull is striped over (1 to 64; see ``gaps-worker --lanes``), and how
    many threads carry the client's traffic beside the caller's.
    """

    def __init__(
        self,
        coordinator: str,
        ca: str,
        cert: str,
        key: str,
        *,
        worker_name: str | None = None,
        observer: bool = False,
        connect_timeout: float = 30.0,
        rpc_timeout: float = 30.0,
        shard_down_timeout: float = 600.0,
        lanes: int = 1,
    ):
        self._native = _native(
            _gaps.NativeClient,
            coordinator,
            str(ca),
            str(cert),
            str(key),
            worker_name or "python",
            observer,
            connect_timeout,
            rpc_timeout,
            shard_down_timeout,
            lanes,
        )
        self.layout = Layout(_native(self._native.layout))
        self._names = list(self.layout.tensors)

    @classmethod
    def from_env(cls, **kwargs) -> "Client":
        """A client with the credentials ``python -m gaps.launch`` gives each worker process:
        ``GAPS_COORDINATOR``, ``GAPS_CA``, ``GAPS_CERT`` and ``GAPS_KEY`` (``GAPS_RANK`` and
        ``GAPS_WORLD_SIZE`` say which worker this is). Keyword arguments are :class:`Client`'s."""
        names = ("GAPS_COORDINATOR", "GAPS_CA", "GAPS_CERT", "GAPS_KEY")
        missing = [n for n in names if not os.environ.get(n)]
        if missing:
            raise ConfigError(f"{', '.join(missing)} not set: start this script with python -m gaps.launch")
        kwargs.setdefault("worker_name", f"rank-{os.environ.get('GAPS_RANK', '?')}")
        return cls(*(os.environ[n] for n in names), **kwargs)

    @property
    def worker_id(self) -> int | None:
        """This worker's id (None for an observer)."""
        return _native(self._native.worker_id)

    def pull_all(self) -> dict[str, np.ndarray]:
        """Every dense tensor, by name, shaped as the layout says (writable float32 arrays)."""
        raw = _native(self._native.pull_all)
        return {
            name: np.frombuffer(buf, dtype="<f4").reshape(info.shape)
            for (name, info), buf in zip(self.layout.tensors.items(), raw)
        }

    def pull(self, name: str) -> np.ndarray:
        """One dense tensor (pulls the whole model: a push follows the last pull)."""
        if name not in self.layout.tensors:
            raise UnknownNameError(f"the cluster serves no tensor {name!r}")
        return self.pull_all()[name]

    def push(self, grads: dict, *, compute_seconds: float | None = None) -> None:
        """Pushes one gradient per dense tensor (by name), computed on the last pull.

        Every tensor needs a gradient; arrays must be float32 of the tensor's shape (or its size). NaN or
        infinity raises :class:`NonFiniteError` before anything is sent.
        """
        _native(self._native.push, self._gradients(grads), compute_seconds)

    def push_pull(self, grads: dict, *, compute_seconds: float | None = None) -> dict[str, np.ndarray]:
        """:meth:`push`, then what :meth:`pull_all` right after it returns, in one request per shard (each
        shard answers the push with the new values). Raises as :meth:`push` does, before anything is sent.
        """
        raw = _native(self._native.push_pull, self._gradients(grads), compute_seconds)
        return {
            name: np.frombuffer(buf, dtype="<f4").reshape(info.shape)
            for (name, info), buf in zip(self.layout.tensors.items(), raw)
        }

    def _gradients(self, grads: dict) -> list[bytes]:
        """One gradient per dense tensor, layout order, as float32 bytes; checked by name and shape."""
        unknown = sorted(set(grads) - set(self._names))
        if unknown:
            raise UnknownNameError(f"the cluster serves no tensor {unknown[0]!r}")
        missing = [n for n in self._names if n not in grads]
        if missing:
            raise ShapeError(f"no gradient for {missing[0]!r} (push needs one per tensor)")
        arrays = [_float32(f"the gradient of {n}", grads[n], self.layout.tensors[n].shape) for n in self._names]
        return [a.tobytes() for a in arrays]

    def _table(self, table: str) -> TableInfo:
        info = self.layout.tables.get(table)
        if info is None:
            raise UnknownNameError(f"the cluster serves no table {table!r}")
        return info

    def pull_rows(self, table: str, ids, *, create: bool = True) -> np.ndarray:
        """Rows of ``table`` for ``ids`` (uint64): a ``(len(ids), dim)`` float32 array."""
        info = self._table(table)
        ids = _ids(table, ids)
        self._wait_row_pushes()
        raw = _native(self._native.pull_rows, table, ids.tobytes(), create)
        return np.frombuffer(raw, dtype="<f4").reshape(len(ids), info.dim)

    def _wait_row_pushes(self) -> None:
        """Waits for the row pushes gaps.torch sent in the background (so this client reads its own writes)."""
        for step in self.__dict__.get("_gaps_row_steps", {}).values():
            step.wait()

    def push_rows(self, table: str, ids, grads) -> None:
        """Pushes ``(len(ids), dim)`` gradients for the rows of ``table`` last pulled with ``ids``."""
        info = self._table(table)
        ids = _ids(table, ids)
        grads = _float32(f"the row gradients of {table}", grads, (len(ids), info.dim))
        _native(self._native.push_rows, table, ids.tobytes(), grads.tobytes())

    def stats(self) -> list[dict]:
        """Each shard's counters."""
        return _native(self._native.stats)

    def splits(self, data: str, *, seed: int = 1):
        """The splits of the training data the coordinator deals this worker, one at a time, until every pass
        is dealt (dynamic data sharding; the coordinator needs ``--data``).

        ``data`` names the same files as the coordinator's ``--data`` (comma-separated, same order; the paths
        as this machine sees them), or ``"synthetic"`` (with the coordinator's seed). Each :class:`Split`
        yields numpy batches of its lines (:meth:`Split.batches`); push once per batch. A split whose
        batches were all taken is reported finished when the next one is asked for (every push of it was
        acknowledged by then); one left early is given back and dealt again. Every split is trained once
        per pass, whoever asks.
        """
        finished = None
        try:
            while True:
                raw = _native(self._native.next_split, finished)
                finished = None
                if raw is None:
                    return
                split = Split(self, raw, data, seed)
                yield split
                if split.done:
                    finished = split.grant
        finally:
            _native(self._native.set_data_tag, None)

    def data_status(self) -> list[dict]:
        """Every shard's samples per grant (``counts``: (grant, split key, samples)) and, on shard 0, the
        dealer's state (``dealer``: ``completed`` (grant, key) pairs, ``abandoned`` grants,
        ``samples_replayed``, ``splits_done``...)."""
        return _native(self._native.data_status)

    def initialize(self, values: dict) -> tuple[int, int]:
        """Uploads initial values for every dense tensor (``name -> array``): each chunk that no update and
        no earlier upload touched takes them, the others keep theirs — the first writer wins, so every worker
        may call it with its own module's initialisation and then :meth:`pull_all` what won. Returns (chunks
        taken, chunks kept)."""
        missing = [n for n in self._names if n not in values]
        if missing:
            raise ShapeError(f"initial values for {missing[0]!r} are missing")
        unknown = [n for n in values if n not in self.layout.tensors]
        if unknown:
            raise UnknownNameError(f"the cluster serves no tensor {unknown[0]!r}")
        arrays = [_float32(f"the initial values of {n}", values[n], self.layout.tensors[n].shape) for n in self._names]
        for n, a in zip(self._names, arrays):
            if not np.isfinite(a).all():
                raise NonFiniteError(f"the initial values of {n} are not all finite")
        return tuple(_native(self._native.initialize, [a.tobytes() for a in arrays]))

    def export_table(self, table: str, path: str | os.PathLike, *, page_rows: int = 65536) -> int:
        """Writes every row of ``table`` with its id to ``path`` in the rows format (see :func:`read_rows`),
        shard by shard, a page at a time (memory stays at one page). Returns the rows written. For an exact
        copy, export while no worker trains (rows created or evicted during the export may be missed)."""
        info = self._table(table)
        if page_rows < 1:
            raise ValueError(f"page_rows must be at least 1, not {page_rows}")
        self._wait_row_pushes()
        record = np.dtype([("id", "<u8"), ("row", "<f4", (info.dim,))])
        written = 0
        with open(path, "wb") as f:
            f.write(ROWS_MAGIC + np.array([ROWS_VERSION, info.dim], dtype="<u4").tobytes())
            for shard in range(_native(self._native.num_shards)):
                cursor = 0
                while cursor is not None:
                    ids, values, cursor = _native(self._native.table_page, table, shard, cursor, page_rows)
                    page = np.empty(len(ids) // 8, dtype=record)
                    page["id"] = np.frombuffer(ids, dtype="<u8")
                    page["row"] = np.frombuffer(values, dtype="<f4").reshape(-1, info.dim)
                    f.write(page.tobytes())
                    written += len(page)
        return written

    def import_table(self, table: str, path: str | os.PathLike) -> tuple[int, int]:
        """Loads the rows of a rows file (:meth:`export_table`) into ``table``: each row the table does not
        hold is created with the file's values; a held row keeps its own. Returns (created, kept)."""
        info = self._table(table)
        ids, rows = read_rows(path)
        if rows.shape[1] != info.dim:
            raise ShapeError(f"{path}: rows of {rows.shape[1]} floats, table {table} has dim {info.dim}")
        return tuple(_native(self._native.load_rows, table, ids.tobytes(), np.ascontiguousarray(rows, "<f4").tobytes()))

    def checkpoint(self) -> dict:
        """Asks every shard to write a checkpoint now (shards need ``--checkpoint-dir``), all at one point;
        returns ``{"id": …, "shards": [{"shard", "path", "step"}, …]}``. Only the coordinator's certificate
        may ask (an operator's client: ``observer=True`` with ``shard-0.pem``/``.key``;
        :meth:`gaps.testing.LocalCluster.checkpoint` does it); a worker's certificate gets
        :class:`UnauthorizedError`."""
        self._wait_row_pushes()
        return _native(self._native.checkpoint)

    def close(self) -> None:
        """Sends the row pushes gaps.torch still holds, leaves the job and closes the connections
        (idempotent)."""
        try:
            self._wait_row_pushes()
        finally:
            _native(self._native.close)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # Leaving may fail for the same reason the block did (a shard is down): that error stays the one
        # raised, the failure to leave is logged (the lease expires on its own).
        try:
            self.close()
        except GapsError as e:
            logging.getLogger("gaps").warning("leaving the cluster after an error failed: %s", e)

    def __repr__(self) -> str:
        return f"gaps.Client(worker_id={self.worker_id}, {self.layout!r})"


#: The rows format of :meth:`Client.export_table`: these 8 bytes, the format version and the row width
#: (two little-endian uint32), then one record per row — its id (uint64) and ``dim`` float32, little-endian.
ROWS_MAGIC = b"GAPSROWS"
ROWS_VERSION = 1


def read_rows(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """The ``(ids, rows)`` of a rows file: uint64 ids (n,) and float32 rows (n, dim)."""
    with open(path, "rb") as f:
        head = f.read(16)
        if len(head) != 16 or head[:8] != ROWS_MAGIC:
            raise ConfigError(f"{path} is not a gaps rows file (it does not start with {ROWS_MAGIC!r})")
        version, dim = np.frombuffer(head[8:], dtype="<u4")
        if version != ROWS_VERSION or dim == 0:
            raise ConfigError(f"{path}: rows format {version} with rows of {dim}; this gaps reads format {ROWS_VERSION}")
        record = np.dtype([("id", "<u8"), ("row", "<f4", (int(dim),))])
        body = f.read()
    if len(body) % record.itemsize:
        raise ConfigError(f"{path} is cut short: {len(body)} bytes of records of {record.itemsize}")
    records = np.frombuffer(body, dtype=record)
    return records["id"].copy(), records["row"].copy()


class CriteoBatch:
    """Samples in the Criteo layout as numpy arrays: ``labels`` (n,) float32 0/1, ``ints`` (n, 13) float32
    (log(1 + max(x, 0)) of the integer features, as the built-in models use), ``ids`` (n, 26) uint64
    feature ids (``2**64 - 1`` where the field is missing)."""

    __slots__ = ("labels", "ints", "ids")

    def __init__(self, labels: np.ndarray, ints: np.ndarray, ids: np.ndarray):
        self.labels, self.ints, self.ids = labels, ints, ids

    def __len__(self) -> int:
        return len(self.labels)

    def __repr__(self) -> str:
        return f"gaps.CriteoBatch({len(self)} samples)"


def _batch(raw) -> CriteoBatch:
    labels, ints, ids = raw
    labels = np.frombuffer(labels, dtype="<f4")
    n = len(labels)
    return CriteoBatch(labels, np.frombuffer(ints, dtype="<f4").reshape(n, 13), np.frombuffer(ids, dtype="<u8").reshape(n, 26))


def read_split(data: str, split: dict, *, seed: int = 1, batch: int = 256):
    """Yields :class:`CriteoBatch` es of one dealt split (a dict of :meth:`Client.splits`' grants): the lines
    of its byte range of its file of ``data`` (every 10th line is held out, as the built-in workers do;
    bad lines are skipped and counted), or its synthetic samples. A file that shrank or vanished raises
    :class:`ConfigError` naming it."""
    if batch < 1:
        raise ConfigError(f"batch must be at least 1, got {batch}")
    reader = _native(
        _gaps.SplitReader,
        data,
        seed,
        split["files"],
        split["file"],
        split["first_line"],
        split["start"],
        split["end"],
    )
    while True:
        b = _batch(_native(reader.next_batch, batch))
        if len(b) == 0:
            return
        yield b


class Split:
    """One split of the training data dealt to this worker (see :meth:`Client.splits`): ``grant`` (this
    deal's number), ``key`` (``epoch << 32 | index``), ``epoch``, ``index``, ``lines``."""

    def __init__(self, client: Client, raw: dict, data: str, seed: int):
        self._client, self._raw, self._data, self._seed = client, raw, data, seed
        self.grant: int = raw["grant"]
        self.key: int = raw["key"]
        self.epoch: int = raw["epoch"]
        self.index: int = raw["index"]
        self.lines: int = raw["lines"]
        self.done = False

    def batches(self, batch: int = 256):
        """Yields the split's samples as :class:`CriteoBatch` es of up to ``batch`` (the last one short), and
        tags the pushes that follow each with it: push once per batch."""
        try:
            for b in read_split(self._data, self._raw, seed=self._seed, batch=batch):
                _native(self._client._native.set_data_tag, self.grant, self.key, len(b))
                yield b
            self.done = True
        finally:
            # Pushes after the split (or after leaving it early) are not counted under it.
            _native(self._client._native.set_data_tag, None)

    def __repr__(self) -> str:
        return f"gaps.Split(epoch={self.epoch}, index={self.index}, lines={self.lines}, grant={self.grant})"

# `gaps.testing.local_cluster` as the README spells it, and the public data reader and metrics (they need only
# the standard library and numpy).
from . import data, metrics, testing  # noqa: E402
