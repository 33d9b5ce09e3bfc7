"""Bad input through the scheduler's front door gets a clear status, by meaning, before any work.

Real replicas and a real scheduler on loopback: values a replica would refuse are refused
by the scheduler as INVALID_ARGUMENT naming the field (n <= 0 used to stream an empty OK),
an over-long prompt is refused before the prefill replica reads a token, unknown text is
named instead of computed as <unk>, a huge pin is echoed clipped; job specs are checked the
same way. The fleet keeps serving exact bits throughout.
"""
from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest

from conftest import offline, replica_server, scheduler_server
from zerokl.services.inference import InferenceClient, InferenceRequest
from zerokl.services.runtime import ServerOptions, ServiceServer, field_violations
from zerokl.services.jobs.manager import JobManager
from zerokl.services.jobs.types import CountdownTask, DPOJobSpec, RLJobSpec, SFTJobSpec
from zerokl.services.jobs.service import JobsClient, add_jobs_service
from zerokl.services.trainer.client import TrainerClient
from zerokl.services.trainer.config import TrainConfig
from zerokl.vocab import Completion, SamplingOptions

INVALID, FAILED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
RANGE = "temperature must be 0 (greedy) or in [1e-06, 1e+06]"


def _r(ids=(3, 4, 5), text=None, wv="", **opts) -> InferenceRequest:
    opts.setdefault("max_tokens", 3)
    return InferenceRequest(prompt_ids=ids if text is None else None, prompt_text=text,
                            options=SamplingOptions(**opts), weights_version=wv)


async def _refused(coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value


def test_the_scheduler_refuses_bad_requests_by_meaning_before_any_work(model) -> None:
    async def main() -> None:
        async with replica_server(model, "decode") as (dsrv, _), \
                replica_server(model, "prefill") as (psrv, prefill), \
                scheduler_server([dsrv.address], [psrv.address]) as (ssrv, _), \
                InferenceClient(ssrv.address) as client:
            cases = [
                (_r(n=0), "sampling.n", "n must be >= 1, got 0"),
                (_r(n=-2), "sampling.n", "n must be >= 1, got -2"),
                (_r(stop=("",)), "sampling.stop", "stop strings must not be empty"),
                (_r(temperature=1e300), "sampling.temperature", f"{RANGE}, got 1e+300"),
                (_r(temperature=float("inf"), top_k=3), "sampling.temperature", f"{RANGE}, got inf"),
                (_r(top_p=1e-300), "sampling.top_p", "top_p must be in (0, 1]"),
                (_r(tuple([5] * 512)), "prompt", "the prompt has 512 tokens and does not fit the context of 512 "
                                                 "(max_model_len)"),
                (_r(text="nums 1 2 3\ntarget ü€ 7 ü"), "prompt_text",
                 "characters outside the tokenizer's vocabulary: 'ü', '€'"),
                (_r(()), "prompt", "the prompt is empty"),
                (_r(text=""), "prompt", "the prompt is empty"),
            ]
            read_before = prefill.engine.engine.stats["prompt_tokens"]
            for request, field, message in cases:
                err = await _refused(client.generate_all(request))
                assert err.code() is INVALID and message in err.details(), (field, err.code(), err.details())
                assert [v.field for v in field_violations(err)] == [field], err.details()
                # Clients are told which replica refused, never where the replicas listen.
                assert "127.0.0.1" not in err.details(), err.details()
            assert prefill.engine.engine.stats["prompt_tokens"] == read_before, "nothing was prefilled"
            for request in (_r(temperature=1e300), _r(temperature=float("nan"))):
                err = await _refused(client.score(request))
                assert err.code() is INVALID and RANGE in err.details(), err.details()
            # A pin of 100 kB comes back clipped, under gRPC's metadata limit (it used to be RESOURCE_EXHAUSTED).
            for target in (ssrv.address, dsrv.address):
                async with InferenceClient(target) as direct:
                    err = await _refused(direct.generate_all(_r(wv="v" * 100_000)))
                    assert err.code() is FAILED and "clipped" in err.details() and len(err.details()) <= 1024
            good = _r(tuple(range(3, 30)), temperature=0.9, seed=4, max_tokens=6, ignore_eos=True)
            assert (await client.generate_all(good)).samples == offline(model, good.prompt_ids, good.options)
    asyncio.run(main())


def test_job_specs_are_checked_by_meaning() -> None:
    task = CountdownTask(train_problems=50, test_problems=4)
    pair = (Completion((1, 5), (6, 2)), Completion((1, 5), (7, 2)))
    cases = [
        (RLJobSpec(steps=1, countdown=task, temperature=1e300), "rl.temperature", f"{RANGE}, got 1e+300"),
        (RLJobSpec(steps=1, countdown=task, temperature=float("inf")), "rl.temperature", RANGE),
        (RLJobSpec(steps=1, countdown=task, temperature=0.0), "rl.temperature", "need temperature > 0"),
        (RLJobSpec(steps=1, countdown=task, top_p=1e-300), "rl.top_p", "top_p must be in (0, 1]"),
        (DPOJobSpec(steps=1, pairs=()), "dpo.pairs", "no preference pairs given"),
        (DPOJobSpec(steps=1, pairs=(pair,), batch_size=2), "dpo.batch_size", "must be in 1..1 (the pairs given), got 2"),
        (SFTJobSpec(steps=1, countdown=task, learning_rate=1e300), "learning_rate", "at most 1 (the learning rate"),
        (SFTJobSpec(steps=1, countdown=task, learning_rate=1e9), "learning_rate", "got 1000000000.0"),
        (DPOJobSpec(steps=1, pairs=(pair, (pair[0], pair[0])), batch_size=1), "dpo.pairs[1]",
         "chosen and rejected are the same completion"),
        (SFTJobSpec(steps=1, countdown=task, train_config=TrainConfig(lr=-1.0)), "train_config.lr", "got -1.0"),
        (SFTJobSpec(steps=1, countdown=task, train_config=TrainConfig(lr=1e9)), "train_config.lr", "(0, 1]"),
        (RLJobSpec(steps=1, countdown=task, train_config=TrainConfig(betas=(2.0, 0.95))), "train_config.beta1",
         "must be in [0, 1)"),
        (RLJobSpec(steps=1, countdown=task, train_config=TrainConfig(dtype="int8")),  # type: ignore[arg-type]
         "train_config.dtype", "must be one of"),
        (RLJobSpec(steps=1, countdown=task, train_config=TrainConfig(clip_eps=-1.0)), "train_config.clip_eps",
         "must be > 0"),
        (RLJobSpec(steps=1, countdown=task, train_config=TrainConfig(grad_clip=float("nan"))),
         "train_config.grad_clip", "finite"),
    ]

    async def main() -> None:
        # A real Jobs service; its trainer is never called: every spec is refused at submission.
        trainer = TrainerClient("127.0.0.1:1")
        jobs = JobManager(trainer, generate=None, switch_weights=None)  # type: ignore[arg-type]
        server = ServiceServer("scheduler", ServerOptions())
        add_jobs_service(server, jobs)
        await server.start()
        try:
            async with JobsClient(server.address) as client:
                for spec, field, message in cases:
                    err = await _refused(client.submit(spec))
                    assert err.code() is INVALID and message in err.details(), (field, err.details())
                    assert [v.field for v in field_violations(err)] == [field]
                assert await client.list() == []
        finally:
            await server.drain(0)
            await trainer.close()
    asyncio.run(main())
