"""``zerokl serve trainer`` / ``python -m zerokl.services.trainer``.

Checkpoints go to a weight store: a local directory used in-process
(``--weights-dir``, the embedded default, ``$ZEROKL_WEIGHTS_DIR`` or
``~/.zerokl/weights``) or a weight-store service (``--weight-store ADDR``).

On start the trainer RESUMES: if its run (``--run``) has published a version
with trainer state, it continues from the newest one (weights, adapters,
optimizer, step, lineage and the run's TrainConfig; hyperparameter flags that
differ are reported and ignored), so a restarted trainer neither loses nor
repeats a step. Otherwise it starts from ``--init``:

- ``preset:NAME[:seedN]``: a seeded random model of a preset; its weights
  version is ``preset-NAME-seedN``, the name an inference replica started with
  ``--preset NAME --seed N`` reports, so rollouts from such a replica are on-policy;
- a checkpoint directory (config.json + safetensors): version = its name;
- otherwise a version in the weight store (or ``latest``).

On start one line goes to stdout, ``trainer listening on HOST:PORT ...``,
which ``zerokl up`` and the tests read.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import pathlib
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import Sequence

import torch

from zerokl.kernels import __version__ as numerics_version
from zerokl.kernels import device_name, fingerprint, get_backend
from zerokl.kernels.dtypes import dtype_name, names_fp8
from zerokl.kernels.model import Model, ModelConfig
from zerokl.kernels.model.fp8 import numerics_dtype
from zerokl.services.runtime.dataclass_flags import add_dataclass_arguments, dataclass_from_args
from zerokl.services.runtime.errors import InvalidArgument
from zerokl.services.runtime.info import ServiceIdentity, default_replica_id, model_config_hash
from zerokl.services.runtime.metrics import MetricsServer, set_serving_info
from zerokl.services.runtime.server import ServiceServer, add_server_arguments, options_from_args, serve
from zerokl.services.trainer.checkpointing import (
    LineageEntry,
    WeightsRepo,
    find_resume_point,
    load_serving_model,
    open_repo,
    read_checkpoint,
)
from zerokl.services.trainer.recorder import DELTA_BASES, RecordWorker
from zerokl.services.trainer.service import MEMORY_HISTORY_ENV, TrainerLimits, TrainerService, add_trainer_service
from zerokl.services.trainer.config import TrainConfig
from zerokl.services.trainer.trainer import Trainer
from zerokl.services.weightstore.versions import segment_index, validate_name
from zerokl.vocab import InvalidOption

__all__ = ["DEFAULT_PORT", "DEFAULT_INIT", "build_parser", "train_config_from_args", "start_trainer",
           "make_identity", "main"]

log = logging.getLogger(__name__)

DEFAULT_PORT = 50053
DEFAULT_INIT = "preset:tiny:seed0"
_PRESET = re.compile(r"preset:([A-Za-z0-9_-]+)(?::seed(\d+))?")


def build_parser() -> argparse.ArgumentParser:
    """The trainer's command line."""
    p = argparse.ArgumentParser(prog="zerokl serve trainer", allow_abbrev=False,
                                description="SFT, DPO and GRPO/PPO-clip on the serving forward, over gRPC.")
    j = p.add_argument_group("job")
    j.add_argument("--run", default=os.environ.get("ZEROKL_RUN", "default"),
                   help="name of the job; versions are published as <run>-step<N> and a restart resumes the "
                        "run's newest one (default $ZEROKL_RUN or %(default)s)")
    j.add_argument("--record-deltas", default="previous", choices=DELTA_BASES,
                   help="record each shared version's files as deltas, so the store writes what changed: against "
                        "the version recorded before (previous, the default: the record process keeps its files "
                        "whole on disk), against the version the trainer started from (start: no copy kept, hard "
                        "links into a local store; each delta grows with the job until a record goes mostly whole, "
                        "which the next ones then go against), or whole (off)")
    j.add_argument("--init", default=DEFAULT_INIT,
                   help="starting weights when the run has nothing to resume: preset:NAME[:seedN], a checkpoint "
                        "directory, or a weight-store version (default %(default)s)")
    s = p.add_argument_group("weight store")
    where = s.add_mutually_exclusive_group()
    where.add_argument("--weight-store", metavar="ADDR", help="host:port of a weight-store service")
    where.add_argument("--weights-dir", metavar="DIR", default=None,
                       help="local version directory used in-process (default $ZEROKL_WEIGHTS_DIR or "
                            "~/.zerokl/weights)")
    s.add_argument("--weight-store-root", metavar="DIR", default=None,
                   help="with --weight-store: the store's own directory (its --root) when this host sees it; the "
                        "trainer's fetches then hard-link the files it holds whole instead of copying them (each "
                        "checked against the manifest; `zerokl up` sets it)")
    s.add_argument("--weight-store-wait", type=float, default=30.0,
                   help="seconds to wait for the weight-store service to answer at start (default %(default)s)")
    t = p.add_argument_group("training (a resumed run keeps its own)")
    add_dataclass_arguments(t, TrainConfig)          # one flag per field, generated
    par = p.add_argument_group("parallelism (zerokl.services.trainer.distributed; world = dp * tp ranks)")
    par.add_argument("--dp", type=int, default=1, metavar="N",
                     help="data-parallel ranks (FSDP2: weights, gradients and AdamW state sharded) (default %(default)s)")
    par.add_argument("--tp", type=int, default=1, metavar="M",
                     help="tensor-parallel ranks (1, 2, 4; the exact split-tree layout) (default %(default)s)")
    par.add_argument("--ep", type=int, default=1, metavar="E",
                     help="expert-parallel ranks out of the dp ranks (all-to-all dispatch; divides --dp) "
                          "(default %(default)s)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--max-batch-tokens", type=int, default=TrainerLimits().max_batch_tokens,
                   help="prompt + completion ids per request at most (default %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice). No bit depends on it: logprobs, "
                        "gradients and updates are the same at any count (NUMERICS.md). On a small CPU host 1 "
                        "avoids threads spinning against the server's own")
    p.add_argument("--replica-id", default=None, help="name reported by Info (default: pod name or host-pid)")
    add_server_arguments(p, DEFAULT_PORT)
    return p


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the flags describe."""
    return dataclass_from_args(TrainConfig, args)


def make_identity(model: Model, weights_version: str, replica_id: str | None = None) -> ServiceIdentity:
    """What this trainer computes with (the same fields an inference replica reports)."""
    device = model.embed_tokens.weight.device
    dtype = numerics_dtype(model)           # float8_e4m3fn for the FP8 forward: the FP8 replicas' fingerprint key
    return ServiceIdentity(
        service="trainer", replica_id=replica_id or default_replica_id("trainer"), numerics_version=numerics_version,
        numerics_fingerprint=fingerprint(device=device, dtype=dtype), backend=get_backend(),
        device=device_name(device), dtype=dtype_name(dtype), weights_version=weights_version,
        model_config_hash=model_config_hash(model.config.to_dict()))


@dataclass
class Started:
    """A trainer ready to serve: how it got its weights, for the listening line and logs."""

    service: TrainerService
    resumed_from: str | None


def _device(args: argparse.Namespace) -> torch.device:
    """The device of --device (default: cuda if available, else cpu), checked before anything loads."""
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:
        raise SystemExit(f"--device {args.device}: {err}") from None
    if device.type == "cuda" and os.environ.get(MEMORY_HISTORY_ENV) == "1":
        # Every device allocation's stack kept, so a ForwardBackward that runs out of memory says where each live
        # block was made (TrainerService._device_memory_report).
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    return device


async def _init_model(spec: str, repo: WeightsRepo, device: torch.device) -> tuple[Model, str]:
    """The starting model of --init on `device` and the version name it is known by."""
    m = _PRESET.fullmatch(spec)
    if m:
        seed = int(m.group(2) or 0)
        try:
            config = ModelConfig.preset(m.group(1))
        except ValueError as err:
            raise SystemExit(f"--init {spec}: {err}") from None
        return Model(config, seed=seed).to(device), f"preset-{m.group(1)}-seed{seed}"
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise SystemExit(f"--init {spec}: no config.json in that directory")
        return await asyncio.to_thread(load_serving_model, path, device), path.resolve().name
    with tempfile.TemporaryDirectory(prefix="zerokl-trainer-init-") as tmp:
        manifest = await repo.fetch(spec, pathlib.Path(tmp))
        return await asyncio.to_thread(load_serving_model, tmp, device), manifest.version


async def start_trainer(args: argparse.Namespace, repo: WeightsRepo) -> Started:
    """Resume the run from its newest resume point, or start it from --init."""
    config = train_config_from_args(args)
    device = _device(args)
    limits = TrainerLimits(max_batch_tokens=args.max_batch_tokens)
    point = await find_resume_point(repo, args.run)
    if point is not None:
        with tempfile.TemporaryDirectory(prefix="zerokl-trainer-resume-") as tmp:
            manifest = await repo.fetch(point.version, pathlib.Path(tmp))
            ckpt = await asyncio.to_thread(read_checkpoint, tmp, restore_state=True, config=config, run=args.run,
                                          device=device)
        trainer = ckpt.trainer
        differ = [f.name for f in dataclasses.fields(TrainConfig)
                  if getattr(trainer.config, f.name) != getattr(config, f.name)]
        if differ:
            print(f"trainer: resuming run {args.run} with its own config; ignoring flags that differ: "
                  f"{', '.join(differ)}", file=sys.stderr, flush=True)
        lineage = ckpt.lineage
        if not lineage or lineage[-1] != LineageEntry(manifest.version, trainer.step):
            lineage.append(LineageEntry(manifest.version, trainer.step))
        identity = make_identity(trainer.model, manifest.version, args.replica_id)
        service = TrainerService(trainer, repo, run=args.run, lineage=lineage, identity=identity, limits=limits,
                                 segment=ckpt.run if segment_index(args.run, ckpt.run) is not None else "",
                                 recorder=RecordWorker(args, deltas=args.record_deltas))
        # Pinned again (idempotent): the resume point the run depends on is never garbage-collected.
        await service.pin_resume_point(manifest.version)
        return Started(service, manifest.version)
    model, version = await _init_model(args.init, repo, device)
    trainer = await asyncio.to_thread(Trainer, model, config)
    identity = make_identity(model, version, args.replica_id)
    service = TrainerService(trainer, repo, run=args.run, lineage=[LineageEntry(version, 0)], identity=identity,
                             limits=limits, recorder=RecordWorker(args, deltas=args.record_deltas))
    return Started(service, None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the trainer until SIGTERM/SIGINT; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        train_config_from_args(args).check()
    except InvalidOption as err:
        flag = "betas" if err.field in ("beta1", "beta2") else err.field
        parser.error(f"--{flag.replace('_', '-')}: {err.field} {err}")
    group = None
    if args.dp * args.tp > 1 or args.ep > 1:
        from zerokl.kernels.model.parallel import supported_tp_degrees
        from zerokl.services.trainer.distributed import ENV_RANK, Layout, start_group
        layout = Layout(args.dp, args.tp, args.ep)
        try:
            layout.check()
        except ValueError as err:
            parser.error(str(err))
        if args.tp not in supported_tp_degrees():
            parser.error(f"--tp must be one of {supported_tp_degrees()}")
        if args.lora_rank > 0 or args.kl_coef > 0:
            parser.error("--dp/--tp/--ep train full weights without a reference (--lora-rank 0, --kl-coef 0)")
        if names_fp8(args.dtype):
            parser.error("--dtype fp8 trains in one process for now (--dp/--tp/--ep 1)")
        if args.micro_batch_tokens:
            parser.error("--dp/--tp/--ep take each rank's share in one forward + backward (--micro-batch-tokens 0: "
                         "ranks splitting their shares differently would wait on each other's collectives)")
        if args.threads:
            torch.set_num_threads(args.threads)
        group = start_group(layout, argv, args.device)
        args.device = str(group.device)
        if group.rank > 0:                   # a follower: no server; rank 0's calls in lockstep
            from zerokl.services.trainer.distributed import run_follower
            run_follower(group)
            return 0
    options = options_from_args(args)
    try:
        validate_name(args.run, "--run")
    except InvalidArgument as err:
        raise SystemExit(str(err)) from None
    if args.threads:
        torch.set_num_threads(args.threads)

    async def run() -> None:
        repo = await open_repo(args)
        try:
            started = await start_trainer(args, repo)
            if group is not None:      # rank 0: shard the trainer over the group, serve it in lockstep
                from zerokl.services.trainer.distributed import serve_distributed
                started.service = await asyncio.to_thread(serve_distributed, started.service, group)
        except BaseException:
            await repo.close()
            raise
        service = started.service

        def setup(server: ServiceServer) -> None:
            add_trainer_service(server, service)
            set_serving_info(service.identity)

        def ready(server: ServiceServer, metrics: MetricsServer | None) -> None:
            where = f" metrics on :{metrics.port}" if metrics is not None else ""
            how = f"resumed from {started.resumed_from}" if started.resumed_from else f"init {args.init}"
            # One parseable line on stdout: `zerokl up` and the tests wait for it to learn the port.
            print(f"trainer listening on {server.address}{where} run: {args.run} step: {service.trainer.step} "
                  f"weights: {service.identity.weights_version} fingerprint: "
                  f"{service.identity.numerics_fingerprint} ({how}; store: {repo.describe()})", flush=True)

        try:
            await serve("trainer", setup, options, metrics_port=args.metrics_port, metrics_host=args.host,
                        on_ready=ready)
        finally:
            await service.close()
            if group is not None:
                group.close()

    asyncio.run(run())
    return 0
