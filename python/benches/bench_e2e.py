"""A Python worker against the Rust worker, end to end, in the same run: DLRM on the synthetic data with one
shard and one worker, as `gaps bench e2e`'s 1×1 shape trains it (`gaps local --model dlrm --servers 1
--workers 1`, the Rust worker) and as `python/examples/torch_dlrm.py --servers 1 --workers 1` trains it (a
PyTorch module through gaps.torch, one torch thread), beside plain single-process PyTorch of the same model,
data and optimizers with no parameter server at all (`torch_baseline.py`, one thread). Rounds alternate so
load drifts hit all three alike; the table gives samples/s per round and the ratios. Also how long `import gaps` takes in a fresh interpreter
(against a bare one).

    GAPS_BIN_DIR=target/release python python/benches/bench_e2e.py [--steps 600] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import subprocess
import sys
import time

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "torch_dlrm.py"
BASELINE = pathlib.Path(__file__).resolve().parent / "torch_baseline.py"


def gaps_exe() -> str:
    from gaps.testing import find_gaps

    return find_gaps()


def rust_worker(steps: int) -> float:
    out = subprocess.run(
        [gaps_exe(), "local", "--model", "dlrm", "--servers", "1", "--workers", "1", "--steps", str(steps), "--json"],
        capture_output=True, text=True, check=True,
    )
    return float(json.loads(out.stdout.splitlines()[-1])["samples_per_s"])


def python_worker(steps: int) -> float:
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--servers", "1", "--workers", "1", "--steps", str(steps), "--eval-samples", "2000"],
        capture_output=True, text=True, check=True,
    )
    m = re.search(r"([0-9,]+) samples/s in the loops", out.stdout)
    if not m:
        raise RuntimeError(f"torch_dlrm.py printed no rate:\n{out.stdout}\n{out.stderr[-2000:]}")
    return float(m.group(1).replace(",", ""))


def plain_torch(steps: int) -> float:
    out = subprocess.run(
        [sys.executable, str(BASELINE), "--steps", str(steps), "--threads", "1", "--eval-samples", "2000"],
        capture_output=True, text=True,
    )
    lines = [l for l in out.stdout.splitlines() if l.lstrip().startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"torch_baseline.py failed ({out.returncode}):\n{out.stdout}\n{out.stderr[-2000:]}")
    return float(json.loads(lines[-1])["samples_per_s"])


def import_time(rounds: int = 5) -> tuple[float, float]:
    """Median seconds of a fresh `python -c "import gaps"` and of a bare `python -c pass`."""

    def run(code: str) -> float:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        return time.perf_counter() - started

    return (statistics.median(run("import gaps") for _ in range(rounds)), statistics.median(run("pass") for _ in range(rounds)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"{'round':>5} {'rust worker':>12} {'python worker':>14} {'ratio':>6} {'plain torch':>12} "
          f"{'rust/torch':>10} {'python/torch':>12}")
    ratios, vs_torch = [], []
    for r in range(args.rounds):
        rust = rust_worker(args.steps)
        python = python_worker(args.steps)
        torch_rate = plain_torch(args.steps)
        ratios.append(python / rust)
        vs_torch.append((rust / torch_rate, python / torch_rate))
        print(f"{r + 1:>5} {rust:>12,.0f} {python:>14,.0f} {python / rust:>6.2f} {torch_rate:>12,.0f} "
              f"{rust / torch_rate:>10.2f} {python / torch_rate:>12.2f}", flush=True)
    print(f"python / rust samples/s: median {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})")
    print(f"one shard + one worker / plain PyTorch (1 thread): rust {statistics.median(r for r, _ in vs_torch):.2f}, "
          f"python {statistics.median(p for _, p in vs_torch):.2f} (medians)")
    with_gaps, bare = import_time()
    print(f"import gaps: {with_gaps:.3f} s in a fresh interpreter ({bare:.3f} s for a bare one; "
          f"torch imported: {'torch' in sys.modules})")


if __name__ == "__main__":
    main()
