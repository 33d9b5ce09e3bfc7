"""Records only what someone reads (issue 49): a weights-only version shared in place whose record has not started
when the caller, serving a newer one, shares again is superseded: never recorded, RecordWeights says so at once.

Over real loopback gRPC against the trainer as `zerokl serve trainer` builds it, its store a real `zerokl serve
weight-store` process. The store is stopped (SIGSTOP) after the first record began, so which records have started
is fixed, not timed: the first one's upload hangs and every later one waits its turn. Then:

- SaveWeights(share, supersede) drops the weights-only versions shared before the caller's served one, but never a
  resume point (trainer state), nor one a RecordWeights waits for, nor the one the caller serves;
- RecordWeights of a superseded version answers at once, with the store still stopped, naming the newer version;
- once the store goes on (SIGCONT), every other version is recorded (the store checked each file's sha256);
  the superseded ones are not in the store;
- the record process (trainer/recorder.py) killed, the next record starts another.
"""
from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from zerokl.services.trainer import service as trainer_service
from zerokl.services.trainer.store_marks import META_STATE
from zerokl.services.trainer.config import TrainConfig

from test_trainer_service import _flags, _prompts, _rollouts, trainer_server

pytestmark = pytest.mark.timeout(180)


def _store(root: pathlib.Path, log: pathlib.Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "zerokl", "serve", "weight-store", "--root", str(root),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=log.open("a"), text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("weight-store listening on "):
        proc.kill()
        raise AssertionError(f"the weight store did not start: {line!r}; see {log}")
    return proc, line.split()[3]


def test_weights_only_versions_nobody_reads_are_superseded_never_recorded(tmp_path: pathlib.Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # A share asks the stopped store whether it holds the name; it answers nothing, so say so sooner.
    monkeypatch.setattr(trainer_service, "_STORE_CHECK_S", 0.2)
    proc, address = _store(tmp_path / "w", tmp_path / "store.log")

    async def main() -> None:
        async with trainer_server(address, *_flags(TrainConfig(lr=3e-3)), "--run", "sup") as (client, service):
            version = (await client.get_state()).weights_version

            async def step(n: int, weights_only: bool = True) -> str:
                nonlocal version
                await client.grpo_step(_rollouts(service.trainer, _prompts(2, n), version), 4)
                manifest, _, _ = await client.share_weights(weights_only=weights_only, supersede=True)
                version = manifest.version
                return version

            v1 = await step(1)
            # v1's record begins (nothing before it), then the store stops: its upload hangs there.
            while not service._records[v1].begun:
                await asyncio.sleep(0.01)
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                v2 = await step(2, weights_only=False)     # a resume point
                v3 = await step(3)
                v4 = await step(4)
                v5 = await step(5)      # the caller serves v4: v3 is read by no one
                superseded = await asyncio.wait_for(client.record_weights(v3), 10)
                assert superseded.manifest is None and superseded.superseded_by == v5
                # Someone waits for v4's record: a reader, so the next share keeps it.
                waiting = asyncio.ensure_future(client.record_weights(v4))
                while not service._records[v4].waiters:
                    await asyncio.sleep(0.01)
                v6 = await step(6)
                v7 = await step(7)      # serves v6: v5 is read by no one; v4 has a reader, v2 is a resume point
                assert (await asyncio.wait_for(client.record_weights(v5), 10)).superseded_by == v7
                assert not service._records[v1].superseded_by and not service._records[v2].superseded_by
                assert not service._records[v4].superseded_by and not service._records[v6].superseded_by
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            recorded = {v: await client.record_weights(v) for v in (v1, v2, v4, v6, v7)}
            assert (await waiting).manifest == recorded[v4].manifest
            assert all(r.manifest is not None and r.manifest.version == v and not r.superseded
                       for v, r in recorded.items())
            assert recorded[v2].manifest.spec.metadata[META_STATE] == "full"
            held = {p.name for p in (tmp_path / "w" / "versions").iterdir()}
            assert {v1, v2, v4, v6, v7} <= held and not {v3, v5} & held
            # A superseded version stays superseded (and answers at once).
            assert (await client.record_weights(v3)).superseded_by == v5
            # The record process is the trainer's own: killed, the next record starts another (and it records).
            worker = service._recorder._process
            worker.kill()
            worker.join(30)
            v8 = await step(8)
            assert (await client.record_weights(v8)).manifest.version == v8
            assert v8 in {p.name for p in (tmp_path / "w" / "versions").iterdir()}
    try:
        asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(60)
        if proc.stdout is not None:
            proc.stdout.close()
