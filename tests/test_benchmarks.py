"""The prepared GPU check must not rot between GPU sessions: smoke-test it on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
