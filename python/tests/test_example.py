"""The PyTorch DLRM example runs end to end (short): worker processes train through a local cluster and
the held-out AUC beats chance."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "torch_dlrm.py"


def test_torch_dlrm_example_trains_and_reports_auc():
    pytest.importorskip("torch", reason="PyTorch is not installed (scripts/test installs it)")
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--workers", "2", "--steps", "60", "--eval-samples", "3000"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, RUST_BACKTRACE="0"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(r"held-out AUC ([0-9.]+)", out.stdout)
    assert m, out.stdout
    assert float(m.group(1)) > 0.7, out.stdout


def test_the_readme_quickstart_runs_and_its_loss_falls():
    out = subprocess.run(
        [sys.executable, str(EXAMPLE.parent / "quickstart.py")], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("step")]
    assert len(losses) >= 2 and losses[-1] < losses[0] / 10, out.stdout
