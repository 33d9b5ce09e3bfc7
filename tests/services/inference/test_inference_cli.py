"""`zerokl serve prefill|decode|scheduler` and `zerokl generate` as separate processes, as a user runs them."""
from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import urllib.request
from typing import Iterator

import pytest

from conftest import TOKENIZER, offline, prompt
from zerokl.kernels import __version__ as numerics_version
from zerokl.kernels import fingerprint
from zerokl.services.inference import InferenceClient, InferenceRequest
from zerokl.services.runtime.info import model_config_hash
from zerokl.vocab import SamplingOptions

MODEL_FLAGS = ["--preset", "tiny", "--seed", "0", "--port", "0", "--threads", "1"]
IDS = tuple(range(3, 30))
OPTIONS = SamplingOptions(temperature=0.8, top_p=0.9, seed=5, max_tokens=8, ignore_eos=True)
GENERATE = ["--prompt-ids", ",".join(map(str, IDS)), "--temperature", "0.8", "--top-p", "0.9", "--seed", "5",
            "--max-tokens", "8", "--ignore-eos", "--json"]


def _serve(*args: str) -> tuple[subprocess.Popen, str, str]:
    """Start `zerokl serve ...`; its process, its address and its listening line."""
    proc = subprocess.Popen([sys.executable, "-m", "zerokl", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith(f"{args[0]} listening on 127.0.0.1:"):
        proc.kill()
        raise AssertionError(f"{args[0]} did not start: {line!r} {proc.stderr.read()}")  # type: ignore[union-attr]
    return proc, line.split()[3], line


def _same_numbers(result: dict) -> dict:
    """What must not change with load, replica or path (request ids and prefix-cache hits may)."""
    return {k: result[k] for k in ("token_ids", "logprobs", "text", "finish_reason", "samples", "weights_version",
                                   "numerics_fingerprint")}


def _generate(server: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerokl", "generate", "--server", server, *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    decode, daddr, dline = _serve("decode", *MODEL_FLAGS, "--metrics-port", "0")
    prefill, paddr, _ = _serve("prefill", *MODEL_FLAGS, "--kv-chunk-bytes", "8192")
    # The disaggregated path: the scheduler pairs the two, the decode replica reads the KV from prefill.
    # The scheduler prints its line after its first poll: both replicas are known healthy by then.
    scheduler, saddr, _ = _serve("scheduler", "--decode", daddr, "--prefill", paddr, "--port", "0",
                                 "--poll-interval", "0.2")
    try:
        yield {"decode": daddr, "prefill": paddr, "scheduler": saddr,
               "metrics": dline.split("metrics on :")[1].split()[0], "decode_pid": str(decode.pid)}
    finally:
        for proc in (scheduler, prefill, decode):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()  # type: ignore[union-attr]
            proc.stderr.close()  # type: ignore[union-attr]


def test_generate_json_is_the_solo_run_alone_among_16_others_and_through_prefill(model, servers) -> None:
    want = offline(model, IDS, OPTIONS)[0]
    alone = _generate(servers["decode"], *GENERATE)
    assert alone.returncode == 0, alone.stderr
    got = json.loads(alone.stdout)
    assert (got["token_ids"], got["logprobs"], got["text"], got["finish_reason"]) == \
        (want.token_ids, want.logprobs, want.text, want.finish_reason)
    assert got["weights_version"] == "preset-tiny-seed0" and got["numerics_fingerprint"] == fingerprint()
    assert len(got["samples"]) == 1 and got["usage"]["completion_tokens"] == 8

    async def busy() -> tuple[subprocess.CompletedProcess, int]:
        # Keep 16 other requests of random lengths running for as long as the CLI runs.
        rng = random.Random(4)
        done = asyncio.Event()
        finished = 0
        async with InferenceClient(servers["decode"]) as client:
            async def neighbour() -> None:
                nonlocal finished
                while not done.is_set():
                    r = InferenceRequest(prompt_ids=prompt(rng, 3, 80), options=SamplingOptions(
                        temperature=rng.choice([0.0, 1.0]), seed=rng.randrange(100), max_tokens=rng.randint(4, 24),
                        ignore_eos=True))
                    await client.generate_all(r)
                    finished += 1
            tasks = [asyncio.ensure_future(neighbour()) for _ in range(16)]
            await asyncio.sleep(0.3)
            result = await asyncio.to_thread(_generate, servers["decode"], *GENERATE)
            done.set()
            await asyncio.gather(*tasks)
        return result, finished

    among, finished = asyncio.run(busy())
    assert among.returncode == 0, among.stderr
    assert finished >= 16
    assert _same_numbers(json.loads(among.stdout)) == _same_numbers(got)

    handed_off = _generate(servers["scheduler"], *GENERATE)
    assert handed_off.returncode == 0, handed_off.stderr
    assert _same_numbers(json.loads(handed_off.stdout)) == _same_numbers(got)

    # The metrics endpoint exports the serving metrics, and the KV the decode replica read from prefill.
    scrape = urllib.request.urlopen(f"http://127.0.0.1:{servers['metrics']}/metrics", timeout=10).read().decode()
    assert "zerokl_time_to_first_token_seconds_count" in scrape and "zerokl_generation_tokens_total" in scrape
    assert 'zerokl_kv_handoff_bytes_total{direction="received"}' in scrape


def test_generate_streams_text_and_reports_bad_input(model, servers) -> None:
    text = "nums 2 5 target 10\n"
    runs = [  # independent: run side by side
        (servers["scheduler"], text, "--temperature", "0", "--max-tokens", "12", "--ignore-eos"),
        (servers["decode"], "--prompt-ids", "3,64", "--json"),
        (servers["decode"], "--prompt-ids", "3,4", "--n", "3", "--max-tokens", "3", "--json", "--seed", "2"),
    ]

    async def all_runs() -> list[subprocess.CompletedProcess]:
        return await asyncio.gather(*(asyncio.to_thread(_generate, *run) for run in runs))

    out, bad, n = asyncio.run(all_runs())
    assert out.returncode == 0, out.stderr
    want = offline(model, tuple(TOKENIZER.encode(text)), SamplingOptions(temperature=0.0, max_tokens=12,
                                                                          ignore_eos=True))[0]
    assert out.stdout == want.text + "\n" and "finish_reason=length" in out.stderr
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "vocabulary" in bad.stderr
    assert n.returncode == 0, n.stderr
    samples = json.loads(n.stdout)["samples"]
    want_n = offline(model, (3, 4), SamplingOptions(n=3, max_tokens=3, seed=2))
    assert [(s["token_ids"], s["logprobs"]) for s in samples] == [(w.token_ids, w.logprobs) for w in want_n]


def test_sigterm_drains_a_stream_in_flight_then_exits_cleanly(model) -> None:
    # A grace no loaded CI box runs past (60 tiny steps took 16-20 s on the 2-core box at load 7): the
    # drain is what is tested, not the speed.
    proc, address, _ = _serve("decode", *MODEL_FLAGS, "--grace", "120")
    try:
        async def main() -> list[int]:
            async with InferenceClient(address) as client:
                r = InferenceRequest(prompt_ids=IDS, options=SamplingOptions(temperature=0.0, max_tokens=60,
                                                                            ignore_eos=True))
                stream = client.generate(r)
                tokens = list((await anext(stream)).token_ids)
                proc.send_signal(signal.SIGTERM)
                async for d in stream:
                    tokens += d.token_ids
                return tokens
        tokens = asyncio.run(main())
        want = offline(model, IDS, SamplingOptions(temperature=0.0, max_tokens=60, ignore_eos=True))[0]
        assert tokens == want.token_ids
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]


def test_model_flags_load_a_checkpoint_directory_or_a_seeded_preset(model, tmp_path) -> None:
    import torch

    from zerokl.services.inference.server import build_parser, load_model

    model.save_pretrained(tmp_path / "step-7")
    parser = build_parser("decode")
    loaded = load_model(parser.parse_args(["--model", str(tmp_path / "step-7")]))
    assert loaded.weights_version == "step-7" and loaded.tokenizer is None  # no tokenizer.json there
    want, got = model.state_dict(), loaded.model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    renamed = load_model(parser.parse_args(["--model", str(tmp_path / "step-7"), "--weights-version", "v7",
                                            "--tokenizer", "countdown"]))
    assert renamed.weights_version == "v7" and renamed.tokenizer is not None
    preset = load_model(parser.parse_args(["--preset", "tiny", "--seed", "0"]))
    assert preset.weights_version == "preset-tiny-seed0"
    assert all(torch.equal(preset.model.state_dict()[k], want[k]) for k in want)
    with pytest.raises(SystemExit):
        parser.parse_args(["--preset", "tiny", "--model", str(tmp_path)])  # one source of weights
    assert build_parser("prefill").parse_args(["--preset", "tiny", "--kv-chunk-bytes", "8"]).kv_chunk_bytes == 8
    assert build_parser("decode").parse_args(["--preset", "tiny", "--handoff-timeout", "9"]).handoff_timeout == 9
    with pytest.raises(SystemExit):
        build_parser("prefill").parse_args(["--preset", "tiny", "--decode", "h:1"])  # the scheduler pairs them


def test_zerokl_generate_starts_without_torch() -> None:
    """A client runs no kernel: `zerokl generate` imports neither torch nor the numerics library, so it starts in
    under a second instead of the ~3 s torch's import took (a trace it is sent is read with them, on demand)."""
    program = ("import sys; from zerokl.cli import main; "
               "rc = main(['generate', '--server', '127.0.0.1:1', '--prompt-ids', '1,2', '--max-tokens', '1']); "
               "print(rc, 'torch' in sys.modules, 'zerokl.kernels' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    rc, torch_loaded, kernels_loaded = run.stdout.split()
    assert rc != "0" and "UNAVAILABLE" in run.stderr      # nothing listens there: it got as far as connecting
    assert (torch_loaded, kernels_loaded) == ("False", "False"), run.stderr


def test_zerokl_serve_decode_runs_without_torch(model) -> None:
    """A decode replica's server runs no kernel: its engine process loads the model and computes, and tells the
    server what it computes with. From its start through a generation to its stop the server imports neither torch
    nor the numerics library (~2.5 s of CPU saved on each start); a KV handoff or a trace would load them on
    demand."""
    program = ("import sys; from zerokl.cli import main; "
               f"rc = main(['serve', 'decode', *{MODEL_FLAGS!r}, '--grace', '0']); "
               "print(rc, 'torch' in sys.modules, 'zerokl.kernels' in sys.modules)")
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        listening = proc.stdout.readline()  # type: ignore[union-attr]
        assert listening.startswith("decode listening on"), listening

        async def serve() -> tuple:
            async with InferenceClient(listening.split()[3]) as client:
                return await client.info(), await client.generate_all(InferenceRequest(prompt_ids=IDS,
                                                                                       options=OPTIONS))
        info, result = asyncio.run(serve())
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    # What the engine process reported is what this process computes, and so is the generation.
    assert (info.numerics_version, info.numerics_fingerprint, info.dtype, info.model_config_hash) == \
        (numerics_version, fingerprint(), "float32", model_config_hash(model.config.to_dict()))
    want = offline(model, IDS, OPTIONS)[0]
    assert (result.samples[0].token_ids, result.samples[0].logprobs) == (want.token_ids, want.logprobs)
    rc, torch_loaded, kernels_loaded = out.split()
    assert rc == "0", err
    assert (torch_loaded, kernels_loaded) == ("False", "False"), err


def test_a_store_switch_reads_the_weights_in_the_engine_process(tmp_path) -> None:
    """SwitchWeights from the weight store on `zerokl serve decode`: the version's files go straight to the engine's
    process (the front neither imports torch nor holds a host copy of the model), the replica then serves exactly
    the new weights, and a version of another model is refused FAILED_PRECONDITION while the replica keeps
    serving the weights it had."""
    import grpc

    from test_switch_weights import weight_store
    from zerokl.kernels.model import Model, ModelConfig
    from zerokl.services.weightstore.client import WeightStoreClient

    v2 = Model(ModelConfig.preset("tiny"), seed=1)
    v2.save_pretrained(tmp_path / "v2")
    Model(ModelConfig.preset("tiny").replace(num_hidden_layers=2), seed=0).save_pretrained(tmp_path / "other")

    async def main() -> tuple:
        async with weight_store(tmp_path / "store") as store_address:
            async with WeightStoreClient(store_address) as store:
                await store.publish(tmp_path / "v2", "v2", numerics_version=numerics_version)
                await store.publish(tmp_path / "other", "other-config", numerics_version=numerics_version)
            program = ("import sys; from zerokl.cli import main; "
                       f"rc = main(['serve', 'decode', *{MODEL_FLAGS!r}, '--weight-store', {store_address!r}, "
                       "'--grace', '0']); print(rc, 'torch' in sys.modules, 'zerokl.kernels' in sys.modules)")
            proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            try:
                listening = await asyncio.to_thread(proc.stdout.readline)  # type: ignore[union-attr]
                assert listening.startswith("decode listening on"), listening
                async with InferenceClient(listening.split()[3]) as client:
                    identity = await client.switch_weights("v2")
                    switched = await client.generate_all(InferenceRequest(prompt_ids=IDS, options=OPTIONS))
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await client.switch_weights("other-config")
                    kept = await client.generate_all(InferenceRequest(prompt_ids=IDS, options=OPTIONS))
                proc.send_signal(signal.SIGTERM)
                out, err = await asyncio.to_thread(proc.communicate, timeout=60)
            finally:
                proc.kill()
        return identity, switched, refused.value, kept, out, err

    identity, switched, refused, kept, out, err = asyncio.run(main())
    want = offline(v2, IDS, OPTIONS)[0]
    assert identity.weights_version == "v2"
    for result in (switched, kept):
        assert result.weights_version == "v2"
        assert (result.samples[0].token_ids, result.samples[0].logprobs) == (want.token_ids, want.logprobs)
    assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION, refused.details()
    assert "another model config" in refused.details()
    rc, torch_loaded, kernels_loaded = out.split()
    assert rc == "0", err
    assert (torch_loaded, kernels_loaded) == ("False", "False"), err
