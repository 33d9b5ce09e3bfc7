"""The engine process's entry: importing it costs nothing (a replica spawns it before it imports torch)."""
from __future__ import annotations

import subprocess
import sys


def test_the_child_module_imports_neither_torch_nor_the_engine() -> None:
    code = ("import sys, zerokl.services.engine.child\n"
            "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('zerokl.services.engine.'))\n"
            "print(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['zerokl.services.engine.child']"


def test_a_prestarted_engine_process_nobody_takes_is_stopped() -> None:
    code = ("from zerokl.services.engine import child\n"
            "child.prestart()\n"
            "process, _ = child._started\n"
            "child.discard()\n"
            "assert child.take() is None and not process.is_alive(), process.exitcode\n"
            "print(process.exitcode)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"
