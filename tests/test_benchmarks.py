"""Benchmark scripts must not rot between the sessions that run them: the prepared GPU check
and the feature benchmark, smoke-tested on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_script_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "check"
    options = "--device cpu --skip-tests --slides 1 --slide-width 3072 --tiles 64 --batch-size 16"
    script = str(ROOT / "benchmarks" / "gpu_check.py")
    subprocess.run(
        [sys.executable, script, *options.split(), "--workers", "0", "1", "--out", str(out)],
        check=True,
        capture_output=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=240,
    )
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["device"] == "cpu" and report["index_tiles"] > 0
    bench = report["bench"]
    assert [r["workers"] for r in bench["results"] if r["name"] == "make_loader"] == [0, 1]
    assert bench["device"]["decode"] == "cpu" and bench["device_decode"]["decode"] == "device"
    assert not (out / "slides").exists()  # only the reports stay


def test_bench_features_runs_on_a_small_slide(tmp_path: Path) -> None:
    """The feature benchmark (our passes against the CLAM-style extractor) must not rot."""
    script = str(ROOT / "benchmarks" / "bench_features.py")
    options = "--slides 1 --width 2048 --repeats 1 --workers 1 --batch-size 16"
    run = subprocess.run(
        [sys.executable, script, *options.split(), "--scratch", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
    )
    rows = [line.split()[:2] for line in run.stdout.splitlines()]
    assert ["CLAM-style", "extractor"] in rows and ["wsi_loader", "predict"] in rows
    with pytest.raises(subprocess.CalledProcessError) as refused:
        subprocess.run(
            [sys.executable, script, "--clam", str(tmp_path), "--scratch", str(tmp_path)],
            check=True,
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=240,
        )
    assert "--clam and --clam-python go together" in refused.value.stderr
