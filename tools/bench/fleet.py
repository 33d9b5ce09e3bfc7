"""A `zerokl up` fleet a benchmark started: waiting for it to serve (the benches that measure through it)."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import time


def wait_up(workdir: pathlib.Path, proc: subprocess.Popen, timeout: float) -> dict[str, dict]:
    """The services of the fleet `zerokl up --workdir workdir` (process ``proc``) once every one is SERVING (its
    up.json, by name); SystemExit when ``proc`` exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    state = workdir / "up.json"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"zerokl up exited with {proc.returncode}; see {workdir / 'up.log'} and {workdir}/logs")
        if state.exists():
            services = {s["name"]: s for s in json.loads(state.read_text())["services"]}
            if services and all(s["status"] == "SERVING" for s in services.values()):
                return services
        if time.monotonic() > deadline:
            raise SystemExit(f"the fleet did not come up in {timeout:g} s; see {workdir}/logs")
        time.sleep(0.5)


def stop(proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """SIGTERM the fleet (`zerokl up` drains and stops its services), its whole process group killed past
    ``timeout`` seconds."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
