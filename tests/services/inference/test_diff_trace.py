"""`zerokl diff` over real gRPC, a decode replica against the trainer (tiny model, CPU, loopback).

Two identical sides report no divergence; a perturbation made on the trainer's side
alone (one kernel swapped for the stock one, one expert's weights nudged by one ULP,
a router tie flipped) is located exactly: its layer, its op, and the first token it
touches, which each test works out independently from a captured reference trace.
A trace is the operator's: other credentials get PERMISSION_DENIED.
"""
from __future__ import annotations

import asyncio
import contextlib
import pathlib
import types
from typing import AsyncIterator, Iterator

import grpc
import pytest
import torch

from conftest import CONFIG, decode_server
from zerokl.kernels import ops, stock_ops, trace
from zerokl.kernels.trace import trace_sequence
from zerokl.kernels.model import Model
from zerokl.kernels.model.model import Router
from zerokl.diff import Side, diff
from zerokl.services.runtime import ServerOptions, ServiceServer
from zerokl.services.runtime.auth import AuthConfig
from zerokl.services.runtime.optrace import trace_options_to_proto
from zerokl.services.runtime.server import create_channel
from zerokl.up import ClientSecurity
from zerokl.services.trainer.checkpointing import open_repo
from zerokl.services.trainer.server import build_parser, start_trainer
from zerokl.services.trainer.service import TrainerService, add_trainer_service
from zerokl.v1 import inference_pb2, inference_pb2_grpc, trainer_pb2, trainer_pb2_grpc

TIE_LAYER, TIE = 1, (4, 5)          # router rows 4 and 5 (one group of 4) are made equal on both sides


def _ids(n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(3, CONFIG.vocab_size, (n,), generator=g).tolist())


def _make_tie(model: Model) -> None:
    w = model.layers[TIE_LAYER].mlp.gate.weight
    with torch.no_grad():
        w[TIE[1]] = w[TIE[0]]


@contextlib.asynccontextmanager
async def _trainer(tmp: pathlib.Path) -> AsyncIterator[tuple[str, TrainerService]]:
    args = build_parser().parse_args(["--weights-dir", str(tmp / "w"), "--port", "0"])
    service = (await start_trainer(args, await open_repo(args))).service
    server = ServiceServer("trainer")
    add_trainer_service(server, service)
    await server.start()
    try:
        yield server.address, service
    finally:
        await server.drain(0)
        await service.close()


@contextlib.asynccontextmanager
async def _sides(tmp: pathlib.Path) -> AsyncIterator[tuple[Side, Side, Model, Model]]:
    """A decode replica and the trainer, both on tiny seed 0 with the same router tie."""
    served = Model(CONFIG, seed=0)
    _make_tie(served)
    async with decode_server(served) as (server, _), _trainer(tmp) as (address, service):
        trained = service._trainer.model
        _make_tie(trained)
        assert all(torch.equal(a, b) for a, b in zip(served.state_dict().values(), trained.state_dict().values()))
        yield Side("service", server.address), Side("service", address), served, trained


@contextlib.contextmanager
def _stock_rms_norm(module: torch.nn.Module) -> Iterator[None]:
    """This one norm computed by plain torch (the stock kernel) instead of the invariant one."""
    module.forward = types.MethodType(lambda self, x: stock_ops.rms_norm(x, self.weight, self.eps), module)
    try:
        yield
    finally:
        del module.forward


@contextlib.contextmanager
def _nudged_expert(model: Model, layer: int, expert: int) -> Iterator[None]:
    """Every weight of one expert's gate projection moved one ULP up."""
    p = model.layers[layer].mlp.gate_proj
    before = p[expert].detach().clone()
    # Written through the parameter (not .data) so its version changes: the torch backend caches
    # a weight's slices by version.
    with torch.no_grad():
        p[expert] = torch.nextafter(before, torch.full_like(before, float("inf")))
    try:
        yield
    finally:
        with torch.no_grad():
            p[expert] = before


