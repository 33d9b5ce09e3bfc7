"""``zerokl serve prefill|decode`` / ``python -m zerokl.services.inference prefill|decode``.

Weights come from a checkpoint directory (``--model DIR``, a glm_moe_dsa
safetensors checkpoint) or, for demos and tests, a seeded preset (``--preset
tiny --seed 0``: the same seed gives the same weights in every process). The
weights version is ``--weights-version``, else the checkpoint directory's name,
else ``preset-<name>-seed<seed>``. The engine runs in its own process (``--engine-process``, the
default: it loads the model, owns the device and computes the numerics fingerprint there; this
process runs the gRPC server), or on a thread of the server (``--no-engine-process``; always for
``--tp`` > 1). On start one line goes to stdout,
``<service> listening on HOST:PORT ...``, which ``zerokl up`` and the tests read.

A decode server whose engine runs in its own process runs no kernel and does not import torch (nor the
numerics library) to start, serve and stop: what it knows of the model comes from the engine process
(:class:`~zerokl.services.engine.outputs.EngineInfo`). It loads torch only on the paths that make
tensors here: a KV handoff from a prefill replica, a trace (a weights version from the store is read in the
engine's process). A prefill
server, whose every answer is a KV handoff, and a server running the engine on a thread load it at start.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import pathlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from zerokl.tokenizer import Tokenizer, load_tokenizer
from zerokl.services.engine import child as engine_child
from zerokl.services.engine.outputs import EngineInfo
from zerokl.services.engine.types import EngineConfig
from zerokl.services.inference.async_engine import AsyncEngine
from zerokl.services.inference.decode import DEFAULT_HANDOFF_TIMEOUT_S, Decoder, add_decode_service
from zerokl.services.inference.replica import Replica, ServingLimits
from zerokl.services.inference.weights import WeightSwitcher
from zerokl.services.runtime.chunks import MAX_CHUNK_BYTES
from zerokl.services.runtime.dataclass_flags import add_dataclass_arguments, dataclass_from_args
from zerokl.services.runtime.info import ServiceIdentity, default_replica_id, model_config_hash
from zerokl.services.runtime.metrics import MetricsServer, set_serving_info
from zerokl.services.runtime.server import (ServiceServer, add_server_arguments, options_from_args, peer_credentials,
                                            serve)
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.vocab import COMPUTE_DTYPES

if TYPE_CHECKING:
    # Torch and the numerics library: imported by the functions that make the model (an engine on a thread of
    # this process, an engine process's factory), not at import (see the module docstring).
    from zerokl.kernels.model import Model
    from zerokl.services.engine.engine import Engine
    from zerokl.services.inference.tensor_parallel import TensorParallelGroup

__all__ = ["DEFAULT_PORTS", "DEFAULT_GIL_SWITCH_MS", "LoadedModel", "build_parser", "model_source", "load_model", "engine_from_args",
           "make_identity", "identity_from_info", "build_engine", "build_replica", "spawn_replica", "main",
           "prefill_main", "decode_main"]

DEFAULT_PORTS = {"prefill": 50051, "decode": 50052}
# The engine thread releases the interpreter in every torch call and must win it back from the event
# loop, which is busy with the last step's messages: at Python's 5 ms each such call could wait that long.
# Measured on an H200 (docs/perf.md, issue 32), one replica at 64 / 256 streams: 4.1k / 7.8k tok/s at
# 5 ms, 8.1k / 8.4k at 0.5 ms, 11.5k / 8.5k at 0.05 ms.
DEFAULT_GIL_SWITCH_MS = 0.05
# --dtype (zerokl.kernels.dtypes.COMPUTE_DTYPES) -> the dtype Model.from_pretrained is asked for. fp8:
# block-scaled e4m3 projections with bf16 activations (zerokl.kernels.model.fp8): an FP8 checkpoint as
# it is, any other quantized on load.


@dataclass
class LoadedModel:
    """A model ready to serve and the name of its weights."""

    model: Model
    weights_version: str
    tokenizer: Tokenizer | None


def build_parser(service: str) -> argparse.ArgumentParser:
    """The command line of the prefill or decode service."""
    if service not in DEFAULT_PORTS:
        raise ValueError(f"unknown inference service {service!r}")
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog=f"zerokl serve {service}",
        description=("Read prompts (Score) and stream their KV to the decode replicas the scheduler pairs with it."
                     if service == "prefill" else
                     "Generate with continuous batching, from a prefill replica's KV or the replica's own prefill."))
    m = p.add_argument_group("model")
    src = m.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="checkpoint directory (config.json + safetensors)")
    src.add_argument("--preset", help="a seeded random model of this preset (tiny, small): for demos and tests")
    m.add_argument("--seed", type=int, default=0, help="weights seed of --preset (default %(default)s)")
    m.add_argument("--dtype", choices=sorted(COMPUTE_DTYPES), default=None,
                   help="model dtype (default: the checkpoint's, float32 for a preset). fp8: block-scaled e4m3 "
                        "projections, bf16 activations (an FP8 checkpoint as it is; a bf16/fp32 one or a preset "
                        "quantized on load, deterministically); the replica reports the FP8 fingerprint")
    m.add_argument("--weights-version", default=None,
                   help="weights version to report (default: the checkpoint directory's name)")
    m.add_argument("--tokenizer", default=None,
                   help="'countdown', or a tokenizer.json path / directory (default: the checkpoint's "
                        "tokenizer.json if present; 'countdown' for a preset)")
    m.add_argument("--weight-store", metavar="ADDR", default=None,
                   help="weight-store address; enables SwitchWeights (serve another version without a restart)")
    m.add_argument("--weights-cache", metavar="DIR", default=None,
                   help="where switched-to versions are fetched (default: a temporary directory)")
    m.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    m.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel degree (1, 2, 4): this process serves and spawns N-1 followers, one "
                        "GPU each; outputs equal a --tp 1 replica's bit for bit (default %(default)s)")
    m.add_argument("--gil-switch-ms", type=float, default=DEFAULT_GIL_SWITCH_MS, metavar="MS",
                   help="the interpreter's thread switch interval: how soon an engine on a thread "
                        "(--no-engine-process, --tp > 1) gets the interpreter back from the gRPC event loop after "
                        "each torch call (Python's default is 5; default %(default)s)")
    m.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in its own process (it owns the device; the gRPC server's protobuf work "
                        "does not share its interpreter lock). --no-engine-process runs it on a thread of the "
                        "server; --tp > 1 always does (rank 0 joins the followers' collectives). Default: on")
    m.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice). Bits do not depend on it; on a "
                        "small CPU host 1 avoids threads spinning against the server's own")
    e = p.add_argument_group("engine")
    add_dataclass_arguments(e, EngineConfig)     # one flag per field, generated: --num-blocks, --no-prefix-caching, ...
    e.add_argument("--max-n", type=int, default=16, help="samples per request at most")
    e.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="after a stream's first token, send a message once N engine steps' tokens are there (or "
                        "the stream ended): fewer messages for the scheduler and clients to relay (default "
                        "%(default)s: every step)")
    if service == "prefill":
        e.add_argument("--kv-chunk-bytes", type=int, default=None,
                       help="KV chunk size streamed to decode replicas (default and maximum 4 MiB)")
    else:
        e.add_argument("--handoff-timeout", type=float, default=DEFAULT_HANDOFF_TIMEOUT_S, metavar="S",
                       help="seconds one read of a prefill replica's KV may take, prefill included, when the "
                            "scheduler names no bound (default %(default)s)")
    p.add_argument("--replica-id", default=None, help="name reported by Info (default: pod name or host-pid)")
    add_server_arguments(p, DEFAULT_PORTS[service])
    return p


def model_source(args: argparse.Namespace) -> tuple[str, str | None]:
    """The weights version and tokenizer spec the flags select, without loading the model (nor torch: a
    preset's name is checked where the model is made, :func:`load_model`)."""
    if args.model:
        directory = pathlib.Path(args.model).expanduser()
        if not (directory / "config.json").exists():
            raise SystemExit(f"--model {args.model}: no config.json there")
        version = args.weights_version or directory.resolve().name
        tok_spec = args.tokenizer or (str(directory) if (directory / "tokenizer.json").exists() else None)
    else:
        version = args.weights_version or f"preset-{args.preset}-seed{args.seed}"
        tok_spec = args.tokenizer or "countdown"
    return version, tok_spec


def load_model(args: argparse.Namespace) -> LoadedModel:
    """The model, weights version and tokenizer the flags select."""
    import torch

    from zerokl.kernels.dtypes import FP8, to_dtype
    from zerokl.kernels.model import Model, ModelConfig
    from zerokl.kernels.model.fp8 import FP8_ACTIVATIONS, quantize_fp8
    version, tok_spec = model_source(args)
    dtype = to_dtype(args.dtype) if args.dtype else None
    if args.model:
        model = Model.from_pretrained(pathlib.Path(args.model).expanduser(), dtype=dtype)
    else:
        try:
            config = ModelConfig.preset(args.preset)
        except ValueError as err:
            raise SystemExit(str(err)) from None
        if dtype == FP8:     # the bf16 preset, quantized: what `zerokl up --dtype fp8` publishes
            model = quantize_fp8(Model(config, seed=args.seed, dtype=FP8_ACTIVATIONS))
        else:
            model = Model(config, seed=args.seed, dtype=dtype or torch.float32)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device).eval()
    tokenizer = load_tokenizer(tok_spec) if tok_spec else None
    return LoadedModel(model, version, tokenizer)


