"""Starts (or joins) a gaps cluster and runs a training script as N worker processes, like ``torchrun``::

    python -m gaps.launch --servers 2 --workers 4 --layout layout.toml train.py --epochs 2
    python -m gaps.launch --workers 4 --module mymodel:DeepFM train.py          # layout from the model
    python -m gaps.launch --workers 4 --coordinator HOST:PORT --ca ca.pem --cert worker.pem --key worker.key train.py

Each worker process gets its place and the cluster's credentials in its environment — ``GAPS_RANK``,
``GAPS_WORLD_SIZE``, ``GAPS_COORDINATOR``, ``GAPS_CA``, ``GAPS_CERT``, ``GAPS_KEY`` (``gaps.Client.from_env()``
reads the last four) — and runs ``python script.py args…``. Their output is streamed with a ``[rank]``
prefix. When a worker fails, the others are stopped; Ctrl-C or SIGTERM stops every worker and every shard
the launcher started (on Linux they also die with the launcher if it is killed outright). At the end one JSON
line (``{"event": "launch_done", …}``) gives each worker's exit code, the wall time and, for a cluster it
started, the shards' push counters.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from . import testing

__all__ = ["main"]


#: ``gaps server``'s flags the launcher sets on each shard itself (or takes under its own name to join a cluster),
#: and one that cannot be the same for every shard of a machine (``--metrics-addr``: one port each; give it
#: per shard with ``gaps server``).
_SET_BY_LAUNCHER = frozenset(
    {"shard-index", "num-shards", "listen", "advertise", "coordinator", "ca", "cert", "key", "layout", "metrics-addr"}
)

#: The launcher's own options: a server flag of the same name (none today) stays the launcher's.
_OWN = frozenset({"workers", "servers", "module", "server-arg", "grace", "help"})


def _shard_flags(gaps: str) -> list[dict]:
    """``gaps server``'s own flags (``gaps reference --json server``: name, value, default, help), less those the
    launcher sets: the launcher declares none of them again, so their names, defaults and checks stay the
    server's."""
    out = subprocess.run([gaps, "reference", "--json", "server"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{gaps} reference --json server failed: {out.stderr.strip()}")
    return [f for f in json.loads(out.stdout) if f["long"] and f["long"] not in _SET_BY_LAUNCHER | _OWN]


def _parser(shard_flags: list[dict]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gaps.launch",
        description="Run a training script as N gaps worker processes on a cluster this starts or joins.",
        # A shortened flag would reach the server whole (`--sparse-adagrad` as --sparse-adagrad-init), where
        # gaps server itself refuses abbreviations.
        allow_abbrev=False,
    )
    p.add_argument("--workers", type=int, default=1, help="worker processes to start (default 1)")
    p.add_argument("--servers", type=int, default=1, help="shards to start (default 1; not with --coordinator)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--layout", help="the layout file the shards serve")
    where.add_argument(
        "--module",
        help="pkg.module:Model — a torch.nn.Module built with no arguments whose layout (gaps.torch.layout_for) "
        "the shards serve",
    )
    p.add_argument("--server-arg", action="append", default=[], help="another flag for every shard (repeatable)")
    p.add_argument("--coordinator", help="join this running cluster instead of starting one")
    p.add_argument("--ca", help="with --coordinator: the cluster's CA certificate")
    p.add_argument("--cert", help="with --coordinator: a worker certificate")
    p.add_argument("--key", help="with --coordinator: its key")
    p.add_argument("--grace", type=float, default=10.0, help="seconds a stopped worker gets before SIGKILL")
    shard = p.add_argument_group(
        "shard flags",
        "gaps server's own flags, given to every shard this starts (not with --coordinator); a flag not given "
        "keeps the server's default",
    )
    for f in shard_flags:
        default = f" (gaps server's default: {','.join(f['default'])})" if f["default"] else ""
        helptext = (f["help"] + default).replace("%", "%%")
        dest = "shard_" + f["long"].replace("-", "_")
        if f["value"] is None:
            shard.add_argument(f"--{f['long']}", dest=dest, action="store_true", default=None, help=helptext)
        else:
            metavar = f["value"].strip("<>")
            shard.add_argument(f"--{f['long']}", dest=dest, metavar=metavar, default=None, help=helptext)
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _given_shard_flags(args: argparse.Namespace, shard_flags: list[dict]) -> list[str]:
    """The shard flags given on the command line, as ``gaps server`` arguments (it checks their values)."""
    given = []
    for f in shard_flags:
        value = getattr(args, "shard_" + f["long"].replace("-", "_"))
        if value is None:
            continue
        given.append(f"--{f['long']}" if f["value"] is None else f"--{f['long']}={value}")
    return given


def _layout_of_module(spec: str, out_dir: str) -> str:
    """Writes the layout of ``pkg.module:Model()`` to a file; returns its path."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"--module takes pkg.module:Model, not {spec!r}")
    sys.path.insert(0, os.getcwd())
    try:
        model = getattr(importlib.import_module(module_name), attr)()
    except Exception as e:  # an import or constructor error of the user's code, said as such
        raise SystemExit(f"--module {spec}: building the model failed: {type(e).__name__}: {e}") from None
    import gaps.torch as gt

    path = os.path.join(out_dir, "layout.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(gt.layout_for(model))
    return path


class _Workers:
    """The worker processes, their output pumps, and stopping them."""

    def __init__(self, grace: float):
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.grace = grace
        self.lock = threading.Lock()
        #: The exit code of the worker whose failure stopped the others.
        self.first_failure: int | None = None

    def start(self, rank: int, cmd: list[str], env: dict) -> None:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            preexec_fn=testing._die_with_parent,
        )
        self.procs.append(proc)

        def pump() -> None:
            # Keeps draining even when our own stdout is gone (`| head`): a worker never blocks on a full pipe.
            writable = True
            for line in proc.stdout:
                if not writable:
                    continue
                try:
                    with self.lock:
                        sys.stdout.write(f"[{rank}] {line}" if line.endswith("\n") else f"[{rank}] {line}\n")
                        sys.stdout.flush()
                except (OSError, ValueError):
                    writable = False

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        self.pumps.append(t)

    def stop(self) -> None:
        """SIGTERM to every running worker, SIGKILL after the grace period."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + self.grace
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def wait(self) -> list[int]:
        """Waits for every worker; the first failure stops the others. Returns the exit codes."""
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                break
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                self.first_failure = failed[0]
                self.stop()
                break
            time.sleep(0.05)
        for t in self.pumps:
            t.join(timeout=5)
        return [p.wait() for p in self.procs]


def main(argv: list[str] | None = None) -> int:
    try:
        shard_flags = _shard_flags(testing.find_gaps())
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    args = _parser(shard_flags).parse_args(argv)
    if args.workers < 1:
        raise SystemExit("--workers must be at least 1")
    if args.coordinator and not (args.ca and args.cert and args.key):
        raise SystemExit("--coordinator needs --ca, --cert and --key (a worker's credentials)")
    if args.coordinator and (_given_shard_flags(args, shard_flags) or args.server_arg):
        raise SystemExit("shard flags start shards: with --coordinator the cluster's shards are already running")
    if not args.coordinator and not (args.layout or args.module):
        raise SystemExit("give --layout or --module (the model the shards serve), or --coordinator to join a cluster")
    if not os.path.exists(args.script):
        raise SystemExit(f"no script {args.script}")

    stopping = {"signal": None}
    workers = _Workers(args.grace)

    def on_signal(signum, _frame):
        if stopping["signal"] is None:  # the first signal stops everything; later ones wait for that
            stopping["signal"] = signum
            raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    summary: dict = {"event": "launch_done", "workers": args.workers}
    codes: list[int] = []
    try:
        with contextlib.ExitStack() as stack:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="gaps-launch-"))
            cluster = None
            if args.coordinator:
                creds = (args.coordinator, args.ca, args.cert, args.key)
            else:
                layout = args.layout or _layout_of_module(args.module, tmp)
                cluster = stack.enter_context(
                    testing.local_cluster(
                        layout,
                        servers=args.servers,
                        extra_args=_given_shard_flags(args, shard_flags) + args.server_arg,
                    )
                )
                creds = (cluster.coordinator, cluster.ca, cluster.cert, cluster.key)
                pids = " ".join(str(p.pid) for p in cluster.shards)
                print(f"[launch] {args.servers} shard(s) at {cluster.coordinator} (pids {pids})", flush=True)
            try:
                codes = _run_workers(args, creds, workers)
            except KeyboardInterrupt:
                workers.stop()
                codes = [p.returncode if p.returncode is not None else -1 for p in workers.procs]
                summary["stopped_by"] = signal.Signals(stopping["signal"] or signal.SIGINT).name
            finally:
                workers.stop()  # whatever ended the wait, no worker outlives the launcher
            if cluster is not None and not summary.get("stopped_by"):
                from . import Client

                with Client(cluster.coordinator, cluster.ca, cluster.cert, cluster.key, observer=True) as observer:
                    stats = observer.stats()
                summary["pushes_applied"] = sum(s["pushes_applied"] for s in stats)
                summary["pushes_applied_twice"] = sum(s.get("pushes_applied_twice", 0) for s in stats)
    except KeyboardInterrupt:  # while the cluster started or stopped
        workers.stop()
        summary["stopped_by"] = signal.Signals(stopping["signal"] or signal.SIGINT).name
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    summary["exit_codes"] = codes
    summary["wall_s"] = round(time.monotonic() - started, 3)
    print(json.dumps(summary), flush=True)
    if summary.get("stopped_by"):
        return 128 + int(getattr(signal, summary["stopped_by"]))
    failure = workers.first_failure if workers.first_failure is not None else next((c for c in codes if c != 0), 0)
    return failure if failure > 0 else (0 if failure == 0 else 1)


def _run_workers(args, creds: tuple, workers: _Workers) -> list[int]:
    """Starts the worker processes and waits for them."""
    for rank in range(args.workers):
        env = dict(
            os.environ,
            GAPS_RANK=str(rank),
            GAPS_WORLD_SIZE=str(args.workers),
            GAPS_COORDINATOR=creds[0],
            GAPS_CA=creds[1],
            GAPS_CERT=creds[2],
            GAPS_KEY=creds[3],
        )
        workers.start(rank, [sys.executable, args.script, *args.args], env)
    return workers.wait()


if __name__ == "__main__":
    sys.exit(main())