@contextlib.contextmanager
def _flipped_tie(router: Router) -> Iterator[None]:
    """The router breaks the tie between experts TIE[0] and TIE[1] towards the higher index."""
    c = router.c
    perm = torch.arange(c.n_routed_experts)
    perm[TIE[0]], perm[TIE[1]] = TIE[1], TIE[0]

    def forward(self: Router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = ops.linear(x.float(), self.weight.float())
        trace.record("mlp.gate.logits", logits)
        weights, ids = ops.moe_route(logits[:, perm], self.e_score_correction_bias[perm], c.num_experts_per_tok,
                                     c.n_group, c.topk_group, c.routed_scaling_factor, c.norm_topk_prob)
        return weights, perm[ids]
    router.forward = types.MethodType(forward, router)
    try:
        yield
    finally:
        del router.forward


def _reference(model: Model, ids: tuple[int, ...]) -> dict[tuple[int, str], torch.Tensor]:
    t = trace_sequence(model, ids, capture=["*"])
    return {(o.layer, o.op): o.tensor() for o in t.ops}


def _first(mask: torch.Tensor) -> int:
    hits = torch.nonzero(mask).view(-1)
    assert len(hits), "the perturbation touches no token: the test would prove nothing"
    return int(hits[0])


def test_a_replica_and_the_trainer_agree_and_each_perturbation_is_located_exactly(tmp_path):
    async def main() -> None:
        async with _sides(tmp_path) as (replica, trainer, served, trained):
            ids = _ids(24, seed=1)
            same = await diff(replica, trainer, ids)
            assert same.identical and same.first is None and not same.warnings
            assert same.a["service"] == "decode" and same.b["service"] == "trainer"
            # 90 ops in common: the trainer's training layout has no explicit key set to record in its dense
            # rows (`self_attn.selected`, one per layer), the replica's serving path has
            assert all(s.differing_ops == 0 for s in same.layers) and sum(s.ops for s in same.layers) >= 90

            # 1. One kernel swapped for the stock one: layer 2's q_a_layernorm.
            ids = _ids(24, seed=2)
            ref = _reference(served, ids)
            norm = trained.layers[2].self_attn.q_a_layernorm
            x = ref[(2, "self_attn.q_a_proj")]
            token = _first((stock_ops.rms_norm(x, norm.weight, norm.eps) != ref[(2, "self_attn.q_a_layernorm")]).any(1))
            with _stock_rms_norm(norm):
                got = await diff(replica, trainer, ids)
            f = got.first
            assert not got.identical and (f.layer, f.op, f.token) == (2, "self_attn.q_a_layernorm", token)
            assert f.ulp is not None and f.ulp >= 1 and f.a != f.b
            assert f.a == ref[(2, "self_attn.q_a_layernorm")][token][f.index[0]].item()
            assert [s.differing_ops for s in got.layers[:2]] == [0, 0] and got.layers[2].first_op == f.op

            # 2. One expert's weights nudged by one ULP: the first token routed to it, in its slot.
            ids = _ids(24, seed=3)
            ref = _reference(served, ids)
            chosen = ref[(3, "mlp.gate.experts")]
            expert = int(chosen[5, 0])
            token = _first((chosen == expert).any(1))
            slot = int(torch.nonzero(chosen[token] == expert)[0])
            with _nudged_expert(trained, 3, expert):
                got = await diff(replica, trainer, ids)
            f = got.first
            assert (f.layer, f.op, f.token) == (3, "mlp.experts", token)
            assert f.index[0] == slot and f"expert {expert}" in f.note
            assert sorted(f.tokens) == f.tokens and set(f.tokens) <= set(torch.nonzero((chosen == expert).any(1)).view(-1).tolist())

            # 3. A router tie flipped: the selection parts, the logits and weights do not.
            ids = _ids(24, seed=4)
            ref = _reference(served, ids)
            token = _first((ref[(TIE_LAYER, "mlp.gate.experts")] == TIE[0]).any(1))
            with _flipped_tie(trained.layers[TIE_LAYER].mlp.gate):
                got = await diff(replica, trainer, ids)
            f = got.first
            assert (f.layer, f.op, f.token) == (TIE_LAYER, "mlp.gate.experts", token)
            assert {f.a, f.b} <= set(TIE) and f.ulp is None

    asyncio.run(main())


def test_a_trace_needs_the_operator_credential_when_auth_is_on():
    auth = AuthConfig(client_token="c-token", peer_token="p-token", operator_token="o-token")
    ids = list(_ids(6, seed=5))

    async def score(address: str, token: str, with_trace: bool) -> inference_pb2.ScoreResponse:
        req = inference_pb2.ScoreRequest(prompt_token_ids=inference_pb2.TokenIds(ids=ids))
        if with_trace:
            req.trace.CopyFrom(trace_options_to_proto())
        async with create_channel(address, token=token) as channel:
            return await inference_pb2_grpc.InferenceStub(channel).Score(req, timeout=60)

    async def main() -> None:
        async with decode_server(Model(CONFIG, seed=0), options=ServerOptions(auth=auth)) as (server, _):
            plain = await score(server.address, "c-token", False)
            assert len(plain.logprobs) == 5 and not plain.HasField("trace")
            for token in ("c-token", "p-token"):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await score(server.address, token, True)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "operator" in err.value.details()
            traced = await score(server.address, "o-token", True)
            assert list(traced.logprobs) == list(plain.logprobs) and len(traced.trace.ops) >= 90   # the trainer's 90 ops
            report = await diff(Side("service", server.address), Side("local", "tiny"), ids,
                                security=ClientSecurity("o-token"))
            assert report.identical

    asyncio.run(main())


def test_a_traced_forward_logprobs_takes_one_completion(tmp_path):
    async def main() -> None:
        async with _trainer(tmp_path) as (address, _):
            c = trainer_pb2.Completion(prompt_ids=[5], completion_ids=[6, 7])
            async with create_channel(address) as channel:
                stub = trainer_pb2_grpc.TrainerStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ForwardLogprobs(trainer_pb2.ForwardLogprobsRequest(
                        completions=[c, c], trace=trace_options_to_proto()))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                one = await stub.ForwardLogprobs(trainer_pb2.ForwardLogprobsRequest(
                    completions=[c], trace=trace_options_to_proto(["-1:logprobs"])))
                lp = next(o for o in one.trace.ops if o.op == "logprobs")
                # The trace's logprobs are the served ones, bit for bit.
                assert torch.equal(torch.frombuffer(bytearray(lp.values), dtype=torch.float32),
                                   torch.tensor(list(one.logprobs[0].values), dtype=torch.float32))

    asyncio.run(main())
