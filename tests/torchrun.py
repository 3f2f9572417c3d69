"""The CLI under torchrun with two ranks on the CPU, for the tests of passes split across ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

TORCHRUN_SCRIPT = """
import sys
from wsi_loader.cli import main
sys.exit(main(sys.argv[1:]))
"""


def torchrun_cli(tmp_path: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Runs `wsi-loader ARGS` under `torch.distributed.run` with two ranks; returns the finished
    process (stdout and stderr captured as text) without checking its exit status."""
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(script), *args,
        ],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
