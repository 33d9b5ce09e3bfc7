"""`zerokl jobs` as a newcomer meets it, against one real `zerokl up` fleet (tiny, loopback).

Every command here is its own `python -m zerokl` process finding the fleet through its up.json
($ZEROKL_UP_DIR). What is checked is what a person reads: the hyperparameters a job trains with
(the trainer's default lr included), step lines whose metrics come in one fixed order with the
telling ones first, a job list with a header and aligned columns, a finished job's watch saying
how it ended once, at the end, and a closed stdout (`| head`) ending a command without a traceback.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)

# Small: 2 GRPO steps of 2 prompts x 2 samples, a greedy evaluation at step 2 on 4 test problems.
RL_JOB = ("submit", "rl", "--steps", "2", "--prompts", "2", "--group", "2", "--eval-every", "2",
          "--train-problems", "300", "--test-problems", "4", "--name", "newcomer")
# The order a step line's metrics come in (a kind shows those it has): healthy or not first.
HEADLINE = ("reward", "kl", "clip_fraction", "mismatched_tokens", "test_accuracy", "loss", "preference_accuracy",
            "grad_norm", "lr", "tokens_per_s")
SFT_JOB = ("submit", "sft", "--steps", "1", "--batch-size", "2", "--train-problems", "300", "--test-problems", "4")
# The synthetic reward any policy earns some of, with answers of exactly --max-tokens.
VOWEL_JOB = ("submit", "rl", "--steps", "1", "--prompts", "2", "--group", "2", "--eval-every", "0", "--reward",
             "vowel_share", "--ignore-eos", "--max-tokens", "8", "--train-problems", "300", "--test-problems", "4",
             "--json")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, zerokl_up):  # noqa: ANN001, ANN201
    """A default `zerokl up` (the trainer's own hyperparameters: lr 1e-3) with one finished RL job, one
    finished SFT job and one finished RL job on the vowel_share reward; yields (the environment that finds it,
    the RL job's submit output, the vowel_share job's JSON lines)."""
    workdir = tmp_path_factory.mktemp("jobs-cli-up")
    with zerokl_up(workdir):
        env = {**os.environ, "ZEROKL_UP_DIR": str(workdir)}
        rl = _zerokl(env, "jobs", *RL_JOB)
        assert rl.returncode == 0, rl.stdout + rl.stderr
        sft = _zerokl(env, "jobs", *SFT_JOB)
        assert sft.returncode == 0, sft.stdout + sft.stderr
        vowel = _zerokl(env, "jobs", *VOWEL_JOB)
        assert vowel.returncode == 0, vowel.stdout + vowel.stderr
        yield env, rl.stdout, [json.loads(line) for line in vowel.stdout.splitlines()]


def _zerokl(env: dict, *argv: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerokl", *argv], env=env, stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=300)


def _job_id(submit_stdout: str) -> str:
    return re.match(r"job (\S+) queued", submit_stdout).group(1)


def _metric_names(step_line: str) -> list[str]:
    """The metric names of a step line, in order (`step 2/2 [published V] name value name value ...`)."""
    words = step_line.split()[2:]
    if words[:1] == ["published"]:
        words = words[2:]
    return words[0::2]


def test_a_submitted_rl_job_shows_its_hyperparameters_and_steps_in_a_fixed_order(fleet) -> None:
    """Before: the lr the job trained with (the trainer's 1e-3) was nowhere, and each step printed ~25
    metrics in the protobuf map's order, kl somewhere in the middle."""
    _, out, _ = fleet
    lines = out.splitlines()
    assert "2 prompts x 2 samples a step" in lines[0] and "lr: the trainer's" in lines[0], lines[0]
    hyper = [line for line in lines if line.startswith("hyperparameters: ")]
    assert len(hyper) == 1 and hyper[0].startswith("hyperparameters: lr 0.001 betas 0.9,0.95 "), hyper
    assert "clip_eps 0.2" in hyper[0] and "kl_coef 0" in hyper[0], hyper[0]
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 2 and lines.index(hyper[0]) < lines.index(steps[0])
    first, last = (_metric_names(s) for s in steps)
    assert first == ["reward", "kl", "clip_fraction", "mismatched_tokens", "loss", "grad_norm", "lr", "tokens_per_s"]
    assert last == first[:4] + ["test_accuracy"] + first[4:]             # the evaluation step adds its accuracy
    assert " kl 0.0 clip_fraction 0 mismatched_tokens 0 " in steps[0] and " lr 0.001 " in steps[0], steps[0]


def test_watch_verbose_adds_every_other_metric_in_alphabetical_order_and_json_has_them_all(fleet) -> None:
    env, out, _ = fleet
    job = _job_id(out)
    verbose = _zerokl(env, "jobs", "watch", job, "--verbose")
    assert verbose.returncode == 0, verbose.stderr
    step = [line for line in verbose.stdout.splitlines() if line.startswith("step 2/2")][0]
    names = _metric_names(step)
    headline = [n for n in HEADLINE if n in names]
    rest = names[len(headline):]
    assert names[:len(headline)] == headline and rest == sorted(rest), names
    assert {"rollout_s", "train_s", "sync_s", "ratio_min", "ratio_max", "tokens"} <= set(rest), rest
    as_json = _zerokl(env, "jobs", "watch", job, "--json")
    events = [json.loads(line) for line in as_json.stdout.splitlines()]
    last_step = [e for e in events if e["step"] == 2][0]
    assert set(last_step["metrics"]) == set(names) and list(last_step["metrics"]) == sorted(names)
    assert last_step["train_config"]["lr"] == 0.001


def test_watching_a_finished_job_says_how_it_ended_once_at_the_end(fleet) -> None:
    """Before: `job ID succeeded` came first, then the steps, then `job ID succeeded` again."""
    env, out, _ = fleet
    job = _job_id(out)
    r = _zerokl(env, "jobs", "watch", job)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line for line in lines if "succeeded" in line] == [f"job {job} succeeded"] == lines[-1:], lines
    assert lines[0].startswith("hyperparameters: lr 0.001 ") and lines[1].startswith("step 1/2 "), lines
    # The job's own submit output ended the same way.
    assert [line for line in out.splitlines() if "succeeded" in line] == [f"job {job} succeeded"]


def test_the_job_list_has_a_header_and_aligned_columns(fleet) -> None:
    """Before: no header, and each row's columns started where its own earlier cells happened to end."""
    env, out, _ = fleet
    r = _zerokl(env, "jobs", "list")
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.splitlines()
    assert header.split() == ["JOB", "KIND", "STATE", "STEP", "VERSION", "NAME"]
    assert len(rows) == 3 and rows[0].startswith(_job_id(out))
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    for row in rows:
        assert [m.start() for m in re.finditer(r"\S+", row)] == starts, (header, row)
    assert rows[0].split()[1:5] == ["rl", "succeeded", "2/2", "default-step000002"]
    assert rows[0].split()[5] == "newcomer" and rows[1].split()[1:4] == ["sft", "succeeded", "1/1"]


def test_an_rl_job_on_the_vowel_share_reward_samples_answers_of_max_tokens(fleet) -> None:
    """`--reward vowel_share` (was only on the Jobs API): every answer earns some reward, so the step moves the
    weights, and with --ignore-eos each of the 4 answers is exactly 8 tokens."""
    _, _, events = fleet
    assert events[-1]["state"] == "succeeded", events[-1]
    [step] = [e for e in events if e.get("step") == 1]
    m = step["metrics"]
    assert m["reward"] > 0.0 and m["grad_norm"] > 0.0 and m["kl"] == 0.0, m
    assert m["tokens"] == 4 * 8, m


@pytest.mark.parametrize("argv", [("jobs", "watch", "{job}"), ("jobs", "watch", "{job}", "--json"), ("jobs", "list"),
                                  ("status",), ("generate", "--prompt-ids", "5,6,7", "--max-tokens", "4")])
def test_a_reader_that_closes_stdout_ends_the_command_quietly(fleet, argv) -> None:
    """`zerokl jobs watch ID | head`: the reader is gone before the command writes. Before: a
    BrokenPipeError traceback (and "Exception ignored ... BrokenPipeError" at exit); now the command ends
    as `seq 1000 | head` ends seq: no traceback, the status of a process killed by SIGPIPE (141)."""
    env, out, _ = fleet
    argv = [a.format(job=_job_id(out)) for a in argv]
    read, write = os.pipe()
    os.close(read)                                        # nobody will read: the first write fails
    try:
        r = _zerokl(env, *argv, stdout=write)
    finally:
        os.close(write)
    assert r.returncode == 141, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def test_zerokl_jobs_starts_without_torch() -> None:
    """A client runs no kernel: `zerokl jobs` (the job specs, the Jobs API's converters, TrainConfig) imports neither
    torch nor the numerics library, so it starts in about a second instead of the ~3 s torch's import took."""
    program = ("import sys; from zerokl.cli import main; "
               "rc = main(['jobs', '--server', '127.0.0.1:1', 'submit', 'rl', '--steps', '1', '--detach']); "
               "print(rc, 'torch' in sys.modules, 'zerokl.kernels' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    *said, last = run.stdout.splitlines()
    rc, torch_loaded, kernels_loaded = last.split()
    assert rc != "0" and "UNAVAILABLE" in "".join(said)   # nothing listens there: it got as far as connecting
    assert (torch_loaded, kernels_loaded) == ("False", "False"), run.stdout + run.stderr
