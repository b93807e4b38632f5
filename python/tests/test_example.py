"""The PyTorch DLRM example runs end to end (short): worker processes train through a local cluster and
the held-out AUC beats chance."""

import json
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


def test_a_deepfm_with_one_shared_table_trains_through_the_launcher_as_plain_pytorch_does(tmp_path):
    """A user's DeepFM (one table shared by 26 fields, looked up per field), unchanged, trained by 2 worker
    processes started by `python -m gaps.launch` with its own initialisation uploaded, against one plain
    PyTorch process on the same batches: the same held-out AUC within 0.01."""
    pytest.importorskip("torch", reason="PyTorch is not installed (scripts/test installs it)")
    script = EXAMPLE.parent / "deepfm.py"
    env = dict(os.environ, RUST_BACKTRACE="0")
    plain = subprocess.run(
        [sys.executable, str(script), "--plain", "--workers", "2", "--steps", "150"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    baseline = json.loads(plain.stdout.splitlines()[-1])
    launch = [sys.executable, "-m", "gaps.launch", "--servers", "2", "--workers", "2", "--module", "deepfm:DeepFM"]
    launch += ["--rule", "sgd", "--lr", "0.1", "--sparse-rule", "sgd", "--sparse-lr=0.1"]
    run = subprocess.run(
        [*launch, str(script), "--steps", "150", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, env=env, cwd=str(EXAMPLE.parent),
    )
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    result = json.loads(next(line[4:] for line in run.stdout.splitlines() if line.startswith("[0] {")))
    summary = json.loads(run.stdout.splitlines()[-1])
    print(f"plain PyTorch {baseline}, through gaps {result}, {summary}")
    assert summary["exit_codes"] == [0, 0] and summary["pushes_applied_twice"] == 0, summary
    assert baseline["auc"] > 0.7, baseline
    assert abs(result["auc"] - baseline["auc"]) <= 0.01, (baseline, result)


README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_the_readmes_python_section_runs_as_written(tmp_path):
    """Every ```python block of README.md's "## Python" section, run as a user would paste it (in an empty
    folder, with `gaps` on PATH through GAPS_BIN_DIR)."""
    text = README.read_text()
    section = text.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, "the README's Python section has no python block"
    checked = 0
    for i, block in enumerate(blocks):
        script = tmp_path / f"readme_{i}.py"
        script.write_text(block)
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert out.returncode == 0, (block, out.stderr[-3000:])
        # The quick start prints "step loss" lines; its loss falls from about 10 to about 0.
        losses = [float(line.split()[-1]) for line in out.stdout.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
        if losses:
            assert losses[-1] < losses[0] / 10, out.stdout[-2000:]
            checked += 1
    assert checked, "no block printed the quick start's falling loss"

