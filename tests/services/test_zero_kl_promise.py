"""The promise itself, on each device: what the engine sampled, the trainer recomputes bit for bit.

Engine-sampled rollouts with continuous batching and chunked prefill (many requests of
different prompt lengths, a small token budget, every sampling mode in flight at once) are
recomputed through the trainer's public API (`Trainer.forward_logprobs`) in three batchings:
all of a mode's sequences at once, groups of 5, each alone. Every logprob is torch.equal to
the engine's and KL == 0.0. Then one GRPO step through the in-process ports on the same
device: KL == 0.0, no mismatched token, clip fraction 0.

CPU (always): the `tiny` preset on the CPU default backend, a few requests. CUDA (gpu tier):
the `small` preset in bf16 on the Triton backend with the sizes of issue 23 (24 requests
per mode, prompts of 20-150 tokens, 48 sampled tokens, max_num_batched_tokens 512).
The count of logprobs compared per sampling mode is printed and recorded as a property.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from zerokl.kernels import use_backend
from zerokl.kernels.backend import default_backend
from zerokl.kernels.model import Model, ModelConfig
from zerokl.tokenizer import CountdownTokenizer
from zerokl.services.engine.engine import Engine, run_to_completion
from zerokl.services.engine.types import EngineConfig, GenerateRequest
from zerokl.services.rl.loop import RLConfig, Task, run_rl
from zerokl.services.rl.ports import LocalEnginePort, LocalTrainerPort
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import Trainer
from zerokl.tasks.countdown import format_prompt, generate_problems, reward
from zerokl.vocab import Completion, SamplingOptions

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

# name -> (temperature, top_k, top_p, n)
MODES = {
    "plain": (1.0, 0, 1.0, 1),
    "greedy": (0.0, 0, 1.0, 1),
    "top_k": (1.0, 20, 1.0, 1),
    "top_p": (1.0, 0, 0.9, 1),
    "top_k_top_p": (1.0, 20, 0.9, 1),
    "n_gt_1": (1.0, 20, 0.95, 3),
}


@dataclass(frozen=True)
class Sizes:
    preset: str
    requests_per_mode: int
    prompt_lengths: tuple[int, int]
    max_tokens: int
    max_num_batched_tokens: int


SIZES = {
    "cpu": Sizes("tiny", 3, (5, 40), 8, 32),
    "cuda": Sizes("small", 24, (20, 150), 48, 512),
}


def _backend(device: str) -> str:
    """The device's invariant backend: the machine's default on CUDA (triton), torch on the CPU
    (on a CUDA machine Triton compiles for the GPU and cannot take CPU tensors)."""
    return default_backend() if device == "cuda" else "torch"


def _model(preset_or_config, device: str) -> Model:
    cfg = ModelConfig.preset(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    return Model(cfg, seed=0, dtype=torch.bfloat16).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_engine_logprobs_equal_the_trainers_in_every_batching(device, record_property):
    sizes = SIZES[device]
    rng = random.Random(23)
    with use_backend(_backend(device)):
        trainer = Trainer(_model(sizes.preset, device))
        vocab = trainer.model.config.vocab_size
        requests = []
        for mode, (temperature, top_k, top_p, n) in MODES.items():
            for i in range(sizes.requests_per_mode):
                prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randint(*sizes.prompt_lengths)))
                opts = SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, n=n, seed=1000 + i,
                                       max_tokens=sizes.max_tokens, ignore_eos=True)
                requests.append(GenerateRequest(f"{mode}/{i}", prompt, opts))
        rng.shuffle(requests)                              # every mode's neighbours are other modes
        engine = Engine(trainer.serving_model(),
                        EngineConfig(max_num_batched_tokens=sizes.max_num_batched_tokens, num_blocks=2048))
        outs = run_to_completion(engine, requests)
        counts = {}
        for mode, (temperature, top_k, top_p, _) in MODES.items():
            seqs, sampled = [], []
            for r in (r for r in requests if r.request_id.split("/")[0] == mode):
                per: dict[int, tuple[list[int], list[float]]] = {}
                for d in outs[r.request_id]:
                    assert d.finish_reason in (None, "length"), f"{r.request_id}: {d.finish_reason}"
                    toks, lps = per.setdefault(d.index, ([], []))
                    toks += d.token_ids
                    lps += d.logprobs
                for index in sorted(per):
                    toks, lps = per[index]
                    assert len(toks) == sizes.max_tokens
                    seqs.append(Completion(r.prompt_ids, tuple(toks), temperature, top_k, top_p))
                    sampled.append(torch.tensor(lps, dtype=torch.float32))
            compared = 0
            for batching in ("all", "groups of 5", "alone"):
                step = {"all": len(seqs), "groups of 5": 5, "alone": 1}[batching]
                got = [lp for at in range(0, len(seqs), step) for lp in trainer.forward_logprobs(seqs[at:at + step])]
                for want, recomputed in zip(sampled, got):
                    assert torch.equal(recomputed, want), f"{mode}, {batching}: logprobs differ"
                kl = float(torch.cat([w - g for w, g in zip(sampled, got)]).mean())
                assert kl == 0.0, f"{mode}, {batching}: KL {kl}"
                compared += sum(len(w) for w in sampled)
            counts[mode] = compared
    record_property("logprobs_compared", counts)
    print(f"\nzero-KL promise on {device} ({sizes.preset}, bf16, {_backend(device)} backend): logprobs compared "
          f"per sampling mode over 3 batchings: {counts}")
    want_per_mode = 3 * sizes.requests_per_mode * sizes.max_tokens
    assert counts == {m: want_per_mode * n for m, (*_, n) in MODES.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_one_grpo_step_on_the_device_has_zero_kl_and_no_clipping(device):
    tok = CountdownTokenizer()
    sizes = SIZES[device]
    cfg = ModelConfig.preset(sizes.preset).replace(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                                                   eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    task = Task(train=generate_problems(40, seed=0), test=generate_problems(8, seed=1, split="test"),
                encode_prompt=lambda p: tuple([tok.bos_id] + tok.encode(format_prompt(p))), reward=reward)
    with use_backend(_backend(device)):
        # The trainer's fast path: activation checkpointing, and the fused head in chunks of 7 rows.
        trainer = LocalTrainerPort(Trainer(_model(cfg, device), TrainConfig(lr=3e-3, activation_checkpointing=True,
                                                                             logprob_chunk_rows=7)))
        engine = LocalEnginePort(trainer, tok, EngineConfig(max_num_batched_tokens=sizes.max_num_batched_tokens,
                                                            num_blocks=2048))
        [record] = run_rl(task, engine, trainer, RLConfig(steps=1, prompts_per_step=2, group_size=4,
                                                          max_tokens=12, top_p=0.9, eval_every=0))
    assert record.kl == 0.0 and record.mismatched_tokens == 0
    assert record.clip_fraction == 0.0 and record.ratio_min == record.ratio_max == 1.0
    assert trainer.trainer.model.embed_tokens.weight.device.type == device


# (seed, position, token id) whose hash lands in the top 24-bit cell (see
# tests/kernels/test_ties_and_sampling.py): the old uniform rounded it to 1.0.
TOP_CELL_HITS = [(261600, 12, 22), (280273, 12, 62), (425994, 14, 0), (484629, 14, 37), (526226, 14, 20)]


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_through_the_engine_at_the_top_noise_cell_does_not_crash(device, request):
    """Issue 23's crash on CPU: top_k=20 where the noise hit its top cell on a token outside the
    top 20 gave a NaN row and an out-of-range gather (a device-side assert on CUDA)."""
    if device == "cpu":
        request.getfixturevalue("cpu_backend")       # the engine's threads too, also on a CUDA host
    with use_backend(_backend(device)):
        trainer = Trainer(_model("tiny", device))
        rng = random.Random(5)
        requests = [GenerateRequest(f"hit{i}", tuple(rng.randrange(3, 64) for _ in range(position)),
                                    SamplingOptions(temperature=1.0, top_k=20, seed=seed, max_tokens=1))
                    for i, (seed, position, _) in enumerate(TOP_CELL_HITS)]
        # The test means something only if a hit token lies outside its row's top 20.
        outside = [bool(torch.isinf(trainer.forward_logprobs(
            [Completion(r.prompt_ids, (token,), 1.0, 20)])[0][0])) for r, (_, _, token) in zip(requests, TOP_CELL_HITS)]
        assert any(outside)
        outs = run_to_completion(Engine(trainer.serving_model(), EngineConfig(max_num_batched_tokens=16)), requests)
    for r in requests:
        [delta] = outs[r.request_id]
        assert delta.finish_reason == "length" and len(delta.token_ids) == 1
        assert torch.equal(torch.tensor(delta.logprobs),
                           trainer.forward_logprobs([Completion(r.prompt_ids, tuple(delta.token_ids), 1.0, 20)])[0])


@pytest.mark.parametrize("device", DEVICES)
def test_a_request_whose_logits_are_nan_fails_alone(device, caplog):
    """A poisoned embedding row makes one request's logits NaN: that request fails ("error", with a
    logged reason), every other request in the batch gets exactly the tokens it gets alone."""
    with use_backend(_backend(device)):
        model = _model("tiny", device)
        with torch.no_grad():
            model.embed_tokens.weight[63] = float("nan")
        rng = random.Random(9)
        healthy = [GenerateRequest(f"ok{i}", tuple(rng.randrange(3, 63) for _ in range(rng.randint(5, 20))),
                                   SamplingOptions(temperature=1.0, top_k=20, top_p=0.9, seed=i, max_tokens=6,
                                                   ignore_eos=True)) for i in range(3)]
        poisoned = GenerateRequest("nan", (5, 6, 63, 7), SamplingOptions(top_k=20, n=2, max_tokens=6))
        config = EngineConfig(max_num_batched_tokens=16)
        alone = {r.request_id: run_to_completion(Engine(model, config), [r])[r.request_id] for r in healthy}
        outs = run_to_completion(Engine(model, config), [healthy[0], poisoned, *healthy[1:]])
    assert sorted((d.index, d.finish_reason, d.token_ids) for d in outs["nan"]) == [(0, "error", []), (1, "error", [])]
    assert "request nan failed in the engine: ValueError: the logits have no sampling distribution" in caplog.text
    for r in healthy:
        got = [(d.token_ids, d.logprobs, d.finish_reason) for d in outs[r.request_id]]
        assert got == [(d.token_ids, d.logprobs, d.finish_reason) for d in alone[r.request_id]]
