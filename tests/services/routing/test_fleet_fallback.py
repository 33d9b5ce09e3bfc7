"""What `zerokl status` judges, and a corrupt served version, on a real `zerokl up` fleet (issue 47, cases 2 and 6).

* After an operator switches the fleet back to an older version, the serving fleet (replicas,
  scheduler) serves one version and `zerokl status --wait` succeeds: the trainer's own version
  (ahead, where the job left it) is shown apart, not counted against the fleet.
* One corrupt byte in the store's copy of the version the fleet serves, then SIGKILL of its only
  decode replica: the replica comes back by itself at the most recently served good version, the
  scheduler moves the fleet there and records why, `zerokl status` says so (DATA_LOSS, the
  fallback), Generate works, and an operator's SwitchWeights to a good version works.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from test_fleet_heal import EXAMPLES, _events, _kill, _service
from test_scheduler_cli import _status

from zerokl.services.inference import InferenceClient
from zerokl.services.jobs.types import JobState, SFTJobSpec
from zerokl.services.jobs.service import JobsClient
from zerokl.services.weightstore.client import WeightStoreClient

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, zerokl_up):  # noqa: ANN001, ANN201
    """`zerokl up` (tiny preset) with restarts after 0.2 s; yields (workdir, services)."""
    workdir = tmp_path_factory.mktemp("fallback") / "up"
    with zerokl_up(workdir, "--trainer-flag=--lr=3e-3", "--restart-backoff", "0.2") as services:
        yield workdir, services


def _sft(scheduler: str, steps: int, seed: int) -> str:
    """Run an SFT job through the scheduler; the version it left the fleet on."""
    async def main() -> str:
        async with JobsClient(scheduler) as jobs:
            done = await _events(jobs, SFTJobSpec(steps=steps, examples=EXAMPLES, batch_size=4, seed=seed), "sft")
        assert done[-1].status.state is JobState.SUCCEEDED, done[-1].status.error
        return done[-1].status.weights_version
    return asyncio.run(main())


def _switch(scheduler: str, version: str) -> str:
    """An operator's SwitchWeights through the scheduler; the version the fleet serves after it."""
    async def main() -> str:
        async with InferenceClient(scheduler) as inference:
            return (await inference.switch_weights(version)).weights_version
    return asyncio.run(main())


async def _parent(store: str, version: str) -> str:
    async with WeightStoreClient(store) as weights:
        return (await weights.manifest(version)).spec.parent_version


def _status_text(workdir) -> str:  # noqa: ANN001
    run = subprocess.run([sys.executable, "-m", "zerokl", "status", "--workdir", str(workdir)],
                         capture_output=True, text=True, timeout=60)
    return run.stdout


def test_status_judges_the_serving_fleet_after_a_switch_back(fleet) -> None:  # noqa: ANN001
    workdir, services = fleet
    scheduler = services["scheduler"]["address"]
    trained = _sft(scheduler, 1, seed=1)
    assert trained != "1"
    assert _switch(scheduler, "1") == "1"
    code, report = _status(workdir, 60)
    assert code == 0, report
    assert report["weights_versions"] == ["1"] and report["trainer_weights_version"] == trained, report
    assert f"OK: 4/4 serving, fingerprints {report['fingerprints']}, weights versions ['1'] (trainer at {trained})" \
        in _status_text(workdir)


def test_a_corrupt_served_version_makes_the_fleet_fall_back_by_itself(fleet) -> None:  # noqa: ANN001
    workdir, services = fleet
    scheduler = services["scheduler"]["address"]
    served = _sft(scheduler, 2, seed=2)
    # The job started the fleet on the trainer's version (the last test's job), then switched it to `served`.
    previous = asyncio.run(_parent(services["weight-store"]["address"], served))
    shard = workdir / "weights" / "versions" / served / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    killed = _kill(workdir, "decode-0")

    # Nobody acts: the fleet serves again, on the good version before the corrupt one.
    code, report = _status(workdir, 120)
    assert code == 0, report
    assert report["weights_versions"] == [previous], report
    row = next(r for r in report["services"] if r["name"] == "decode-0")
    assert row["restarts"] == 1 and row["last_exit"] == -9 and row["weights_version"] == previous, row
    assert "DATA_LOSS" in row["note"] and served in row["note"], row
    assert "DATA_LOSS" in report["fleet_note"] and f"fell back to {previous}" in report["fleet_note"], report
    text = _status_text(workdir)
    assert f"fleet: weights version {served} is corrupt" in text and "decode-0: restarted at weights version" in text
    assert _service(workdir, "decode-0")["pid"] != killed["pid"]
    # The record keeps the corrupt version from being served again, by a restart or a new `zerokl up`.
    record = json.loads((workdir / "scheduler" / "fleet.json").read_text())
    assert record["weights_version"] == previous and served not in record["good"], record
    assert record["good"][-1] == previous, record

    # Clients are served (the command line finds the cluster through up.json), and an operator's switch works.
    run = subprocess.run([sys.executable, "-m", "zerokl", "generate", "--prompt-ids", "3,4,5", "--max-tokens", "4",
                          "--json"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "ZEROKL_UP_DIR": str(workdir)})
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["weights_version"] == previous
    assert _switch(scheduler, "1") == "1"
    code, report = _status(workdir, 60)
    assert code == 0 and report["weights_versions"] == ["1"] and report["fleet_note"] == "", report
