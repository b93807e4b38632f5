"""A throwaway local cluster for tests and notebooks::

    from gaps.testing import local_cluster
    with local_cluster("layout.toml", servers=2) as c:
        with gaps.Client(c.coordinator, c.ca, c.cert, c.key) as client:
            ...

It runs ``gaps certs`` and ``gaps server`` processes from the ``gaps`` executable found through the
``GAPS_BIN_DIR`` environment variable or on ``PATH``, on 127.0.0.1 with ephemeral ports, and stops them
(SIGTERM, then SIGKILL) on exit. On Linux the shards also get SIGTERM when the Python process that started
them dies in any way (SIGTERM, SIGKILL, a crash), so a killed script leaves no shard running: keep the
thread that entered ``local_cluster`` alive while the cluster is in use (the signal follows that thread).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["find_gaps", "local_cluster", "LocalCluster"]


try:  # Linux: a shard gets SIGTERM when the process that started it dies, even by SIGKILL.
    import ctypes
    import signal as _signal

    _LIBC = ctypes.CDLL(None, use_errno=True)
    _PR_SET_PDEATHSIG = 1

    def _die_with_parent() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(_signal.SIGTERM), 0, 0, 0)

    if not hasattr(_LIBC, "prctl"):
        _die_with_parent = None  # type: ignore[assignment]
except (OSError, AttributeError):  # not Linux: shards are stopped on exit only
    _die_with_parent = None  # type: ignore[assignment]


def find_gaps() -> str:
    """The ``gaps`` executable: ``$GAPS_BIN_DIR/gaps``, else ``gaps`` on ``PATH``."""
    bin_dir = os.environ.get("GAPS_BIN_DIR")
    if bin_dir:
        candidate = Path(bin_dir) / "gaps"
        if candidate.is_file():
            return str(candidate)
        raise FileNotFoundError(f"GAPS_BIN_DIR={bin_dir} holds no gaps executable (build it: cargo build --bin gaps)")
    found = shutil.which("gaps")
    if found is None:
        raise FileNotFoundError("no gaps executable on PATH; set GAPS_BIN_DIR to the folder that holds it")
    return found


@dataclass
class LocalCluster:
    """A running local cluster: a worker's credentials and the coordinator's address."""

    coordinator: str
    ca: str
    cert: str
    key: str
    dir: str
    shards: list = field(default_factory=list, repr=False)
    #: The coordinator's certificate and key: an operator's credentials (checkpoints).
    operator_cert: str = ""
    operator_key: str = ""
    _start: object = field(default=None, repr=False)

    def kill_shard(self, index: int) -> None:
        """SIGKILLs shard ``index`` (fault-injection in tests)."""
        self.shards[index].kill()
        self.shards[index].wait()

    def restart_shard(self, index: int) -> None:
        """Starts shard ``index`` again (after :meth:`kill_shard`) on its address, with its flags: with a
        checkpoint directory it restores its newest checkpoint and rejoins."""
        if self.shards[index].poll() is None:
            raise RuntimeError(f"shard {index} is still running")
        self._start(index)  # replaces self.shards[index] (the list the cleanup stops)

    def checkpoint(self) -> dict:
        """A cluster checkpoint now, asked with the coordinator's certificate (see
        :meth:`gaps.Client.checkpoint`); the shards need ``checkpoint_dir``."""
        from . import Client

        with Client(self.coordinator, self.ca, self.operator_cert, self.operator_key, observer=True) as op:
            return op.checkpoint()


def _read_listening(proc: subprocess.Popen, what: str, timeout: float) -> dict:
    """Reads the shard's JSON 'listening' line from its stdout within ``timeout`` seconds."""
    result: dict = {}

    def reader():
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "listening":
                result.update(event)
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    if not result:
        exited = proc.poll() is not None
        proc.kill()
        proc.wait()
        try:
            with open(proc.log_path, encoding="utf-8", errors="replace") as f:
                lines = f.readlines()
        except (OSError, AttributeError):
            lines = ["(no log)"]
        # The reason first: the error line (and a panic's message) rather than whatever followed it.
        reason = [line for line in lines if line.startswith("Error:") or "panicked at" in line]
        tail = "".join(reason[:3] + ["...\n"] + lines[-8:] if reason else lines[-15:])
        state = "exited" if exited else f"did not start within {timeout}s"
        raise RuntimeError(f"{what} {state}: {reason[0].strip() if reason else 'see its log'}; its log ends with:\n{tail}")
    return result