def engine_from_args(args: argparse.Namespace) -> Engine:
    """The engine the flags describe, model loaded here: what an engine process runs at start."""
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    return build_engine(load_model(args), args)


def make_identity(service: str, model: Model, weights_version: str, replica_id: str | None = None) -> ServiceIdentity:
    """What this replica computes with: numerics version and fingerprint on its backend/device/dtype."""
    # The model is in this process (an engine on a thread), and so are torch and the library.
    from zerokl.kernels import __version__ as numerics_version
    from zerokl.kernels import device_name, fingerprint, get_backend
    from zerokl.kernels.dtypes import dtype_name
    from zerokl.kernels.model.fp8 import numerics_dtype
    device = model.embed_tokens.weight.device
    dtype = numerics_dtype(model)           # float8_e4m3fn for an FP8 model: its own fingerprint key
    return ServiceIdentity(
        service=service, replica_id=replica_id or default_replica_id(service), numerics_version=numerics_version,
        numerics_fingerprint=fingerprint(device=device, dtype=dtype), backend=get_backend(),
        device=device_name(), dtype=dtype_name(dtype), weights_version=weights_version,
        model_config_hash=model_config_hash(model.config.to_dict()))


def identity_from_info(service: str, info: EngineInfo, weights_version: str,
                       replica_id: str | None = None) -> ServiceIdentity:
    """:func:`make_identity` from what an engine process reported (it computed the fingerprint on its device)."""
    assert info.fingerprint is not None and info.backend is not None and info.device_name is not None
    assert info.numerics_version is not None
    return ServiceIdentity(
        service=service, replica_id=replica_id or default_replica_id(service), numerics_version=info.numerics_version,
        numerics_fingerprint=info.fingerprint, backend=info.backend, device=info.device_name,
        dtype=info.numerics_dtype, weights_version=weights_version,
        model_config_hash=model_config_hash(info.model_config))


