"""`zerokl up` as a newcomer meets it, and what it refuses (issue 47, cases 3, 5 and 7), with real processes.

* What could not run as one exact cluster is refused before anything starts, naming the flag: a
  --trainer-flag or --replica-flag dtype that contradicts the fleet's; and the trainer follows
  --dtype (an fp32 checkpoint served in bf16 is trained in bf16: one fingerprint).
* A cluster answers only as itself: each start has an id every service advertises and up.json
  records; a second `zerokl up` on a taken port or a busy workdir fails at once, starting nothing;
  a client with no cluster to find says so (no default address), and one whose up.json names an
  address another cluster answers on refuses to send anything.
* With no model flag, `zerokl up` serves the shipped countdown SFT checkpoint, and the `zerokl
  generate` line it prints answers its countdown prompt.
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest
import torch
from test_scheduler_cli import _at_once, _lines, _read_until, _reap, _status

from zerokl.tasks.setup import SFT_CHECKPOINT
from zerokl.kernels import fingerprint
from zerokl.services.inference import InferenceClient
from zerokl.services.trainer.client import TrainerClient
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.tasks.countdown import Problem, reward

pytestmark = pytest.mark.timeout(300)

UP = [sys.executable, "-m", "zerokl", "up", "--threads", "1", "--grace", "2"]
# Client environments start clean: no server or cluster of the machine running the tests.
ENV = {k: v for k, v in os.environ.items() if not k.startswith("ZEROKL_")}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):  # noqa: ANN201
    """`zerokl up --dtype bfloat16` with no model flag; yields (workdir, services, what it printed)."""
    workdir = tmp_path_factory.mktemp("identity") / "up"
    proc = subprocess.Popen([*UP, "--workdir", str(workdir), "--port", "0", "--dtype", "bfloat16"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        out = "".join(_read_until(_lines(proc), "Ctrl-C stops all services.", 180))
        services = {s["name"]: s for s in json.loads((workdir / "up.json").read_text())["services"]}
        yield workdir, services, out
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        _reap(proc)


def _up_refused(workdir: pathlib.Path, *flags: str) -> str:
    """`zerokl up` that must refuse at once: its stderr (nothing started: no service, no log, a new workdir not
    even made)."""
    before = sorted(workdir.rglob("*")) if workdir.exists() else None
    run = subprocess.run([*UP, "--workdir", str(workdir), *flags], capture_output=True, text=True, timeout=60,
                         env=ENV)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "publishing" not in run.stdout and "services on loopback" not in run.stdout, run.stdout
    assert (sorted(workdir.rglob("*")) if workdir.exists() else None) == before
    return run.stderr


def _cli(workdir: pathlib.Path, *argv: str) -> subprocess.CompletedProcess:
    """A `zerokl` command with $ZEROKL_UP_DIR=workdir (and no other ZEROKL_ setting)."""
    return subprocess.run([sys.executable, "-m", "zerokl", *argv], capture_output=True, text=True, timeout=60,
                          env={**ENV, "ZEROKL_UP_DIR": str(workdir)})


def test_a_fleet_that_cannot_be_exact_is_refused_before_anything_starts(tmp_path) -> None:
    contradicts, mixed = _at_once(
        lambda: _up_refused(tmp_path / "a", "--port", "0", "--dtype", "bfloat16", "--trainer-flag=--dtype=float32"),
        # No --dtype: the replicas would serve the fp32 checkpoint in bf16 and the trainer train it in fp32.
        lambda: _up_refused(tmp_path / "b", "--port", "0", "--model", str(SFT_CHECKPOINT),
                            "--replica-flag=--dtype=bfloat16"))
    assert "--trainer-flag=--dtype=float32 contradicts --dtype bfloat16" in contradicts, contradicts
    assert "--replica-flag=--dtype=bfloat16: the replicas would compute in bfloat16, the trainer in float32" in mixed


def test_the_trainer_computes_in_the_fleets_dtype(fleet) -> None:  # noqa: ANN001
    workdir, services, _ = fleet
    code, report = _status(workdir, 60)
    assert code == 0, report
    # The checkpoint the fleet serves is stored in fp32 (the shipped one, as published); --dtype bfloat16 puts
    # the replicas and the trainer on bf16 alike: one fingerprint.
    assert json.loads((workdir / "weights" / "versions" / "1" / "config.json").read_text())["dtype"] == "float32"
    assert report["fingerprints"] == [fingerprint(dtype=torch.bfloat16)], report

    async def dtypes() -> tuple[str, str]:
        async with TrainerClient(services["trainer"]["address"]) as trainer, \
                InferenceClient(services["decode-0"]["address"]) as decode:
            return (await trainer.info()).dtype, (await decode.info()).dtype
    assert asyncio.run(dtypes()) == ("bfloat16", "bfloat16")


def test_zerokl_up_serves_the_shipped_sft_checkpoint_and_its_example_answers(fleet) -> None:  # noqa: ANN001
    workdir, services, out = fleet
    assert "publishing the shipped countdown SFT checkpoint" in out, out
    [line] = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("zerokl generate ")]
    # The line as a user pastes it into bash (its prompt ends in a newline, as the task's prompts do).
    bin_dir = pathlib.Path(sys.executable).parent
    run = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60,
                         env={**ENV, "PATH": f"{bin_dir}:{ENV.get('PATH', '')}"})
    assert run.returncode == 0, run.stderr
    numbers, target = re.search(r"nums ([\d ]+) target (\d+)", line).groups()  # type: ignore[union-attr]
    problem = Problem(tuple(map(int, numbers.split())), int(target), "")
    assert reward(run.stdout, problem) == 1.0, (line, run.stdout)


def test_each_service_advertises_the_cluster_up_json_names(fleet) -> None:  # noqa: ANN001
    workdir, services, _ = fleet
    cluster = json.loads((workdir / "up.json").read_text())["cluster_id"]
    assert re.fullmatch(r"[0-9a-f]{16}", cluster)

    async def ids() -> set[str]:
        async with InferenceClient(services["scheduler"]["address"]) as scheduler, \
                InferenceClient(services["decode-0"]["address"]) as decode, \
                TrainerClient(services["trainer"]["address"]) as trainer, \
                WeightStoreClient(services["weight-store"]["address"]) as store:
            return {(await c.info()).cluster_id for c in (scheduler, decode, trainer, store)}
    assert asyncio.run(ids()) == {cluster}
    assert _status(workdir)[1]["cluster_id"] == cluster


def test_a_second_cluster_on_a_taken_port_or_a_busy_workdir_fails_at_once(fleet, tmp_path) -> None:  # noqa: ANN001
    workdir, services, _ = fleet
    port = services["scheduler"]["address"].rsplit(":", 1)[1]
    taken, busy = _at_once(lambda: _up_refused(tmp_path / "second", "--port", port),
                           lambda: _up_refused(workdir, "--port", "0"))
    assert f"--port {port}: 127.0.0.1:{port} is taken" in taken and "--port 0" in taken, taken
    assert f"another `zerokl up` (pid {json.loads((workdir / 'up.json').read_text())['pid']}) runs in" in busy, busy
    assert _status(workdir)[0] == 0                  # the first cluster never noticed


def test_clients_never_talk_to_another_cluster_without_saying_so(fleet, tmp_path) -> None:  # noqa: ANN001
    workdir, services, _ = fleet
    # An up.json whose scheduler address another cluster answers on (here: this one, under another id).
    state = json.loads((workdir / "up.json").read_text())
    other, nothing = tmp_path / "other", tmp_path / "nothing"
    other.mkdir()
    (other / "up.json").write_text(json.dumps({**state, "pid": os.getpid(), "cluster_id": "0123456789abcdef"}))
    generate = ["generate", "--prompt-ids", "3,4", "--max-tokens", "2"]
    *lost, status, explicit = _at_once(
        *(lambda d=d, argv=argv: _cli(d, *argv) for d in (nothing, other) for argv in (generate, ["jobs", "list"])),
        lambda: _cli(other, "status", "--workdir", str(other)),
        # Named explicitly, a server is the user's choice.
        lambda: _cli(nothing, *generate, "--server", services["scheduler"]["address"]))
    # No cluster to find: no silent default address.
    for run in lost[:2]:
        assert run.returncode != 0 and "no `zerokl up` runs in" in run.stderr and "--server" in run.stderr, run
    for run in lost[2:]:
        assert run.returncode != 0, run
        assert f"answers as cluster {state['cluster_id']}, not as the `zerokl up` in {other}" in run.stderr, run
    assert status.returncode == 1 and "OTHER CLUSTER" in status.stdout, status
    assert explicit.returncode == 0, explicit.stderr
