"""docs/api.md's examples run as written against `zerokl up --tinker` on the CPU (one fleet, in order):
the gRPC clients' RL loop, the Jobs API's, and the official tinker SDK's. Each example asserts KL 0.0
at every step itself; here each must exit 0 and print its steps."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S)


def test_the_api_page_examples_run_against_zerokl_up(tmp_path, zerokl_up) -> None:
    examples = _examples()
    assert len(examples) == 3            # gRPC clients, Jobs API, Tinker SDK: none skipped
    workdir = tmp_path / "up"
    with zerokl_up(workdir, "--tinker", "--tinker-port", "0", timeout=300) as services:
        env = {**os.environ, "ZEROKL_UP_DIR": str(workdir), "TINKER_BASE_URL": services["tinker"]["http"],
               "TINKER_API_KEY": "tml-local"}
        for i, code in enumerate(examples):
            # Run from an empty directory, as a user's script would (nothing of the checkout on the path).
            run = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                                 text=True, timeout=600)
            assert run.returncode == 0, f"example {i}:\n{run.stdout}\n{run.stderr[-4000:]}"
            steps = re.findall(r"^step (\d+): reward \S+ kl (\S+)", run.stdout, re.M)
            assert len(steps) == 2 and {kl for _, kl in steps} == {"0.0"}, (i, run.stdout)