def spawn_replica(service: str, args: argparse.Namespace) -> Replica:
    """The replica the flags describe, its engine built in an engine process (not started).

    Call it from the main thread (the engine process is armed to die with the thread that spawns it).
    """
    version, tok_spec = model_source(args)
    try:
        engine = AsyncEngine.spawn(functools.partial(engine_from_args, args), name=f"zerokl-{service}-engine",
                                   weights_version=version, threads=args.threads, started=engine_child.take())
    except RuntimeError as err:     # what the engine process said (an unknown preset, ...): its log has the rest
        raise SystemExit(str(err)) from None
    identity = identity_from_info(service, engine.info, version, args.replica_id)
    tokenizer = load_tokenizer(tok_spec) if tok_spec else None
    return Replica(engine, identity, tokenizer, ServingLimits(max_n=args.max_n, stream_interval=args.stream_interval))


def build_engine(loaded: LoadedModel, args: argparse.Namespace) -> Engine:
    """The engine the flags describe."""
    from zerokl.services.engine.engine import Engine
    config = dataclass_from_args(EngineConfig, args)
    return Engine(loaded.model, config, loaded.tokenizer)


def build_replica(service: str, loaded: LoadedModel, args: argparse.Namespace, engine: Any = None) -> Replica:
    """The engine (default: build_engine's), its async driver and the replica the flags describe
    (the driver is not started)."""
    identity = make_identity(service, loaded.model, loaded.weights_version, args.replica_id)
    return Replica(AsyncEngine(engine or build_engine(loaded, args), name=f"zerokl-{service}-engine"), identity,
                   loaded.tokenizer, ServingLimits(max_n=args.max_n, stream_interval=args.stream_interval))