@contextlib.contextmanager
def local_cluster(
    layout: str | os.PathLike,
    servers: int = 2,
    *,
    rule: str | None = None,
    lr: float | None = None,
    mode: str | None = None,
    init_std: float | None = None,
    extra_args: list[str] | None = None,
    coordinator_args: list[str] | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: float | None = None,
    restore: str | None = None,
    start_timeout: float = 60.0,
):
    """Starts ``servers`` shards serving the layout file ``layout``; yields a :class:`LocalCluster`.

    ``rule``, ``lr``, ``mode`` and ``init_std`` (the standard deviation of the dense tensors' random
    initial values; 0 starts them at zero) are the shards' flags, each left at ``gaps server``'s default
    when not given (``gaps server --help``);
    ``extra_args`` adds others;
    ``coordinator_args`` adds flags of shard 0 alone (``["--data", path]`` to deal a file).
    ``checkpoint_dir`` keeps checkpoints there (each shard in ``shard-<i>/``; a cluster started on a
    directory that holds checkpoints restores them), ``checkpoint_every`` (seconds) takes them on a schedule,
    ``restore`` is ``"auto"`` (default), ``"never"`` or a checkpoint file.
    """
    gaps = find_gaps()
    workdir = tempfile.mkdtemp(prefix="gaps-cluster-")
    shards: list[subprocess.Popen] = []
    logs = []
    try:
        subprocess.run(
            [gaps, "certs", "--out", workdir, "--shards", str(servers)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        coordinator = None
        addrs: dict[int, str] = {}

        def start(i: int) -> subprocess.Popen:
            args = [
                gaps,
                "server",
                f"--shard-index={i}",
                f"--num-shards={servers}",
                f"--listen={addrs.get(i, '127.0.0.1:0')}",
                f"--ca={workdir}/ca.pem",
                f"--cert={workdir}/shard-{i}.pem",
                f"--key={workdir}/shard-{i}.key",
                f"--layout={os.fspath(layout)}",
            ]
            for flag, value in (("rule", rule), ("lr", lr), ("mode", mode), ("init-std", init_std)):
                if value is not None:
                    args.append(f"--{flag}={value}")
            if i > 0:
                args.append(f"--coordinator={coordinator}")
            if checkpoint_dir is not None:
                args.append(f"--checkpoint-dir={os.fspath(checkpoint_dir)}")
            if checkpoint_every is not None:
                args.append(f"--checkpoint-every={int(checkpoint_every * 1000)}ms")
            if restore is not None:
                args.append(f"--restore={restore}")
            args.extend(extra_args or [])
            if i == 0:
                args.extend(coordinator_args or [])
            log_path = os.path.join(workdir, f"shard-{i}.log")
            log = open(log_path, "ab")
            logs.append(log)
            env = dict(os.environ, GAPS_LOG=os.environ.get("GAPS_LOG", "warn"))
            # The four settings above are the arguments' or the server's defaults, never a variable of the
            # caller's environment (as when they were always passed as flags).
            for name in ("GAPS_RULE", "GAPS_LR", "GAPS_MODE", "GAPS_INIT_STD"):
                env.pop(name, None)
            env.setdefault("RUST_BACKTRACE", "0")  # a refused flag is one line, not a backtrace
            proc = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=log, text=True, env=env, preexec_fn=_die_with_parent
            )
            proc.log_path = log_path
            # Known to the cleanup below before anything can interrupt its start.
            if i < len(shards):
                shards[i] = proc
            else:
                shards.append(proc)
            event = _read_listening(proc, f"shard {i}", start_timeout)
            addrs[i] = event["addr"]
            return proc

        for i in range(servers):
            start(i)
            if coordinator is None:
                coordinator = addrs[0]
        yield LocalCluster(
            coordinator=coordinator,
            ca=f"{workdir}/ca.pem",
            cert=f"{workdir}/worker.pem",
            key=f"{workdir}/worker.key",
            dir=workdir,
            shards=shards,
            operator_cert=f"{workdir}/shard-0.pem",
            operator_key=f"{workdir}/shard-0.key",
            _start=start,
        )
    finally:
        for proc in reversed(shards):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 15
        for proc in shards:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
        shutil.rmtree(workdir, ignore_errors=True)
