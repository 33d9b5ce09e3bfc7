"""Fixtures shared by the service tests: a whole `zerokl up` fleet on loopback."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Callable, ContextManager, Iterator

import pytest


@contextlib.contextmanager
def _up(workdir: pathlib.Path, *flags: str, timeout: float = 180.0) -> Iterator[dict[str, dict]]:
    """`zerokl up --workdir WORKDIR ... FLAGS`; yields its services (name -> up.json entry) once
    every one is SERVING; SIGTERM on exit (the whole process group killed if it does not stop).
    The model is the tiny preset, seed 0 (the tests' reference), unless FLAGS give --model or --preset."""
    model = [] if any(f.split("=")[0] in ("--model", "--preset") for f in flags) else ["--preset", "tiny"]
    # Its own output beside the workdir: why it exited, when it does (the services' logs are in WORKDIR/logs)
    workdir.parent.mkdir(parents=True, exist_ok=True)
    out = workdir.parent / f"{workdir.name}-up.out"
    with out.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "zerokl", "up", "--workdir", str(workdir), "--port", "0",
                                 "--threads", "1", "--grace", "2", *model, *flags],
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        state = workdir / "up.json"
        while True:
            assert proc.poll() is None, f"zerokl up exited {proc.returncode}: {out.read_text()[-3000:]}"
            if state.exists():
                services = {s["name"]: s for s in json.loads(state.read_text())["services"]}
                if all(s["status"] == "SERVING" for s in services.values()):
                    break
            assert time.monotonic() < deadline, "the services did not come up"
            time.sleep(0.25)
        yield services
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def zerokl_up() -> Callable[..., ContextManager[dict[str, dict]]]:
    """`with zerokl_up(workdir, *flags, timeout=180) as services:` a `zerokl up` fleet (weight
    store, decode, trainer, scheduler; prefill replicas with --prefill-replicas; the tiny preset unless
    FLAGS name a model) started with FLAGS; `services` maps each
    service's name to its up.json entry (address, pid, status)."""
    return _up
