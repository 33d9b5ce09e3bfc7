"""The official `tinker` SDK, unchanged, against `zerokl up --tinker` (one fleet for the module, auth on).

Only the SDK's public API is used (ServiceClient(base_url, api_key), create_lora_training_client and
full-weight training, forward / forward_backward / forward_backward_custom, optim_step(AdamParams),
save_state, save_weights_for_sampler, save_weights_and_get_sampling_client, create_sampling_client,
create_training_client_from_state_with_optimizer, sample, compute_logprobs, futures). Every parity
claim is exact: sampled == compute_logprobs == the training forward's logprobs (== on float32), the
importance ratio exactly 1, KL 0.0; a model restored from its checkpoint trains to the same bits.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import tinker
import torch
from tinker import types

ROOT = pathlib.Path(__file__).resolve().parents[3]
TOKEN = "tinker-test-client-token"
PROMPT = [29, 33, 28, 31, 6, 11, 6, 12]         # "nums 3 4" in the countdown vocabulary


def _check_tool():
    spec = importlib.util.spec_from_file_location("tinker_sdk_check", ROOT / "tools" / "tinker_sdk_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, zerokl_up):
    workdir = tmp_path_factory.mktemp("up")
    with zerokl_up(workdir, "--tinker", "--tinker-port", "0", "--auth-token", TOKEN, timeout=300) as services:
        yield workdir, services


@pytest.fixture(scope="module")
def service(fleet):
    _, services = fleet
    client = tinker.ServiceClient(base_url=services["tinker"]["http"], api_key=f"tml-{TOKEN}")
    yield client
    client.close("success").result()


def _datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    ob = len(prompt) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(prompt + tokens[:-1]),
                       loss_fn_inputs={"target_tokens": [0] * ob + tokens, "logprobs": [0.0] * ob + logprobs,
                                       "advantages": [0.0] * ob + [advantage] * len(tokens)})


def test_an_rl_loop_and_an_sft_loop_on_the_sdk_alone_keep_kl_zero_every_step(service) -> None:
    tool = _check_tool()
    rl = tool.rl_loop(service, "zerokl/tiny", steps=2, group=4, max_tokens=8, rank=8, lr=1e-3)
    assert rl["failures"] == []
    assert [(s["kl"], s["mismatched_tokens"], s["ratio"], s["trained_equals_sampled"]) for s in rl["steps"]] == \
        [(0.0, 0.0, [1.0, 1.0], True)] * 2
    sft = tool.sft_loop(service, "tiny", steps=3, rank=0, lr=1e-3)          # full weights
    assert sft["failures"] == [] and sft["losses"][-1] < sft["losses"][0]


def test_the_check_script_runs_unchanged_and_exits_zero(fleet) -> None:
    """tools/tinker_sdk_check.py as a user runs it: TINKER_BASE_URL and TINKER_API_KEY, exit status 0."""
    _, services = fleet
    env = {"TINKER_BASE_URL": services["tinker"]["http"], "TINKER_API_KEY": f"tml-{TOKEN}"}
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "tinker_sdk_check.py"), "--steps", "2", "--group", "2"],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads(run.stdout)
    assert [s["kl"] for s in summary["rl"]["steps"]] == [0.0, 0.0] and summary["base_model"] == "zerokl/tiny"


def test_the_losses_their_config_and_the_sampling_distribution(service) -> None:
    training = service.create_lora_training_client(base_model="zerokl/tiny", rank=4, seed=7).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    # zerokl's loss_fn_config extension: the forward at the sampling temperature gives the sampled numbers.
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), 2,
                            types.SamplingParams(max_tokens=6, temperature=0.7, seed=5)).result()
    data = [_datum(PROMPT, s.tokens, s.logprobs, 1.0) for s in result.sequences]
    out = training.forward(data, "importance_sampling", {"temperature": 0.7}).result()
    ob = len(PROMPT) - 1
    assert all(o["logprobs"].tolist()[ob:] == s.logprobs for o, s in zip(out.loss_fn_outputs, result.sequences))
    assert out.metrics["zerokl/kl:sum"] == 0.0
    # Off-policy sampling logprobs: each loss is its documented sum, recomputed from the logprobs it returns.
    shifted = [_datum(PROMPT, s.tokens, [lp + 0.3 * (-1) ** i for i, lp in enumerate(s.logprobs)], 1.0)
               for s in result.sequences]
    cases = {"importance_sampling": {}, "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
             "cispo": {}, "dro": {"beta": 0.2}}
    for loss, config in cases.items():
        out = training.forward(shifted, loss, config or None).result()
        total = 0.0
        for o, d in zip(out.loss_fn_outputs, shifted):
            lp = o["logprobs"].to_torch()
            q, a = d.loss_fn_inputs["logprobs"].to_torch(), d.loss_fn_inputs["advantages"].to_torch()
            ratio = torch.exp(lp - q)
            total += float({"importance_sampling": -(ratio * a),
                            "ppo": -torch.minimum(ratio * a, ratio.clamp(0.9, 1.1) * a),
                            "cispo": -(ratio.clamp(0.0, 4.0) * lp * a),
                            "dro": -(lp * a - 0.1 * (lp - q) ** 2)}[loss].sum())
        assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5), loss
        assert out.metrics["zerokl/mismatched_tokens:sum"] == sum(len(s.tokens) for s in result.sequences)
    with pytest.raises(tinker.BadRequestError, match="not a key of the ppo loss"):
        training.forward(shifted, "ppo", {"beta": 0.1}).result()


def test_bad_inputs_are_clear_errors_and_the_cluster_keeps_serving(fleet, service) -> None:
    _, services = fleet
    with pytest.raises(tinker.AuthenticationError, match="invalid or missing API key"):
        tinker.ServiceClient(base_url=services["tinker"]["http"], api_key="tml-wrong") \
            .create_lora_training_client(base_model="tiny", rank=4).result()
    with pytest.raises(tinker.NotFoundError, match="unknown base model 'Qwen/Qwen3-8B'"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    training = service.create_lora_training_client(base_model="tiny", rank=4).result()
    good = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                       loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})
    bad = [
        (types.Datum(model_input=types.ModelInput.from_ints([1, 2, 999]), loss_fn_inputs={"target_tokens": [2, 3, 4]}),
         "cross_entropy", "token ids \\[999\\] are outside zerokl/tiny's vocabulary"),
        (types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                     loss_fn_inputs={"target_tokens": [2, 3], "logprobs": [0.0, 0.0]}),
         "importance_sampling", "advantages: required by the importance_sampling loss"),
        (types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3]}),
         "cross_entropy", "2 values for the 3 positions"),
        (good, "gspo", "'gspo' is not supported"),
    ]
    for datum, loss, message in bad:
        with pytest.raises(tinker.BadRequestError, match=message):
            training.forward_backward([datum], loss).result()
    with pytest.raises(tinker.RequestFailedError, match="no gradients accumulated"):
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match="outside zerokl/tiny's vocabulary"):
        sampler.sample(types.ModelInput.from_ints([1, 5000]), 1, types.SamplingParams(max_tokens=2)).result()
    # Served on: the refused calls' places in the model's order were passed over.
    fwd_bwd = training.forward_backward([good], "cross_entropy")
    optim = training.optim_step(types.AdamParams(learning_rate=1e-3))
    assert fwd_bwd.result().metrics["zerokl/tokens:sum"] == 3.0 and optim.result().metrics["zerokl/step:max"] == 1.0
    assert len(sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=3)).result()
               .sequences) == 2


def test_checkpoints_restore_bit_for_bit_and_samplers_stay_bound_to_their_version(service) -> None:
    base = service.create_sampling_client(base_model="zerokl/tiny").result()
    params = types.SamplingParams(max_tokens=6, seed=11)
    before = base.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
    training = service.create_lora_training_client(base_model="zerokl/tiny", rank=4, seed=3).result()
    data = [types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)})]
    adam = types.AdamParams(learning_rate=5e-3, eps=1e-8, weight_decay=0.01)
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(adam).result()
    path = training.save_state("after-1").result().path
    restored = service.create_training_client_from_state_with_optimizer(path).result()
    # Two models on one trainer, stepped alternately: the restored one is the same bits, optimizer included.
    steps = []
    for client in (training, restored):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(adam).result()
        steps.append(np.asarray(client.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data))
    assert np.array_equal(steps[0], steps[1])
    saved = training.save_weights_for_sampler("after-2").result()
    by_path = service.create_sampling_client(model_path=saved.path).result()
    fresh = training.save_weights_and_get_sampling_client().result()
    a = by_path.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
    b = fresh.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
    assert [(s.tokens, s.logprobs) for s in a.sequences] == [(s.tokens, s.logprobs) for s in b.sequences]
    # The sampler replica went to the trained versions and back: the base model's sampler is unchanged.
    after = base.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
    assert [(s.tokens, s.logprobs) for s in after.sequences] == [(s.tokens, s.logprobs) for s in before.sequences]
    assert by_path.get_tokenizer().encode("nums 3 4") == PROMPT


def test_metrics_health_and_status(fleet) -> None:
    workdir, services = fleet
    text = urllib.request.urlopen(f"http://{services['tinker']['metrics']}/metrics", timeout=10).read().decode()
    assert 'zerokl_tinker_calls_total{kind="ForwardBackward"}' in text
    status = subprocess.run([sys.executable, "-m", "zerokl", "status", "--workdir", str(workdir), "--json"],
                            capture_output=True, text=True, timeout=120)
    rows = {r["name"]: r for r in json.loads(status.stdout)["services"]}
    assert rows["tinker"]["health"] == "SERVING" and rows["tinker-sampler-0"]["fleet"] is False
    assert status.returncode == 0, status.stdout      # the fleet agrees; the endpoint's versions are its own
