"""The Tinker wire against the official SDK's own encoders and decoders (tinker 0.38.0), in process.

Requests are built and serialized by the SDK (its pydantic types, its protobuf request encoder); what
the endpoint answers is decoded by the SDK's response decoders: the same bytes, exact float32 values.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch
from tinker import types
from tinker._compat import model_dump
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from zerokl.services.runtime.errors import InvalidArgument
from zerokl.services.tinker_api import convert
from zerokl.services.tinker_api.types import ForwardBackwardOutcome, SampledSequence, SampleOutcome
from zerokl.services.trainer.types import AdamParams


def _fb_body(data, loss="cross_entropy", config=None, forward_only=False) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss, loss_fn_config=config),
        model_id="s:train:0", seq_id=3)
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def _json(request) -> dict:
    return model_dump(request, exclude_unset=False, exclude_none=True, mode="json")


def test_a_forward_backward_request_is_read_as_the_sdk_wrote_it() -> None:
    rl = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
                     loss_fn_inputs={"target_tokens": [0, 0, 4, 5], "logprobs": [0.0, 0.0, -0.25, -1.5],
                                     "advantages": torch.tensor([0.0, 0.0, 0.5, 0.5])})
    call = convert.forward_backward_from_proto(_fb_body(
        [rl], "ppo", {"clip_low_threshold": 0.9, "temperature": 0.7, "top_k": 5}, forward_only=True))
    assert (call.model_id, call.seq_id, call.loss, call.forward_only) == ("s:train:0", 3, "ppo", True)
    assert call.config == {"clip_low_threshold": 0.9}
    assert (call.sampling.temperature, call.sampling.top_k, call.sampling.top_p) == (0.7, 5, 1.0)
    (seq,) = call.sequences
    assert (seq.input_ids, seq.target_ids) == ((1, 2, 3, 4), (0, 0, 4, 5))
    assert (seq.logprobs, seq.advantages, seq.weights) == ((0.0, 0.0, -0.25, -1.5), (0.0, 0.0, 0.5, 0.5), None)
    sft = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})
    (seq,) = convert.forward_backward_from_proto(_fb_body([sft])).sequences
    assert seq.weights is None                                  # cross_entropy's default: 1 at every position


@pytest.mark.parametrize("data,loss,config,field", [
    ([types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2]})],
     "cross_entropy", None, "data[0].loss_fn_inputs.target_tokens"),
    ([types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                  loss_fn_inputs={"target_tokens": [2, 3], "logprobs": [0.0, 0.0]})],
     "importance_sampling", None, "data[0].loss_fn_inputs.advantages"),
    ([types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                  loss_fn_inputs={"target_tokens": [2, 3], "mask": torch.tensor([1.0, 1.0])})],
     "cross_entropy", None, "data[0].loss_fn_inputs.mask"),
    ([types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                  loss_fn_inputs={"target_tokens": torch.tensor([[2, 0], [0, 3]])})],
     "cross_entropy", None, "data[0].loss_fn_inputs.target_tokens"),
    ([types.Datum(model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png")]),
                  loss_fn_inputs={"target_tokens": [2]})], "cross_entropy", None, "data[0].model_input[0]"),
    ([types.Datum(model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": [2]})],
     "gspo", None, "loss_fn"),
    ([types.Datum(model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": [2]})],
     "cross_entropy", {"clip_low_threshold": 0.5}, "loss_fn_config.clip_low_threshold"),
    ([types.Datum(model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": [2]})],
     "cross_entropy", {"temperature": -2.0}, "loss_fn_config.temperature"),
])
def test_bad_forward_backward_requests_name_the_field(data, loss, config, field) -> None:
    with pytest.raises(InvalidArgument) as err:
        convert.forward_backward_from_proto(_fb_body(data, loss, config))
    assert [v.field for v in err.value.field_violations] == [field], err.value.message
    assert convert.call_ids_from_proto(_fb_body(data, loss, config)) == ("s:train:0", 3)   # passed over by number


def test_a_forward_output_is_decoded_by_the_sdk_with_the_exact_float32_logprobs() -> None:
    logprobs = (torch.tensor([-0.1, -2.5, float(np.float32(-1 / 3))]), torch.tensor([-7.0]))
    body = convert.forward_backward_output_to_proto(ForwardBackwardOutcome({"loss:sum": 1.5}, logprobs))
    out = deserialize_forward_backward_output(body)
    assert out.metrics == {"loss:sum": 1.5} and len(out.loss_fn_outputs) == 2
    for got, sent in zip(out.loss_fn_outputs, logprobs, strict=True):
        assert torch.equal(got["logprobs"].to_torch(), sent) and got["logprobs"].shape == [len(sent)]


def test_a_sample_is_decoded_by_the_sdk_with_exact_logprobs_and_none_for_the_first_prompt_token() -> None:
    outcome = SampleOutcome((SampledSequence((5, 6), (float(np.float32(-0.3)), -1.25), "stop"),
                             SampledSequence((7,), (-2.0,), "length")), (-1.5, -0.75), "v1", "fp")
    response = deserialize_sample_response(convert.sample_response_to_proto(outcome))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in response.sequences] == [
        ([5, 6], [float(np.float32(-0.3)), -1.25], "stop"), ([7], [-2.0], "length")]
    assert response.prompt_logprobs == [None, -1.5, -0.75]


def test_sample_and_optim_requests_as_the_sdk_sends_them() -> None:
    body = _json(types.SampleRequest(
        sampling_session_id="sampler-1", seq_id=0, num_samples=3, prompt=types.ModelInput.from_ints([4, 5]),
        sampling_params=types.SamplingParams(max_tokens=7, temperature=0.5, top_k=-1, top_p=0.9, stop=[2, 9]),
        prompt_logprobs=True, topk_prompt_logprobs=0, topk_sample_logprobs=0, prompt_alt_tokens_k=0))
    call = convert.sample_from_json(body, random_seed=11)
    o = call.options
    assert (call.prompt_ids, call.sampling_session_id) == ((4, 5), "sampler-1")
    assert (o.n, o.max_tokens, o.temperature, o.top_k, o.top_p, o.seed, o.stop_token_ids, o.prompt_logprobs,
            o.ignore_eos) == (3, 7, 0.5, 0, 0.9, 11, (2, 9), True, False)
    no_stops = convert.sample_from_json(_json(types.SampleRequest(
        base_model="zerokl/tiny", prompt=types.ModelInput.from_ints([4]),
        sampling_params=types.SamplingParams(stop=[], seed=2**64 - 1))), random_seed=0).options
    assert no_stops.ignore_eos and no_stops.max_tokens == 16 and no_stops.seed == (2**64 - 1) % 2**63
    with pytest.raises(InvalidArgument) as err:
        convert.sample_from_json({**body, "topk_prompt_logprobs": 5}, 0)
    assert err.value.field_violations[0].field == "topk_prompt_logprobs"
    with pytest.raises(InvalidArgument) as err:
        convert.sample_from_json({**body, "num_samples": 0}, 0)
    assert err.value.field_violations[0].field == "num_samples"

    optim = convert.optim_step_from_json(_json(types.OptimStepRequest(
        optim_params=types.AdamParams(learning_rate=2e-4, eps=1e-8, weight_decay=0.1), model_id="m", seq_id=4)))
    assert optim.adam == AdamParams(learning_rate=2e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                                    grad_clip_norm=0.0)
    spec = convert.model_spec_from_json(_json(types.CreateModelRequest(
        session_id="s", model_seq_id=2, base_model="tiny", lora_config=types.LoraConfig(rank=8, seed=3))))
    assert (spec.lora_rank, spec.seed, spec.model_seq_id) == (8, 3, 2)
    full = convert.model_spec_from_json(_json(types.CreateModelRequest(
        session_id="s", model_seq_id=2, base_model="tiny", lora_config=types.LoraConfig(rank=0))))
    assert full.lora_rank == 0                                  # rank 0: full weights
    with pytest.raises(InvalidArgument):
        convert.model_spec_from_json(_json(types.CreateModelRequest(
            session_id="s", model_seq_id=2, base_model="tiny", lora_config=types.LoraConfig(rank=8, train_mlp=False))))


def test_checkpoint_paths_name_stable_weight_store_versions() -> None:
    ckpt = convert.checkpoint_from_path("tinker://session-ab:train:3/sampler_weights/step-7")
    assert (ckpt.model_id, ckpt.kind, ckpt.name) == ("session-ab:train:3", "sampler", "step-7")
    assert ckpt.path == "tinker://session-ab:train:3/sampler_weights/step-7"
    assert ckpt.version == "tinker-session-ab.train.3-sampler-step-7"
    for bad in ("tinker://m/other/x", "s3://bucket/x", "tinker://m/weights/a b"):
        with pytest.raises(InvalidArgument):
            convert.checkpoint_from_path(bad)