def main(service: str, argv: Sequence[str] | None = None) -> int:
    """Run the prefill or decode service until SIGTERM/SIGINT; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(service)
    args = parser.parse_args(argv)
    options = options_from_args(args)
    if not args.gil_switch_ms > 0:
        parser.error("--gil-switch-ms must be > 0")
    if args.stream_interval < 1:
        parser.error("--stream-interval must be >= 1")
    sys.setswitchinterval(args.gil_switch_ms / 1000)
    tp: TensorParallelGroup | None = None
    lockstep: LockstepEngine | None = None
    if args.tp != 1:
        from zerokl.kernels.dtypes import names_fp8
        from zerokl.kernels.model.parallel import supported_tp_degrees
        from zerokl.services.inference.tensor_parallel import start_tensor_parallel
        if names_fp8(args.dtype):
            # apply_tensor_parallel shards bf16/fp32 weights; the FP8 blocks and their scales are not sharded yet.
            parser.error("--dtype fp8 serves at --tp 1 for now")
        if args.tp not in supported_tp_degrees():
            parser.error(f"--tp must be one of {supported_tp_degrees()}")
        tp = start_tensor_parallel(args.tp, service, argv, args.device)
        args.device = str(tp.device)
    if tp is None and args.engine_process:
        replica = spawn_replica(service, args)
    else:
        import torch
        engine_child.discard()   # one `zerokl serve` may have prestarted (the engine runs on a thread here)
        if args.threads:
            torch.set_num_threads(args.threads)
        loaded = load_model(args)
        if tp is not None:
            import torch.distributed as dist

            from zerokl.kernels.model.parallel import apply_tensor_parallel
            from zerokl.services.inference.tensor_parallel import LockstepEngine, follow
            apply_tensor_parallel(loaded.model, tp.compute)
            if tp.rank > 0:                           # a follower: no server, the engine in lockstep
                follow(build_engine(loaded, args), tp)
                dist.destroy_process_group()
                return 0
            lockstep = LockstepEngine(build_engine(loaded, args), tp)
        replica = build_replica(service, loaded, args, lockstep)
    chunk = MAX_CHUNK_BYTES
    if service == "prefill":
        # Its every answer is a KV handoff, made of tensors (the prefill module loads torch): loaded at start.
        from zerokl.services.inference.prefill import Prefiller, add_prefill_service
        chunk = args.kv_chunk_bytes or MAX_CHUNK_BYTES
        if not 0 < chunk <= MAX_CHUNK_BYTES:
            raise SystemExit(f"--kv-chunk-bytes must be in 1..{MAX_CHUNK_BYTES}")
    elif not args.handoff_timeout > 0:
        raise SystemExit("--handoff-timeout must be > 0")

    peers = peer_credentials(args)

    async def run() -> None:
        switcher: WeightSwitcher | None = None
        decoder: Decoder | None = None

        def setup(server: ServiceServer) -> None:
            nonlocal switcher, decoder
            replica.engine.start()
            switch = None
            if args.weight_store:
                store = WeightStoreClient(args.weight_store, token=options.auth.peer_token, credentials=peers)
                switcher = WeightSwitcher(replica, store, args.weights_cache, server.not_serving)
                switch = switcher.switch
            if service == "decode":
                # Reads of a prefill replica's KV carry the peer token (its PrefillKV is internal).
                decoder = Decoder(replica, token=options.auth.peer_token, credentials=peers,
                                  tracer_provider=server.options.tracer_provider,
                                  handoff_timeout_s=args.handoff_timeout)
                add_decode_service(server, decoder, switch)
            else:
                add_prefill_service(server, Prefiller(replica, chunk), switch)
            set_serving_info(replica.identity)

        def ready(server: ServiceServer, metrics: MetricsServer | None) -> None:
            where = f" metrics on :{metrics.port}" if metrics is not None else ""
            # One parseable line on stdout: `zerokl up` and the tests wait for it to learn the port.
            print(f"{service} listening on {server.address}{where} weights: {replica.identity.weights_version} "
                  f"fingerprint: {replica.identity.numerics_fingerprint}", flush=True)

        try:
            await serve(service, setup, options, metrics_port=args.metrics_port, metrics_host=args.host,
                        on_ready=ready)
        finally:
            if decoder is not None:
                await decoder.close()
            if switcher is not None:
                await switcher.close()
                await switcher.store.close()
            await replica.engine.close()
            if lockstep is not None:
                lockstep.stop()
                lockstep.group.close()

    asyncio.run(run())
    return 0


def prefill_main(argv: Sequence[str] | None = None) -> int:
    """`zerokl serve prefill ...`"""
    return main("prefill", argv)


def decode_main(argv: Sequence[str] | None = None) -> int:
    """`zerokl serve decode ...`"""
    return main("decode", argv)
