"""``zerokl up``: every zerokl service on loopback, as child processes of one command.

    zerokl up [--workdir ~/.zerokl/up] [--preset tiny --seed 0 | --model DIR] [--port 50050]

1. starts the weight store on a local directory (``WORKDIR/weights``); when
   it holds no version yet, publishes the model (the ``tiny`` preset, seed 0,
   by default) as version ``1`` with the numerics it was made under;
2. fetches the version to serve (``--weights-version``, else the newest) into
   ``WORKDIR/models/VERSION`` and starts the decode and prefill replicas from
   it, the trainer (when this install has ``zerokl.services.trainer.server``)
   and the scheduler in front of the replicas, all at once on free loopback
   ports, each with its log in ``WORKDIR/logs``;
3. waits until every service answers grpc.health.v1 SERVING, prints a table
   of services, addresses, weights versions and fingerprints and a
   ``zerokl generate`` line to try, and writes the same to ``WORKDIR/up.json``;
4. on Ctrl-C / SIGTERM stops the children (the scheduler first, so no request
   is routed to a replica that is going away) and waits for them; a child that
   dies on its own stops everything with exit status 1.

Children run in their own session (a terminal's Ctrl-C reaches only this
process, which stops them in order) and get SIGTERM if this process dies.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Sequence

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from zerokl.services.runtime.info import ServiceIdentity, identity_from_proto
from zerokl.v1 import common_pb2

__all__ = ["DEFAULT_WORKDIR", "TRAINER_MODULE", "Child", "build_parser", "add_arguments", "main", "run"]

DEFAULT_WORKDIR = "~/.zerokl/up"
TRAINER_MODULE = "zerokl.services.trainer.server"
_HOST = "127.0.0.1"
_EXAMPLE_PROMPT = "nums 3 4 target 7"
# Stop order: the front door first, the store last (a trainer may still be publishing).
_STOP_ORDER = ("scheduler", "prefill", "decode", "trainer", "weight-store")


@dataclass
class Child:
    """One service process ``zerokl up`` runs."""

    name: str                      # "decode-0", "scheduler", ...
    service: str                   # the `zerokl serve` service
    port: int
    flags: list[str]
    log_path: pathlib.Path
    proc: subprocess.Popen | None = None
    identity: ServiceIdentity | None = None
    status: str = "starting"
    required: bool = True          # False: a failure is reported, the others keep running

    @property
    def address(self) -> str:
        return f"{_HOST}:{self.port}"

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "zerokl", "serve", self.service, *self.flags]


class UpError(RuntimeError):
    """A required service did not come up (the message says which and where its log is)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``zerokl up`` (on a subcommand parser of the CLI)."""
    p.add_argument("--workdir", default=os.environ.get("ZEROKL_UP_DIR", DEFAULT_WORKDIR),
                   help="weights, fetched models and logs live here (default $ZEROKL_UP_DIR or %(default)s)")
    m = p.add_argument_group("model (published as the first version when the weight store is empty)")
    src = m.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR", default=None, help="checkpoint directory (config.json + safetensors)")
    src.add_argument("--preset", default="tiny", help="seeded random model of this preset (default %(default)s)")
    m.add_argument("--seed", type=int, default=0, help="weights seed of --preset (default %(default)s)")
    m.add_argument("--weights-version", default=None,
                   help="version to publish into an empty store (default 1) and to serve (default: the newest)")
    s = p.add_argument_group("services")
    s.add_argument("--port", type=int, default=50050, help="scheduler port, 0 picks one (default %(default)s)")
    s.add_argument("--decode-replicas", type=int, default=1)
    s.add_argument("--prefill-replicas", type=int, default=1)
    s.add_argument("--no-trainer", action="store_true", help="do not start the trainer")
    s.add_argument("--replica-flag", action="append", default=[], metavar="FLAG",
                   help="extra `zerokl serve prefill|decode` flag for every replica, e.g. --replica-flag=--tp=2 "
                        "(repeatable)")
    s.add_argument("--trainer-flag", action="append", default=[], metavar="FLAG",
                   help="extra `zerokl serve trainer` flag, e.g. --trainer-flag=--lr=1e-3 (repeatable)")
    s.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads of each compute service (default: the CPU cores shared out "
                        "among the replicas and the trainer; threads spinning against each other on a small "
                        "host make every step many times slower, and the bits do not depend on it)")
    s.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds to wait for every service to report SERVING")
    s.add_argument("--grace", type=float, default=10.0,
                   help="seconds each service gets to finish in-flight calls when stopping")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerokl up", description="Run all zerokl services on loopback until Ctrl-C.",
                                allow_abbrev=False)
    add_arguments(p)
    return p


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_HOST, 0))
        return int(s.getsockname()[1])


# Runs in each child before the service: asks Linux for SIGTERM when `zerokl up` dies (PR_SET_PDEATHSIG,
# kept across exec), so no service outlives it, then becomes the service. A wrapper instead of
# Popen(preexec_fn=...): that is unsafe in a threaded process, and gRPC's threads run here.
_EXEC_WITH_PARENT = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):
    sys.exit("zerokl up exited before this service started")
os.execv(sys.argv[2], sys.argv[2:])
"""


