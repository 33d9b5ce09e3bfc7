"""The trainer service over real loopback gRPC: exact parity with the in-process Trainer, checkpoints
as weight-store versions, resume after SIGKILL (bitwise), staleness, bad input.

Every parity claim is exact: torch.equal on fp32 logprobs and weights, == on the metrics.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import pathlib
import random
import signal
import shutil
import subprocess
import sys
import typing
import urllib.request
from typing import AsyncIterator, Awaitable, Iterator, Sequence

import grpc
import grpc.aio
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from zerokl.kernels import __version__ as numerics_version
from zerokl.kernels import fingerprint
from zerokl.kernels.model import Model, ModelConfig
from zerokl.kernels.model.checkpoint import config_to_hf
from zerokl.services.runtime import ServiceIdentity, ServiceServer, field_violations, status_details
from zerokl.services.trainer.checkpointing import STATE_JSON, STATE_TENSORS
from zerokl.services.trainer import convert
from zerokl.services.trainer.client import TrainerClient
from zerokl.services.trainer.checkpointing import open_repo
from zerokl.services.trainer.server import build_parser, start_trainer, train_config_from_args
from zerokl.services.trainer.service import TRAINER_SERVICE, TrainerService, add_trainer_service
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import Trainer
from zerokl.services.trainer.types import PPOBatch
from zerokl.services.weightstore import LocalDirBackend, VersionStore
from zerokl.services.weightstore.service import add_weight_store
from zerokl.v1 import trainer_pb2, trainer_pb2_grpc
from zerokl.vocab import Completion, InvalidOption, Rollout

from conftest import below_16, engine_rollouts

TINY = ModelConfig.preset("tiny")
INIT = "preset-tiny-seed0"                  # the weights version of --init preset:tiny:seed0
INVALID = grpc.StatusCode.INVALID_ARGUMENT
FAILED = grpc.StatusCode.FAILED_PRECONDITION


# ----------------------------------------------------------------------------- helpers

def _prompts(k: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, 64) for _ in range(rng.randint(4, 30))) for _ in range(k)]


def _sft_data(seed: int = 0) -> list[Completion]:
    return [Completion(p, (7, 8, 9, 10, 11)) for p in _prompts(4, seed)]


def _flags(config: TrainConfig) -> list[str]:
    """Command-line flags giving ``config`` (the fields these tests vary)."""
    return ["--lr", repr(config.lr), "--warmup-steps", str(config.warmup_steps), "--total-steps",
            str(config.total_steps), "--lora-rank", str(config.lora_rank), "--kl-coef", repr(config.kl_coef),
            "--dpo-beta", repr(config.dpo_beta)]


def _reference(config: TrainConfig) -> Trainer:
    """The in-process trainer the service must match (--init preset:tiny:seed0)."""
    return Trainer(Model(TINY, seed=0), config)


def _rollouts(trainer: Trainer, prompts: Sequence[tuple[int, ...]], version: str, seed: int = 0,
              top_p: float = 0.9) -> list[Rollout]:
    """Four engine samples of each prompt on the trainer's serving weights, rewarded by `below_16`;
    the rewards must differ, or the advantages are all zero.

    With a KL reference use top_p 1: a sampled token outside the reference's own
    nucleus has reference logprob -inf, and the k3 penalty is then inf on both sides.
    """
    rollouts = engine_rollouts(trainer.serving_model(), prompts, below_16, n=4, top_p=top_p, seed=seed, version=version)
    assert len({r.reward for r in rollouts}) > 1
    return rollouts


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


@contextlib.asynccontextmanager
async def trainer_server(store: pathlib.Path | str, *flags: str) -> AsyncIterator[tuple[TrainerClient, TrainerService]]:
    """The trainer as `zerokl serve trainer` builds it (same flags, same start-up), on a loopback port.

    ``store``: a local version directory (a path), or a weight-store service's address (a string).
    """
    where = ["--weights-dir", str(store)] if isinstance(store, pathlib.Path) else ["--weight-store", store]
    args = build_parser().parse_args([*where, "--port", "0", *flags])
    repo = await open_repo(args)
    service = (await start_trainer(args, repo)).service
    server = ServiceServer("trainer")
    add_trainer_service(server, service)
    await server.start()
    try:
        async with TrainerClient(server.address) as client:
            yield client, service
    finally:
        await server.drain(0)
        await service.close()


async def _status(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    try:
        await call
    except grpc.aio.AioRpcError as err:
        return err
    raise AssertionError("the call succeeded")


def _fields(err: grpc.aio.AioRpcError) -> list[str]:
    return [v.field for v in field_violations(err)]


def _preconditions(err: grpc.aio.AioRpcError) -> list[tuple[str, str]]:
    return [(v.type, v.subject) for d in status_details(err) if isinstance(d, error_details_pb2.PreconditionFailure)
            for v in d.violations]


# ----------------------------------------------------------------------------- flags

def _non_default(name: str, tp, default):
    """A value other than ``default`` for a field of type ``tp`` (generated, so a new field is covered)."""
    if tp is bool:
        return not default
    if typing.get_origin(tp) is typing.Literal:
        return next(c for c in typing.get_args(tp) if c != default)
    literal = [a for a in typing.get_args(tp) if typing.get_origin(a) is typing.Literal]
    if literal and type(None) in typing.get_args(tp):                    # Literal[...] | None
        return next(c for c in typing.get_args(literal[0]) if c != default)
    if set(typing.get_args(tp)) == {bool, type(None)}:
        return False if default is not False else True
    if typing.get_origin(tp) is tuple:
        return tuple(v / 2 for v in default)
    if tp is int:
        return default + 3
    if tp is float:
        return default / 2 + 0.25
    raise AssertionError(f"TrainConfig.{name}: no test value for {tp}: teach _non_default (and the flags) its type")


def _every_field_changed() -> TrainConfig:
    hints, defaults = typing.get_type_hints(TrainConfig), TrainConfig()
    return TrainConfig(**{f.name: _non_default(f.name, hints[f.name], getattr(defaults, f.name))
                          for f in dataclasses.fields(TrainConfig)})


def _flags_for(config: TrainConfig) -> list[str]:
    hints, out = typing.get_type_hints(TrainConfig), []
    for f in dataclasses.fields(TrainConfig):
        flag, v = "--" + f.name.replace("_", "-"), getattr(config, f.name)
        if hints[f.name] is bool:
            out.append(flag if v else "--no-" + flag[2:])
        elif isinstance(v, tuple):
            out += [flag, *map(repr, v)]
        elif v is None or isinstance(v, bool):
            out += [flag, {None: "auto", True: "on", False: "off"}[v]]
        else:
            out += [flag, str(v) if isinstance(v, str) else repr(v)]
    return out


def test_every_train_config_field_has_a_flag() -> None:
    """`zerokl serve trainer` reaches every TrainConfig field (the flags are generated from the
    dataclass): flags giving a non-default value for each field build exactly that TrainConfig,
    and no flags build the defaults. A field whose type has no flag fails here."""
    want, defaults = _every_field_changed(), TrainConfig()
    assert [f.name for f in dataclasses.fields(TrainConfig) if getattr(want, f.name) == getattr(defaults, f.name)] == []
    assert train_config_from_args(build_parser().parse_args(_flags_for(want))) == want
    assert train_config_from_args(build_parser().parse_args([])) == defaults
    assert train_config_from_args(build_parser().parse_args(["--master-weights", "on"])).master_weights is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--master-weights", "sometimes"])
    helps = {a.dest: a.help for a in build_parser()._actions}
    assert all(helps[f.name] and not helps[f.name].startswith("(default") for f in dataclasses.fields(TrainConfig)), \
        "every TrainConfig field needs a comment (its flag's help)"


def test_every_train_config_field_crosses_the_trainer_and_jobs_apis() -> None:
    """zerokl.v1.TrainConfig carries every TrainConfig field (GetState reports it, LoadWeights and a
    job's JobSpec.train_config set it): round trips are exact, and no proto field is unread."""
    from zerokl.services.jobs.types import DPOJobSpec, RLJobSpec, SFTJobSpec
    from zerokl.services.jobs.service import spec_from_proto, spec_to_proto
    from zerokl.services.trainer import convert
    from zerokl.vocab import Completion
    want = _every_field_changed()
    for config in (want, TrainConfig(), TrainConfig(master_weights=True)):
        assert convert.train_config_from_proto(convert.train_config_to_proto(config)) == config
    proto_fields = set(convert.trainer_pb2.TrainConfig.DESCRIPTOR.fields_by_name)
    wired = {f.name for f in dataclasses.fields(TrainConfig)} - {"betas"} | {"beta1", "beta2"}
    assert proto_fields == wired
    pair = (Completion((1, 2), (3,)), Completion((1, 2), (4,)))
    for spec in (SFTJobSpec(steps=2, train_config=want), DPOJobSpec(steps=1, pairs=(pair,), train_config=want),
                 RLJobSpec(steps=3, train_config=want), RLJobSpec(steps=3)):
        assert spec_from_proto(spec_to_proto(spec)) == spec


# ----------------------------------------------------------------------------- parity

def test_forward_logprobs_over_grpc_are_bitwise_the_trainers(tmp_path: pathlib.Path) -> None:
    reference = _reference(TrainConfig())
    prompts = _prompts(5, 1)
    completions = [Completion(prompts[0], (5, 9, 33)),                         # defaults: temperature 1
                   Completion(prompts[1], (3, 4, 5, 6), temperature=0.0),      # greedy: plain log-softmax
                   Completion(prompts[2], (40, 41), temperature=0.7, top_p=0.9),
                   Completion(prompts[3], (12,), temperature=1.3, top_k=5),
                   Completion(prompts[4], tuple(range(3, 40)), temperature=0.5, top_k=8, top_p=0.8)]
    want = reference.forward_logprobs(completions)

    async def main() -> None:
        async with trainer_server(tmp_path / "w") as (client, _):
            got = await client.forward_logprobs(completions)
            alone = [(await client.forward_logprobs([c]))[0] for c in completions[::2]]
            info = await client.info()
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == torch.float32 and torch.equal(g, w)
        for g, w in zip(alone, want[::2], strict=True):  # batch neighbours do not change the bits
            assert torch.equal(g, w)
        assert (info.service, info.weights_version, info.numerics_fingerprint) == ("trainer", INIT, fingerprint())
    asyncio.run(main())


@pytest.mark.parametrize("lora", [0, 4])
def test_sft_dpo_grpo_steps_over_grpc_give_bitwise_the_in_process_weights(tmp_path: pathlib.Path, lora: int) -> None:
    config = TrainConfig(lr=3e-3, warmup_steps=1, total_steps=5, lora_rank=lora, kl_coef=0.05 if lora else 0.0)
    reference = _reference(config)
    sft = _sft_data(2)
    pairs = [(Completion(p, (7, 7, 7)), Completion(p, (9, 9, 9))) for p in _prompts(3, 3)]

    async def main() -> None:
        async with trainer_server(tmp_path / "w", *_flags(config)) as (client, service):
            # SFT, then DPO: ForwardBackward + OptimStep over the wire vs the in-process steps; the
            # DPO step overrides the schedule's learning rate (OptimStepRequest.lr).
            for method, items, lr in (("sft", sft, None), ("dpo", pairs, 1e-3)):
                fb = await client.forward_backward(method, items)
                opt = await client.optim_step(lr=lr)
                want = reference.forward_backward(method, items) | reference.optim_step(lr)
                assert (fb.method, fb.loss, fb.tokens, opt.grad_norm, opt.lr, opt.step) == \
                    (method, want["loss"], want["tokens"], want["grad_norm"], want["lr"], want["step"])
                assert opt.lr == (lr or reference.lr_at(opt.step - 1))
            # GRPO on real engine rollouts of the current (published) weights: KL exactly 0.
            manifest, created = await client.save_weights()
            assert created and manifest.version == "default-step000002"
            rollouts = _rollouts(reference, _prompts(2, 5), manifest.version, top_p=1.0 if lora else 0.9)
            fb, opt = await client.grpo_step(rollouts, group_size=4)
            want = reference.grpo_step(rollouts, group_size=4)
            assert fb.ppo is not None
            assert (fb.ppo.kl, fb.ppo.mismatched_tokens, fb.ppo.clip_fraction, fb.ppo.ratio_min, fb.ppo.ratio_max) \
                == (0.0, 0, 0.0, 1.0, 1.0)
            assert math.isfinite(fb.loss)
            assert (fb.loss, fb.ppo.kl_reference, fb.ppo.reward_mean, fb.tokens) == \
                (want["loss"], want["kl_reference"], want["reward"], want["tokens"])
            assert (fb.ppo.stale_rollouts, fb.ppo.max_staleness, fb.metrics["kl"]) == (0, 0, 0.0)
            assert (opt.grad_norm, opt.step) == (want["grad_norm"], want["step"])
            _assert_same_weights(service.trainer.model.state_dict(), reference.model.state_dict())
            # What the next version serves is bitwise the in-process trainer's serving weights.
            manifest, _ = await client.save_weights()
            served = Model.from_pretrained(tmp_path / "w" / "versions" / manifest.version)
            _assert_same_weights(served.state_dict(), reference.serving_state_dict())
    asyncio.run(main())


def test_calls_run_one_at_a_time_in_arrival_order_and_a_timed_out_call_still_completes(tmp_path: pathlib.Path) -> None:
    """A client whose deadline passes does not interrupt an update half-way: the work it queued runs, in order,
    and GetState shows it. Gradients accumulate in arrival order (the sum order decides the bits)."""
    slow = [Completion(tuple([5] * 250), tuple([7] * 50)) for _ in range(3)]     # about a second of work
    small = _sft_data(4)
    reference = _reference(TrainConfig())
    logprobs_before = reference.forward_logprobs(small)
    reference.forward_backward("sft", slow)
    reference.forward_backward("sft", small)
    want = reference.optim_step()

    async def main() -> None:
        async with trainer_server(tmp_path / "w") as (client, _):
            first = asyncio.ensure_future(client.forward_backward("sft", slow))
            await asyncio.sleep(0.05)
            logprobs = asyncio.ensure_future(client.forward_logprobs(small))
            await asyncio.sleep(0.05)
            err = await _status(client.forward_backward("sft", small, timeout=0.3))
            assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert (await first).accumulated_batches == 1
            for got, w in zip(await logprobs, logprobs_before, strict=True):    # ran before any step
                assert torch.equal(got, w)
            state = await client.get_state()
            assert (state.accumulated_batches, state.tokens_seen) == (2, 3 * 50 + 4 * 5)
            opt = await client.optim_step()
            assert (opt.grad_norm, opt.step) == (want["grad_norm"], 1)
    asyncio.run(main())


# ----------------------------------------------------------------------------- checkpoints

def test_save_weights_publishes_a_version_with_manifest_and_state(tmp_path: pathlib.Path) -> None:
    config = TrainConfig(lr=3e-3, lora_rank=4)
    reference = _reference(config)
    data = _sft_data(5)
    reference.sft_step(data)

    async def main() -> None:
        async with trainer_server(tmp_path / "w", *_flags(config), "--run", "job") as (client, _):
            await client.forward_backward("sft", data)
            err = await _status(client.save_weights())     # gradients pending: not a step boundary
            assert err.code() is FAILED and "OptimStep" in (err.details() or "")
            await client.optim_step()
            manifest, created = await client.save_weights(metadata={"note": "first"})
            assert created and manifest.version == "job-step000001"
            spec = manifest.spec
            assert (spec.parent_version, spec.step, spec.numerics_version, spec.numerics_fingerprint) == \
                (INIT, 1, numerics_version, fingerprint())
            assert spec.model_config == config_to_hf(TINY, torch.float32)
            assert spec.metadata == {"note": "first", "zerokl.run": "job", "zerokl.trainer_state": "full"}
            assert {s.name for s in manifest.shards} == {"config.json", "model.safetensors", STATE_JSON, STATE_TENSORS}
            version_dir = tmp_path / "w" / "versions" / manifest.version
            assert json.loads((version_dir / STATE_JSON).read_text())["lineage"] == [[INIT, 0], ["job-step000001", 1]]
            _assert_same_weights(Model.from_pretrained(version_dir).state_dict(), reference.serving_state_dict())
            assert (await client.info()).weights_version == "job-step000001"
            # The same checkpoint again (a retried call): the existing version, byte for byte.
            again, created = await client.save_weights()
            assert (again, created) == (manifest, False)
            # A serving-only version: no trainer state, its parent is the previous version.
            light, _ = await client.save_weights("job-light", weights_only=True)
            assert light.spec.parent_version == "job-step000001"
            assert {s.name for s in light.shards} == {"config.json", "model.safetensors"}
            err = await _status(client.load_weights("job-light", restore_state=True))
            assert err.code() is FAILED and "no trainer state" in (err.details() or "")
            assert (await _status(client.save_weights(metadata={"zerokl.run": "x"}))).code() is INVALID
            # LoadWeights restores the state exactly; without state, the weights become a fresh base.
            await client.forward_backward("sft", data)
            await client.optim_step()
            state = await client.load_weights("job-step000001", restore_state=True)
            assert (state.step, state.weights_version, state.weights_step, state.accumulated_batches) == \
                (1, "job-step000001", 1, 0)
            assert state.config == config
            step2 = await client.forward_backward("sft", data), await client.optim_step()
            want = reference.sft_step(data)
            assert (step2[0].loss, step2[1].grad_norm) == (want["loss"], want["grad_norm"])
            fresh = await client.load_weights("job-light")
            assert (fresh.step, fresh.weights_version, fresh.tokens_seen) == (0, "job-light", 0)
            # A fresh trainer with other hyperparameters (what a job's train_config does)
            other = dataclasses.replace(config, lr=config.lr / 2, activation_checkpointing=True, master_weights=False)
            assert (await client.load_weights("job-light", config=other)).config == other
            assert (await client.get_state()).config == other
            assert (await _status(client.load_weights("no-such-version"))).code() is grpc.StatusCode.NOT_FOUND
            # Its steps publish under the run's next segment: job-step000001 is already the first one's step 1.
            await client.forward_backward("sft", data)
            await client.optim_step()
            second, created = await client.save_weights()
            assert created and second.version == "job.2-step000001"
            assert second.spec.metadata["zerokl.run"] == "job.2"

        # A restart resumes the run's newest segment (job.2 at step 1), not the highest step of any segment.
        async with trainer_server(tmp_path / "w", "--run", "job") as (client, _):
            state = await client.get_state()
            assert (state.step, state.weights_version, state.config) == (1, "job.2-step000001", other)
            await client.forward_backward("sft", data)
            await client.optim_step()
            assert (await client.save_weights())[0].version == "job.2-step000002"

        # A new trainer started from a published version (--init VERSION) serves exactly its weights.
        async with trainer_server(tmp_path / "w", "--run", "other", "--init", "job-step000001") as (client, svc):
            state = await client.get_state()
            assert (state.run, state.step, state.weights_version) == ("other", 0, "job-step000001")
            _assert_same_weights(svc.trainer.serving_state_dict(), Model.from_pretrained(version_dir).state_dict())
    asyncio.run(main())


def test_checkpoints_through_a_weight_store_service_pinned_against_retention(tmp_path: pathlib.Path) -> None:
    data = _sft_data(3)
    probe = [Completion(p, (9, 10, 11)) for p in _prompts(3, 11)]

    async def main() -> None:
        store = VersionStore(LocalDirBackend(tmp_path / "store"), keep_last=1)
        weight_store = ServiceServer("weight-store")
        add_weight_store(weight_store, store, ServiceIdentity("weight-store", "ws-test"), watch_poll_s=0.2)
        await weight_store.start()
        try:
            async with trainer_server(weight_store.address, "--run", "remote") as (client, _):
                for _ in range(2):
                    await client.forward_backward("sft", data)
                    await client.optim_step()
                    await client.save_weights()
                want = await client.forward_logprobs(probe)
                # Newer than the resume point: with keep_last=1 retention deletes every older unpinned version.
                await client.save_weights("remote-light", weights_only=True)
            assert [m.version for m in store.manifests()] == ["remote-step000002", "remote-light"]
            assert store.pins("remote-step000002") == ("trainer.remote",)
            async with trainer_server(weight_store.address, "--run", "remote") as (client, _):
                state = await client.get_state()
                assert (state.step, state.weights_version) == (2, "remote-step000002")
                for got, w in zip(await client.forward_logprobs(probe), want, strict=True):
                    assert torch.equal(got, w)
                err = await _status(client.load_weights("remote-step000001"))  # deleted by retention
                assert err.code() is grpc.StatusCode.NOT_FOUND
        finally:
            await weight_store.drain(0)
    asyncio.run(main())


def test_a_weight_store_that_cannot_write_is_reported_at_once_by_name_not_as_unreachable(tmp_path) -> None:
    """A store whose uploads cannot be written (a file where its uploads directory goes: NotADirectoryError,
    as a PermissionError would) fails SaveWeights with FAILED_PRECONDITION naming the error, not UNAVAILABLE
    (which a job retries for minutes as an outage)."""
    async def main() -> None:
        store = VersionStore(LocalDirBackend(tmp_path / "store"))
        weight_store = ServiceServer("weight-store")
        add_weight_store(weight_store, store, ServiceIdentity("weight-store", "ws-test"), watch_poll_s=0.2)
        await weight_store.start()
        try:
            async with trainer_server(weight_store.address, "--run", "broken") as (client, _):
                await client.forward_backward("sft", _sft_data(5))
                await client.optim_step()
                uploads = tmp_path / "store" / "uploads"
                shutil.rmtree(uploads, ignore_errors=True)
                uploads.write_text("not a directory")
                err = await _status(client.save_weights())
                assert err.code() is grpc.StatusCode.FAILED_PRECONDITION, (err.code(), err.details())
                assert "NotADirectoryError" in err.details() and "unreachable" not in err.details(), err.details()
                assert (await client.get_state()).step == 1     # the trainer keeps its step for a retry
        finally:
            await weight_store.drain(0)
    asyncio.run(main())


def _start(weights_dir: pathlib.Path, config: TrainConfig, module: Sequence[str],
           *extra: str) -> tuple[subprocess.Popen, str, str]:
    """A trainer process; (process, address, its listening line)."""
    proc = subprocess.Popen([sys.executable, "-m", *module, "--weights-dir", str(weights_dir), "--run", "job",
                             "--port", "0", "--threads", "1", *_flags(config), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("trainer listening on 127.0.0.1:"):
        proc.kill()
        raise AssertionError(f"trainer did not start: {line!r} {proc.stderr.read()}")  # type: ignore[union-attr]
    return proc, line.split()[3], line


@contextlib.contextmanager
def _reaped(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]


def test_a_killed_trainer_resumes_at_its_last_version_and_continues_bitwise(tmp_path: pathlib.Path) -> None:
    """SIGKILL after publishing step 2 (and mid-way into step 3): the restarted process resumes at step 2 and
    its step 3 is bitwise the uninterrupted run's, LoRA adapters, AdamW moments, LR schedule and KL reference
    included."""
    config = TrainConfig(lr=3e-3, warmup_steps=2, total_steps=6, lora_rank=4, kl_coef=0.05)
    reference = _reference(config)                      # the uninterrupted run
    data = _sft_data(6)
    weights = tmp_path / "w"

    async def before_kill(address: str) -> None:
        async with TrainerClient(address) as client:
            await client.forward_backward("sft", data)
            await client.optim_step()
            assert (await client.save_weights())[0].version == "job-step000001"
            reference.sft_step(data)
            rollouts = _rollouts(reference, _prompts(2, 7), "job-step000001", seed=1, top_p=1.0)
            await client.grpo_step(rollouts, group_size=4)
            await client.save_weights()
            reference.grpo_step(rollouts, group_size=4)
            await client.forward_backward("sft", data)  # step 3 under way, never applied

    async def after_restart(address: str) -> None:
        async with TrainerClient(address) as client:
            state = await client.get_state()
            assert (state.step, state.weights_version, state.accumulated_batches, state.config) == \
                (2, "job-step000002", 0, config)
            rollouts = _rollouts(reference, _prompts(2, 8), "job-step000002", seed=2, top_p=1.0)
            for got, want in zip(await client.forward_logprobs([r.sequence for r in rollouts]),
                                 reference.forward_logprobs([r.sequence for r in rollouts]), strict=True):
                assert torch.equal(got, want)           # identical weights after the restart
            fb, opt = await client.grpo_step(rollouts, group_size=4)
            want = reference.grpo_step(rollouts, group_size=4)
            assert fb.ppo is not None and (fb.ppo.kl, fb.ppo.mismatched_tokens) == (0.0, 0)
            assert 0.0 < fb.ppo.kl_reference < math.inf     # the restored reference is in use
            assert (fb.loss, fb.ppo.kl_reference, opt.grad_norm, opt.lr, opt.step) == \
                (want["loss"], want["kl_reference"], want["grad_norm"], want["lr"], 3)
            manifest, _ = await client.save_weights()
            assert (manifest.version, manifest.spec.parent_version) == ("job-step000003", "job-step000002")

    first, address, _ = _start(weights, config, ["zerokl", "serve", "trainer"])
    with _reaped(first):
        asyncio.run(before_kill(address))
        first.send_signal(signal.SIGKILL)
        first.wait()
    proc, address, line = _start(weights, config, ["zerokl.services.trainer"], "--metrics-port", "0")
    with _reaped(proc):
        assert " step: 2 " in line and "resumed from job-step000002" in line
        asyncio.run(after_restart(address))
        port = line.split("metrics on :")[1].split()[0]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "zerokl_trainer_step 3.0" in metrics and "zerokl_trainer_train_inference_kl 0.0" in metrics
        assert 'service="trainer"' in metrics and 'weights_version="job-step000003"' in metrics
        proc.send_signal(signal.SIGTERM)                # drains and exits cleanly
        assert proc.wait(timeout=30) == 0
    served = Model.from_pretrained(weights / "versions" / "job-step000003")
    _assert_same_weights(served.state_dict(), reference.serving_state_dict())


# ----------------------------------------------------------------------------- staleness and bad input

def test_rollouts_from_other_weights_are_refused_unless_max_staleness_admits_them(tmp_path: pathlib.Path) -> None:
    reference = _reference(TrainConfig())
    rollouts = _rollouts(reference, _prompts(1, 9), INIT)

    async def main() -> None:
        async with trainer_server(tmp_path / "w") as (client, _):
            await client.forward_backward("sft", _sft_data())
            await client.optim_step()                       # the weights are now one step past INIT
            err = await _status(client.forward_backward("ppo", rollouts, group_size=4))
            assert err.code() is FAILED and _preconditions(err) == [("STALE_WEIGHTS_VERSION", INIT)]
            assert "max_staleness" in (err.details() or "")
            err = await _status(client.forward_backward("ppo", rollouts, group_size=4, max_staleness=0))
            assert err.code() is FAILED
            foreign = [Rollout(r.sequence, r.logprobs, r.reward, "someone-elses-v9") for r in rollouts]
            err = await _status(client.forward_backward("ppo", foreign, group_size=4, max_staleness=5))
            assert err.code() is FAILED and _preconditions(err) == [("UNKNOWN_WEIGHTS_VERSION", "someone-elses-v9")]
            assert (await client.get_state()).accumulated_batches == 0   # refused calls accumulate nothing
            fb = await client.forward_backward("ppo", rollouts, group_size=4, max_staleness=1)
            assert fb.ppo is not None and (fb.ppo.stale_rollouts, fb.ppo.max_staleness) == (4, 1)
            assert fb.ppo.mismatched_tokens > 0 and fb.ppo.kl != 0.0     # off-policy by one step: measured
            await client.optim_step()
            manifest, _ = await client.save_weights()
            fresh = [Rollout(r.sequence, r.logprobs, r.reward, manifest.version) for r in rollouts]
            fb = await client.forward_backward("ppo", fresh, group_size=4)
            assert fb.ppo is not None and (fb.ppo.stale_rollouts, fb.ppo.max_staleness) == (0, 0)
    asyncio.run(main())


# TrainConfigs a trainer refuses (INVALID_ARGUMENT naming the field), and the field each names.
_BAD_CONFIGS = [
    (TrainConfig(lr=-1.0), "lr"), (TrainConfig(lr=float("nan")), "lr"), (TrainConfig(lr=1e9), "lr"),
    (TrainConfig(betas=(2.0, 0.95)), "beta1"), (TrainConfig(betas=(0.9, 1.0)), "beta2"),
    (TrainConfig(dtype="int8"), "dtype"),  # type: ignore[arg-type]
    (TrainConfig(clip_eps=-1.0), "clip_eps"), (TrainConfig(grad_clip=float("nan")), "grad_clip"),
    (TrainConfig(weight_decay=-0.1), "weight_decay"), (TrainConfig(lr=0.5, weight_decay=3.0), "weight_decay"),
    (TrainConfig(lora_alpha=0.0), "lora_alpha"), (TrainConfig(dpo_beta=float("inf")), "dpo_beta"),
    (TrainConfig(kl_coef=-1.0), "kl_coef"), (TrainConfig(indexer_loss_coef=float("nan")), "indexer_loss_coef"),
    (TrainConfig(dtype="fp8", lora_rank=4), "lora_rank"),
]


def test_train_configs_are_checked_field_by_field_and_unset_proto_fields_keep_the_defaults() -> None:
    for config, field in _BAD_CONFIGS:
        with pytest.raises(InvalidOption) as err:
            config.check()
        assert err.value.field == field, (config, err.value)
    TrainConfig().check()
    TrainConfig(lr=1.0, weight_decay=1.0, betas=(0.0, 0.999), dtype="fp8").check()
    assert convert.train_config_from_proto(trainer_pb2.TrainConfig()) == TrainConfig()
    partial = convert.train_config_from_proto(trainer_pb2.TrainConfig(lr=2e-3, beta2=0.9, master_weights=False))
    assert partial == TrainConfig(lr=2e-3, betas=(0.9, 0.9), master_weights=False)
    odd = TrainConfig(lr=0.5, weight_decay=0.0, betas=(0.0, 0.5), grad_clip=0.0, clip_eps=3.0, seed=2**64 - 1)
    assert convert.train_config_from_proto(convert.train_config_to_proto(odd)) == odd   # zeros survive as zeros


def test_bad_input_gets_a_clear_status_and_the_trainer_keeps_serving(tmp_path: pathlib.Path) -> None:
    good = Completion((5, 6, 7), (8, 9))
    rollout = Rollout(good, (-1.0, -2.0), 1.0, INIT)

    def ppo(*rs: Rollout, **kw: object) -> PPOBatch:
        return PPOBatch(tuple(rs), **kw)  # type: ignore[arg-type]

    async def main() -> None:
        async with trainer_server(tmp_path / "w") as (client, _):
            stub = trainer_pb2_grpc.TrainerStub(client.channel)
            logprob_cases = [
                ([], "completions"),
                ([Completion((5, 64), (8,))], "completions[0].prompt_ids"),
                ([good, Completion((5,), (8, -1))], "completions[1].completion_ids"),
                ([Completion((5,), ())], "completions[0].completion_ids"),
                ([Completion((), (8,))], "completions[0].prompt_ids"),
                ([Completion((5,), (8,), top_p=0.0)], "completions[0].top_p"),
                ([Completion((5,), (8,), temperature=-1.0)], "completions[0].temperature"),
                ([Completion((5,), (8,), temperature=1e300)], "completions[0].temperature"),
                ([Completion((5,), (8,), top_p=1e-300)], "completions[0].top_p"),
                ([Completion((5,), (8,), top_k=-2)], "completions[0].top_k"),
                ([Completion(tuple([5] * 500), tuple([6] * 20))], "completions[0]"),
            ]
            for completions, field in logprob_cases:
                err = await _status(client.forward_logprobs(completions))
                assert (err.code(), field in _fields(err)) == (INVALID, True), (field, err.details())
            batch_cases = [
                (ppo(rollout, rollout, rollout, rollout, group_size=3), "ppo.group_size"),
                (ppo(rollout, rollout), "ppo.group_size"),
                (ppo(rollout, group_size=0), "ppo.group_size"),
                (ppo(Rollout(good, (-1.0,), 1.0, INIT), group_size=1), "ppo.rollouts[0].logprobs"),
                (ppo(Rollout(good, (-1.0, float("nan")), 1.0, INIT), group_size=1), "ppo.rollouts[0].logprobs"),
                (ppo(Rollout(good, (-1.0, -2.0), 1.0, ""), group_size=1), "ppo.rollouts[0].weights_version"),
                (ppo(rollout, rollout, advantages=(1.0,)), "ppo.advantages"),
                (ppo(rollout, group_size=1, advantages=(1.0,)), "ppo.group_size"),
                (ppo(), "ppo.rollouts"),
            ]
            for batch, field in batch_cases:
                err = await _status(client.forward_backward_batch(batch))
                assert (err.code(), field in _fields(err)) == (INVALID, True), (field, err.details())
            bad_pair = (good, Completion((5,), (99,)))
            same = Completion((5, 6, 7), (8, 9), temperature=0.5)    # the same tokens: a pair that prefers nothing
            for method, items, field in (("sft", [], "sft.completions"), ("dpo", [], "dpo.pairs"),
                                         ("dpo", [bad_pair], "dpo.pairs[0].rejected.completion_ids"),
                                         ("dpo", [(good, Completion((5,), (8,))), (good, same)], "dpo.pairs[1]")):
                err = await _status(client.forward_backward(method, items))
                assert (err.code(), field in _fields(err)) == (INVALID, True), (field, err.details())
            # No batch set: what a server sees from a client using a method it does not know.
            err = await _status(stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest()))
            assert err.code() is INVALID and _fields(err) == ["batch"]
            assert (await _status(client.optim_step())).code() is FAILED           # nothing accumulated
            for lr in (-1e-3, float("nan"), float("inf"), 1e9, 1.5):     # the ceiling is 1
                err = await _status(client.optim_step(lr=lr))
                assert (err.code(), _fields(err)) == (INVALID, ["lr"]), err.details()
            assert (await _status(client.save_weights("../escape"))).code() is INVALID
            assert (await _status(client.load_weights(""))).code() is INVALID
            # A fresh trainer's config is checked field by field before anything loads.
            for config, field in _BAD_CONFIGS:
                err = await _status(client.load_weights(INIT, config=config))
                assert (err.code(), _fields(err)) == (INVALID, [f"config.{field}"]), (field, err.details())
            # Unset fields of a partly filled config keep their defaults (never a literal 0).
            err = await _status(stub.LoadWeights(trainer_pb2.LoadWeightsRequest(
                version=INIT, config=trainer_pb2.TrainConfig(beta1=2.0))))
            assert (err.code(), _fields(err)) == (INVALID, ["config.beta1"]), err.details()
            assert (await _status(client.load_weights("nope"))).code() is grpc.StatusCode.NOT_FOUND
            # Nothing of the above changed the trainer, and it still serves.
            state = await client.get_state()
            assert (state.step, state.accumulated_batches, state.tokens_seen, state.weights_version) == (0, 0, 0, INIT)
            [lp] = await client.forward_logprobs([good])
            assert torch.equal(lp, _reference(TrainConfig()).forward_logprobs([good])[0])
            health = await health_pb2_grpc.HealthStub(client.channel).Check(
                health_pb2.HealthCheckRequest(service=TRAINER_SERVICE))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    asyncio.run(main())


def test_a_step_that_overflows_is_refused_undone_and_the_trainer_serves_the_next_job(tmp_path: pathlib.Path) -> None:
    """A PPO batch with advantages of +-3e38 (finite, so accepted) whose gradients overflow to NaN: OptimStep is
    FAILED_PRECONDITION naming the cause, and the trainer is exactly as before the step (weights, optimizer state,
    step counter) with no gradients pending, so the next ForwardBackward + OptimStep gives bitwise the in-process
    trainer's result. (An lr that overflows AdamW's step is refused earlier: above the ceiling, INVALID_ARGUMENT.)"""
    config = TrainConfig(lr=3e-3)
    reference = _reference(config)
    sft = _sft_data(6)
    seq = Completion((5, 6, 7, 8), (9, 10, 11))
    # Off-policy by one step (max_staleness 1): the gradient's size, not its direction, is the point here.
    overflowing = PPOBatch((Rollout(seq, (-1.0, -1.0, -1.0), 1.0, INIT),) * 2, advantages=(3e38, -3e38),
                           max_staleness=1)

    async def main() -> None:
        async with trainer_server(tmp_path / "w", *_flags(config)) as (client, service):
            await client.forward_backward("sft", sft)
            await client.optim_step()                       # the optimizer has state to roll back to
            reference.sft_step(sft)
            before = {k: v.clone() for k, v in service.trainer.model.state_dict().items()}
            moments = {k: v.clone() for s in service.trainer.optimizer.state.values() for k, v in s.items()}
            err = await _status(client.optim_step(lr=1e300))
            assert (err.code(), _fields(err)) == (INVALID, ["lr"]) and "at most 1" in err.details(), err.details()
            await client.forward_backward_batch(overflowing)
            err = await _status(client.optim_step())
            assert err.code() is FAILED and "non-finite" in err.details() and "undone" in err.details(), err.details()
            state = await client.get_state()
            assert (state.step, state.accumulated_batches) == (1, 0)
            _assert_same_weights(service.trainer.model.state_dict(), before)
            after = {k: v for s in service.trainer.optimizer.state.values() for k, v in s.items()}
            assert all(torch.equal(after[k], moments[k]) for k in moments)
            # The next job's step runs as if the refused one never happened.
            fb = await client.forward_backward("sft", sft)
            opt = await client.optim_step()
            want = reference.forward_backward("sft", sft) | reference.optim_step()
            assert (fb.loss, opt.grad_norm, opt.step) == (want["loss"], want["grad_norm"], want["step"])
            _assert_same_weights(service.trainer.model.state_dict(), reference.model.state_dict())
    asyncio.run(main())


def test_a_forward_backward_out_of_device_memory_is_reported_and_the_trainer_keeps_serving(
        tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    """A step that runs out of device memory: INTERNAL naming it, no gradient left pending, the trainer's log says
    what held the device (parameters, gradients, the versions and records it keeps), and the next step trains."""
    config = TrainConfig(lr=3e-3)

    async def main() -> None:
        async with trainer_server(tmp_path / "w", *_flags(config)) as (client, service):
            state = await client.get_state()
            rollouts = _rollouts(service.trainer, _prompts(2, 1), state.weights_version)
            forward_backward = service._forward_backward

            def out_of_memory(*args, **kw):  # noqa: ANN002, ANN003, ANN202
                service._forward_backward = forward_backward        # once
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.77 GiB.")
            service._forward_backward = out_of_memory
            with caplog.at_level(logging.ERROR, logger="zerokl.services.trainer.service"):
                err = await _status(client.forward_backward("ppo", rollouts, group_size=4))
            assert err.code() is grpc.StatusCode.INTERNAL and "OutOfMemoryError" in err.details()
            report = next(r.getMessage() for r in caplog.records if "device memory at the failure" in r.getMessage())
            assert "parameters" in report and "gradients 0.00 GiB" in report and "exports kept: none" in report
            fb, opt = await client.grpo_step(rollouts, 4)
            assert fb.accumulated_batches == 1 and opt.step == 1
    asyncio.run(main())