def _launch(child: Child) -> None:
    child.log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = child.argv
    if sys.platform == "linux":
        argv = [sys.executable, "-c", _EXEC_WITH_PARENT, str(os.getpid()), *argv]
    with open(child.log_path, "ab") as log:  # the child keeps its own descriptor
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(child.argv)}\n".encode())
        log.flush()
        # From the main thread: PDEATHSIG fires when the forking *thread* ends.
        child.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


def _log_tail(path: pathlib.Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


async def _wait_serving(child: Child, deadline: float) -> None:
    """Wait for ``child`` to answer health SERVING and read its Info (UpError if it exits or times out)."""
    async with grpc.aio.insecure_channel(child.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            assert child.proc is not None
            if child.proc.poll() is not None:
                raise UpError(f"{child.name} exited with status {child.proc.returncode}; its log "
                              f"{child.log_path}:\n{_log_tail(child.log_path)}")
            if time.monotonic() > deadline:
                raise UpError(f"{child.name} did not report SERVING in time; its log {child.log_path}:\n"
                              f"{_log_tail(child.log_path)}")
            with contextlib.suppress(grpc.aio.AioRpcError):
                resp = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            await asyncio.sleep(0.2)
        child.identity = await _info(channel, child.service)
    child.status = "SERVING"


# The gRPC service whose Info each zerokl service answers (one request and response type everywhere).
_INFO_SERVICE = {"prefill": "zerokl.v1.Inference", "decode": "zerokl.v1.Inference",
                 "scheduler": "zerokl.v1.Inference", "weight-store": "zerokl.v1.WeightStore",
                 "trainer": "zerokl.v1.Trainer"}


async def _info(channel: grpc.aio.Channel, service: str) -> ServiceIdentity | None:
    """The service's Info (None when it does not answer one: the table shows '-')."""
    info = channel.unary_unary(f"/{_INFO_SERVICE[service]}/Info",
                               request_serializer=common_pb2.InfoRequest.SerializeToString,
                               response_deserializer=common_pb2.ServiceInfo.FromString)
    try:
        return identity_from_proto(await info(common_pb2.InfoRequest(), timeout=5))
    except (grpc.aio.AioRpcError, ValueError):
        return None


async def _prepare_weights(args: argparse.Namespace, store: Child,
                           models_dir: pathlib.Path) -> tuple[str, pathlib.Path]:
    """Publish the model into an empty store, then fetch the version to serve; (version, directory)."""
    from zerokl.services.weightstore.client import WeightStoreClient

    async with WeightStoreClient(store.address) as client:
        versions = [e.manifest.version for e in await client.list()]
        if not versions:
            version = args.weights_version or "1"
            print(f"zerokl up: the weight store is empty; publishing {_source_name(args)} as version {version}",
                  flush=True)
            await _publish(client, args, version)
            versions = [version]
        if args.weights_version and args.weights_version not in versions:
            raise UpError(f"--weights-version {args.weights_version}: the store holds {versions}, not that one")
        version = args.weights_version or (await client.manifest("latest")).version
        dest = models_dir / version
        await client.fetch(version, dest)  # resumable; files already complete and verified are kept
    return version, dest


def _source_name(args: argparse.Namespace) -> str:
    return args.model if args.model else f"the {args.preset} preset (seed {args.seed})"


async def _publish(client: object, args: argparse.Namespace, version: str) -> None:
    import torch

    from zerokl.kernels import __version__ as numerics_version
    from zerokl.kernels import fingerprint
    from zerokl.model import Model, ModelConfig

    if args.model:
        # An imported checkpoint was not trained under these numerics: no fingerprint is claimed for it.
        await client.publish(args.model, version, metadata={"source": str(args.model)})  # type: ignore[attr-defined]
        return
    try:
        model = Model(ModelConfig.preset(args.preset), seed=args.seed, dtype=torch.float32)
    except ValueError as err:
        raise UpError(str(err)) from None
    with tempfile.TemporaryDirectory(prefix="zerokl-up-") as tmp:
        model.save_pretrained(tmp)
        await client.publish(tmp, version, numerics_version=numerics_version,  # type: ignore[attr-defined]
                             numerics_fingerprint=fingerprint(dtype=torch.float32),
                             metadata={"source": f"preset-{args.preset}-seed{args.seed}"})


def _plan(args: argparse.Namespace, workdir: pathlib.Path, store: Child, version: str,
          model_dir: pathlib.Path) -> list[Child]:
    """Every service after the weight store, with its flags and port."""
    logs = workdir / "logs"
    trainer = not args.no_trainer and importlib.util.find_spec(TRAINER_MODULE) is not None
    compute = args.decode_replicas + args.prefill_replicas + int(trainer)
    threads = ["--threads", str(args.threads or max(1, (os.cpu_count() or 1) // compute))]
    # Replicas fetch from the store what they switch to (SwitchWeights: RL steps, jobs).
    model = ["--model", str(model_dir), "--weights-version", version, "--weight-store", store.address, *threads]
    if not (model_dir / "tokenizer.json").exists():
        model += ["--tokenizer", "countdown"]  # the presets speak countdown
    grace = ["--grace", str(args.grace)]
    children: list[Child] = []
    decode = [Child(f"decode-{i}", "decode", _free_port(), [], logs / f"decode-{i}.log")
              for i in range(args.decode_replicas)]
    for d in decode:
        d.flags = [*model, "--port", str(d.port), "--replica-id", d.name, *grace, *args.replica_flag]
    children += decode
    for i in range(args.prefill_replicas):
        p = Child(f"prefill-{i}", "prefill", _free_port(), [], logs / f"prefill-{i}.log")
        # Its own Generate relays to a decode replica; through the scheduler it only serves PrefillKV and Score.
        p.flags = [*model, "--port", str(p.port), "--replica-id", p.name, "--decode", decode[i % len(decode)].address,
                   *grace, *args.replica_flag]
        children.append(p)
    if trainer:
        t = Child("trainer", "trainer", _free_port(), [], logs / "trainer.log", required=False)
        t.flags = ["--weight-store", store.address, "--init", version, *threads, "--port", str(t.port),
                   "--replica-id", "trainer", *grace, *args.trainer_flag]
        children.append(t)
    port = args.port or _free_port()
    s = Child("scheduler", "scheduler", port, [], logs / "scheduler.log")
    s.flags = ["--decode", ",".join(d.address for d in decode), "--port", str(port), "--poll-interval", "0.5",
               "--replica-id", "scheduler", *grace]
    if trainer:
        s.flags += ["--trainer", t.address]
    if args.prefill_replicas:
        s.flags += ["--prefill", ",".join(c.address for c in children if c.service == "prefill")]
    children.append(s)
    return children


def _table(children: Sequence[Child]) -> str:
    rows = [("SERVICE", "ADDRESS", "PID", "WEIGHTS", "FINGERPRINT", "STATUS")]
    for c in children:
        ident = c.identity
        rows.append((c.name, c.address, str(c.proc.pid) if c.proc else "-",
                     (ident.weights_version if ident else "") or "-",
                     (ident.numerics_fingerprint if ident else "") or "-", c.status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _write_state(workdir: pathlib.Path, children: Sequence[Child]) -> None:
    """``up.json``: where each service listens (for ``zerokl status`` and scripts)."""
    state = {"pid": os.getpid(), "services": [
        {"name": c.name, "service": c.service, "address": c.address, "pid": c.proc.pid if c.proc else None,
         "log": str(c.log_path), "status": c.status,
         "weights_version": c.identity.weights_version if c.identity else "",
         "numerics_fingerprint": c.identity.numerics_fingerprint if c.identity else ""} for c in children]}
    tmp = workdir / "up.json.tmp"
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(workdir / "up.json")


def _stop(children: Sequence[Child], timeout_s: float) -> bool:
    """SIGTERM the children in stop order (each group waited for); SIGKILL what outlives the timeout.

    True when every child exited by itself (status 0, or killed by our SIGTERM before it set its handler).
    """
    clean = True
    for service in _STOP_ORDER:
        group = [c for c in children if c.service == service and c.proc is not None and c.proc.poll() is None]
        for c in group:
            c.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout_s
        for c in group:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                print(f"zerokl up: {c.name} did not stop in {timeout_s:.0f}s; killing it", file=sys.stderr)
                c.proc.kill()  # type: ignore[union-attr]
                c.proc.wait()  # type: ignore[union-attr]
                clean = False
            if c.proc.returncode not in (0, -signal.SIGTERM):  # type: ignore[union-attr]
                clean = False
            c.status = f"exited {c.proc.returncode}"  # type: ignore[union-attr]
    return clean


async def run(args: argparse.Namespace) -> int:
    """Start everything, serve until a signal or a required child's death, stop everything."""
    workdir = pathlib.Path(args.workdir).expanduser().resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if args.decode_replicas < 1 or args.prefill_replicas < 0:
        raise SystemExit("zerokl up: need at least one decode replica and no negative counts")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    store = Child("weight-store", "weight-store", _free_port(), [], workdir / "logs" / "weight-store.log")
    store.flags = ["--root", str(workdir / "weights"), "--port", str(store.port), "--replica-id", "weight-store",
                   "--grace", str(args.grace)]
    children = [store]
    waits: dict[str, asyncio.Future[None]] = {}
    status = 0
    try:
        started = time.monotonic()
        deadline = started + args.startup_timeout
        _launch(store)
        await _until(_wait_serving(store, deadline), stop)
        version, model_dir = await _until(_prepare_weights(args, store, workdir / "models"), stop)
        children += _plan(args, workdir, store, version, model_dir)
        for child in children[1:]:
            _launch(child)
        waits.update({c.name: asyncio.ensure_future(_wait_serving(c, deadline)) for c in children[1:]})
        await _until(asyncio.wait(waits.values()), stop)
        for child in children[1:]:
            err = waits[child.name].exception()
            if err is None:
                continue
            if child.required:
                raise err
            child.status = "FAILED (see log)"
            print(f"zerokl up: {child.name} did not come up, the others keep running: {err}", file=sys.stderr)
        if not any(c.service == "trainer" for c in children):
            why = "--no-trainer" if args.no_trainer else f"this install has no {TRAINER_MODULE}"
            print(f"zerokl up: not starting the trainer ({why})", flush=True)
        _write_state(workdir, children)
        scheduler = children[-1]
        print(f"zerokl up: {len(children)} services on loopback in {time.monotonic() - started:.1f}s "
              f"(workdir {workdir}, logs in {workdir / 'logs'})", flush=True)
        print(_table(children), flush=True)
        print(f"try:\n  zerokl generate --server {scheduler.address} {shlex.quote(_EXAMPLE_PROMPT)} "
              f"--max-tokens 16\nCtrl-C stops all services.", flush=True)
        while not stop.is_set():
            dead = [c for c in children if c.required and c.proc is not None and c.proc.poll() is not None]
            if dead:
                for c in dead:
                    print(f"zerokl up: {c.name} exited with status {c.proc.returncode}; stopping everything. "  # type: ignore[union-attr]
                          f"Its log {c.log_path}:\n{_log_tail(c.log_path)}", file=sys.stderr)
                status = 1
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
    except UpError as err:
        print(f"zerokl up: {err}", file=sys.stderr)
        status = 1
    except grpc.aio.AioRpcError as err:  # the weight store refused to publish or fetch
        print(f"zerokl up: weight store {store.address}: {err.code().name}: {err.details()}", file=sys.stderr)
        status = 1
    except _Stopped:
        pass
    finally:
        for wait in waits.values():
            wait.cancel()
        await asyncio.gather(*waits.values(), return_exceptions=True)
        print("zerokl up: stopping services ...", flush=True)
        clean = await asyncio.to_thread(_stop, children, args.grace + 10.0)
        with contextlib.suppress(OSError):
            (workdir / "up.json").unlink()
        print("zerokl up: stopped" + ("" if clean else " (some services did not exit cleanly; see their logs)"),
              flush=True)
    return status


class _Stopped(Exception):
    """A signal arrived while starting up."""


async def _until(awaitable: object, stop: asyncio.Event):  # noqa: ANN202 - the awaitable's result
    """``awaitable``'s result, or :class:`_Stopped` if a stop signal arrives first."""
    task = asyncio.ensure_future(awaitable)  # type: ignore[arg-type]
    stopper = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise _Stopped
    finally:
        stopper.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def main(argv: Sequence[str] | None = None) -> int:
    """``zerokl up`` as a function (the CLI calls :func:`run` with its own parsed flags)."""
    return asyncio.run(run(build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))))


# ----------------------------------------------------------------------------- zerokl status

async def _probe(entry: dict) -> dict:
    """Live health and identity of one service listed in up.json."""
    row = {"name": entry["name"], "service": entry["service"], "address": entry["address"],
           "health": "UNREACHABLE", "weights_version": "", "numerics_fingerprint": "", "numerics_version": ""}
    async with grpc.aio.insecure_channel(entry["address"]) as channel:
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            row["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.aio.AioRpcError:
            return row
        ident = await _info(channel, entry["service"])
        if ident is not None:
            row.update(weights_version=ident.weights_version, numerics_fingerprint=ident.numerics_fingerprint,
                       numerics_version=ident.numerics_version)
    return row


def status(workdir: str, as_json: bool = False) -> int:
    """`zerokl status`: each service's health, address, fingerprint and weights version.

    Exit status 0 only when every service is SERVING and the compute services agree on one
    numerics fingerprint and one weights version.
    """
    path = pathlib.Path(os.path.expanduser(workdir)) / "up.json"
    if not path.exists():
        print(f"no running `zerokl up` found ({path} does not exist)", file=sys.stderr)
        return 1
    entries = json.loads(path.read_text())["services"]
    rows = asyncio.run(_gather_probes(entries))
    compute = [r for r in rows if r["service"] != "weight-store"]
    fingerprints = sorted({r["numerics_fingerprint"] for r in compute})
    versions = sorted({r["weights_version"] for r in compute})
    healthy = all(r["health"] == "SERVING" for r in rows)
    ok = healthy and len(fingerprints) == 1 and len(versions) == 1 and fingerprints[0] != ""
    if as_json:
        print(json.dumps({"ok": ok, "fingerprints": fingerprints, "weights_versions": versions, "services": rows}, indent=2))
    else:
        table = [("SERVICE", "ADDRESS", "HEALTH", "WEIGHTS", "FINGERPRINT")]
        table += [(r["name"], r["address"], r["health"], r["weights_version"] or "-", r["numerics_fingerprint"] or "-")
                  for r in rows]
        widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
        print("\n".join("  ".join(v.ljust(w) for v, w in zip(t, widths)).rstrip() for t in table))
        print(f"{'OK' if ok else 'NOT OK'}: {sum(r['health'] == 'SERVING' for r in rows)}/{len(rows)} serving, "
              f"fingerprints {fingerprints or ['-']}, weights versions {versions or ['-']}")
    return 0 if ok else 1


async def _gather_probes(entries: list[dict]) -> list[dict]:
    return list(await asyncio.gather(*(_probe(e) for e in entries)))
