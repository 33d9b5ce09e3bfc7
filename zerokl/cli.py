"""The `zerokl` command line.

    zerokl verify [--backend torch|triton|all]   batch-invariance self-test on this machine
    zerokl info                                   numerics version and fingerprints
    zerokl serve prefill|decode|weight-store ...  run one service (`zerokl serve decode --help`)
    zerokl up [--workdir DIR]                     every service on loopback until Ctrl-C
    zerokl generate [PROMPT | --prompt-ids 1,2,3] stream a completion from a prefill or decode replica
    zerokl doctor --kube [--namespace N] [--release R]  a Kubernetes release's replicas agree on their numbers
"""
from __future__ import annotations

import argparse
import importlib
import asyncio
import json
import os
import signal
import sys
from typing import Any, Callable

__all__ = ["main"]


def _verify(args: argparse.Namespace) -> int:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from tqdm import tqdm

    from zerokl.kernels import INVARIANT_BACKENDS, __version__
    from zerokl.kernels.verify import OP_CASES, check_golden, check_op, format_table

    backends = list(INVARIANT_BACKENDS) if args.backend == "all" else [args.backend]
    checks = [(b, name) for b in backends for name in OP_CASES]
    parity = []
    if not args.ops_only:
        from zerokl.kernels.model.verify import PARITY_CHECKS
        parity = [(b, name) for b in backends for name in PARITY_CHECKS]
    rows = []
    for backend, name in tqdm(checks + parity, desc="verify", unit="check", disable=args.quiet):
        if name in OP_CASES:
            r = check_op(OP_CASES[name], backend, args.seed)
            rows.append((backend, name, r.cases, r.mismatches))
        else:
            cases, mismatches = PARITY_CHECKS[name](backend, args.seed)
            rows.append((backend, name, cases, mismatches))
    if "torch" in backends:   # the CPU primitives against their references (kernels/zerokl/kernels/portable_check.py)
        from zerokl.kernels.portable_check import check_primitives
        rows += [("torch", f"primitive: {r.name}", r.cases, r.mismatches) for r in check_primitives()]
    print(f"zerokl numerics {__version__}")
    print(format_table(rows))
    bad = sum(m for *_, m in rows)
    goldens = [check_golden(b) for b in backends]
    for g in goldens:
        print(g.describe())
    bad += sum(len(g.changed) for g in goldens)
    print("OK: zero mismatches" if bad == 0 else f"FAIL: {bad} mismatching rows or golden ops")
    return 0 if bad == 0 else 1


def _info(args: argparse.Namespace) -> int:
    from zerokl.kernels import __version__, default_backend, device_name, fingerprint
    print(f"numerics_version  {__version__}")
    print(f"device            {device_name()}")
    print(f"default_backend   {default_backend()}")
    print(f"fingerprint       {fingerprint()}")
    return 0


# service name -> module whose main(argv) runs it (imported on use: each pulls its own deps)
SERVICES = {
    "prefill": "zerokl.services.inference.server:prefill_main",
    "decode": "zerokl.services.inference.server:decode_main",
    "weight-store": "zerokl.services.weightstore.server:main",
    "trainer": "zerokl.services.trainer.server:main",
    "scheduler": "zerokl.services.routing.server:main",
    "tinker": "zerokl.services.tinker_api.server:main",
}


def _serve(args: argparse.Namespace) -> int:
    # Each service owns its flags; everything after the service name is passed through.
    _service_logging()
    if args.service in ("prefill", "decode") and "--no-engine-process" not in args.args \
            and not {"-h", "--help"} & set(args.args) and _tp_degree(args.args) == 1:
        # The engine process imports torch while this one starts (its own imports, the flags); the server takes
        # it, or stops it when it runs the engine on a thread after all (--tp > 1).
        from zerokl.services.engine.child import prestart
        prestart()
    module, func = SERVICES[args.service].split(":")
    return getattr(importlib.import_module(module), func)(args.args)


def _service_logging() -> None:
    """zerokl's own log records from INFO up on stderr (a service's log file under `zerokl up`), each with its time
    and level: what a service did (a version recorded, an export closed, a replica switched) is in its log, not
    only its warnings. Other libraries keep Python's default (warnings and up)."""
    import logging
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    ours = logging.getLogger("zerokl")
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False      # once: an engine core on a thread also configures the root logger


def _tp_degree(argv: list[str]) -> int:
    """The --tp a `zerokl serve` command line asks for (1 when absent or unreadable: the server says why)."""
    for i, a in enumerate(argv):
        value = a.split("=", 1)[1] if a.startswith("--tp=") else argv[i + 1] if a == "--tp" and i + 1 < len(argv) \
            else None
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return 1
    return 1


def _up(args: argparse.Namespace) -> int:
    from zerokl.up import run
    return asyncio.run(run(args))


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from zerokl.vocab import SamplingOptions
    from zerokl.services.inference.client import InferenceClient
    from zerokl.connect import connect
    from zerokl.services.inference.types import GenerateResult, InferenceRequest

    if (args.prompt is None) == (args.prompt_ids is None):
        print("error: give a prompt text or --prompt-ids (one of them)", file=sys.stderr)
        return 2
    options = SamplingOptions(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        max_tokens=args.max_tokens, stop=tuple(args.stop), stop_token_ids=args.stop_token_ids, n=args.n,
        ignore_eos=args.ignore_eos, prompt_logprobs=args.prompt_logprobs)
    request = InferenceRequest(prompt_ids=args.prompt_ids, prompt_text=args.prompt, options=options,
                               request_id=args.request_id or "", weights_version=args.weights_version or "",
                               numerics_fingerprint=args.numerics_fingerprint or "")

    where = connect(args)

    async def run() -> GenerateResult:
        deltas = []
        async with InferenceClient(where.target, token=where.security.token,
                                   credentials=where.security.credentials()) as client:
            async for d in client.generate(request, timeout=args.timeout):
                deltas.append(d)
                if not args.json and args.n == 1 and d.text:
                    print(d.text, end="", flush=True)
        return GenerateResult.collect(deltas)

    try:
        result = asyncio.run(run())
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    if args.json:
        print(json.dumps(_result_json(result)))
        return 0
    if args.n == 1:
        print()
    else:
        for s in result.samples:
            print(f"[{s.index}] {s.text}")
    reasons = ",".join(str(s.finish_reason) for s in result.samples)
    print(f"finish_reason={reasons} tokens={result.usage.completion_tokens} weights={result.weights_version} "
          f"fingerprint={result.numerics_fingerprint}", file=sys.stderr)
    return 0


def _result_json(result: Any) -> dict[str, Any]:
    """The --json object: sample 0's fields at the top level, every sample under "samples"."""
    def sample(s: Any) -> dict[str, Any]:
        out = {"index": s.index, "token_ids": s.token_ids, "logprobs": s.logprobs, "text": s.text,
               "finish_reason": s.finish_reason}
        if s.prompt_logprobs is not None:
            out["prompt_logprobs"] = s.prompt_logprobs
        return out

    samples = [sample(s) for s in result.samples]
    first = {k: v for k, v in samples[0].items() if k != "index"} if samples else {}
    return {"request_id": result.request_id, **first, "samples": samples,
            "usage": {"prompt_tokens": result.usage.prompt_tokens,
                      "completion_tokens": result.usage.completion_tokens,
                      "cached_tokens": result.usage.cached_tokens},
            "weights_version": result.weights_version, "numerics_fingerprint": result.numerics_fingerprint}


class _WholeFlagsParser(argparse.ArgumentParser):
    """An ArgumentParser that matches flags whole, never by prefix (`--dp=2` is not `--dpo-beta 2`).

    Sub-command parsers are made with the class of their parent (``add_subparsers``'s default
    ``parser_class``), so every parser under `zerokl` refuses abbreviations, nested ones too.
    An unknown flag is reported by the command it was given to (its usage, not `zerokl`'s), with
    the flag of that command it most resembles: `zerokl generate --max-token 3` says
    "unrecognized arguments: --max-token (did you mean --max-tokens?)" and runs nothing.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            chain = _chosen_parsers(self, parsed)
            hints = _flag_hints(chain, unknown)
            chain[-1].error(f"unrecognized arguments: {' '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else ""))
        return parsed


def _chosen_parsers(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> list[argparse.ArgumentParser]:
    """``parser`` and the sub-command parsers ``parsed`` went through, outermost first."""
    chain = [parser]
    while True:
        subs = [a for a in chain[-1]._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(parsed, subs[0].dest, None) if subs else None
        if not subs or chosen not in subs[0].choices:
            return chain
        chain.append(subs[0].choices[chosen])


def _flag_hints(chain: list[argparse.ArgumentParser], unknown: list[str]) -> list[str]:
    """What each unknown flag given to the command ``chain[-1]`` was likely meant to be: a flag of an
    enclosing command given after its sub-command ("--server is a flag of zerokl jobs: give it
    before list"), else the command's own flag it most resembles ("did you mean --max-tokens?": the
    one flag it begins, else the nearest by difflib's ratio, at least 0.6, of the flags it begins if
    any, else of all). No hint for no likely match."""
    import difflib

    def flags(p: argparse.ArgumentParser) -> list[str]:
        return [f for a in p._actions for f in a.option_strings if f.startswith("--")]

    own, hints = flags(chain[-1]), []
    for arg in unknown:
        if not arg.startswith("--"):
            continue
        name = arg.split("=", 1)[0]
        outer = next((p for p in reversed(chain[:-1]) if name in flags(p)), None)
        if outer is not None:
            hint = f"{name} is a flag of {outer.prog}: give it before {chain[chain.index(outer) + 1].prog.split()[-1]}"
        else:
            begun = [f for f in own if f.startswith(name)]
            close = begun if len(begun) == 1 else difflib.get_close_matches(name, begun or own, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else ""
        if hint and hint not in hints:
            hints.append(hint)
    return hints


# Commands whose modules import torch when loaded: their flags are added only when the command is
# the one chosen, so the light commands (status, jobs, generate, serve's parsing) start without
# loading torch (~2 s of CPU each call). name -> (module, one-line help).
_TORCH_COMMANDS = {
    "experiment": ("zerokl.experiment", "the same RL run with zerokl numerics and with mismatched inference"),
    "diff": ("zerokl.diff", "name the first op (layer, op, token) where two computations of the same tokens part"),
}


def _command_of(argv: list[str]) -> str | None:
    """The sub-command named in argv (the first argument that is not a flag), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `zerokl` parser; `argv` (default sys.argv[1:]) says which command's flags to load."""
    chosen = _command_of(list(sys.argv[1:] if argv is None else argv))
    p = _WholeFlagsParser(prog="zerokl", description="RL post-training and serving with train/inference KL exactly 0")
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="batch-invariance and three-path parity self-test on this machine")
    v.add_argument("--backend", choices=["torch", "triton", "all"], default="all",
                   help="which backend's ops to check (all: each one this machine can run; default %(default)s)")
    v.add_argument("--seed", type=int, default=0, help="seed of the random inputs and model (default %(default)s)")
    v.add_argument("--ops-only", action="store_true", help="skip the model parity checks")
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    v.set_defaults(run=_verify)
    i = sub.add_parser("info", help="numerics version, device and fingerprint")
    i.set_defaults(run=_info)

    s = sub.add_parser("serve", help="run one service: " + ", ".join(SERVICES),
                       description="Run one service until SIGTERM/SIGINT. "
                                   "`zerokl serve SERVICE --help` lists its flags.")
    s.add_argument("service", choices=sorted(SERVICES), help="the service to run")
    s.add_argument("args", nargs=argparse.REMAINDER, help="the service's own flags")
    s.set_defaults(run=_serve)

    from zerokl import up
    u = sub.add_parser("up", help="run every service on loopback (weight store, replicas, trainer, scheduler)",
                       description="Start the weight store (publishing the model as version 1 when it is empty), "
                                   "decode and prefill replicas, the trainer and the scheduler as child processes "
                                   "on loopback; print where each listens; stop them all on Ctrl-C/SIGTERM.")
    up.add_arguments(u)
    u.set_defaults(run=_up)

    st = sub.add_parser("status", help="health, address, fingerprint and weights version of `zerokl up`'s services")
    st.add_argument("--workdir", default=os.environ.get("ZEROKL_UP_DIR", "~/.zerokl/up"),
                    help="the `zerokl up` workdir (default $ZEROKL_UP_DIR or %(default)s)")
    st.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    st.add_argument("--wait", type=float, default=0.0, metavar="S",
                    help="wait up to S seconds for every service to be SERVING on one version (a `zerokl up` "
                         "still starting, a service restarting), then report (default: report now)")
    from zerokl.connect import add_connection_arguments, add_security_arguments, client_security
    from zerokl.services.runtime.dataclass_flags import int_list
    add_security_arguments(st)
    st.set_defaults(run=lambda a: up.status(a.workdir, a.json, client_security(a), a.wait))

    from zerokl import doctor
    dr = sub.add_parser("doctor", help="check that every replica of a Kubernetes release reports the same numerics "
                                       "fingerprint and weights version",
                        description="List a release's pods (kubeconfig or in-cluster), ask each for its Info over "
                                    "gRPC, print a table; exit 1 naming any pod that differs from the majority.")
    doctor.add_arguments(dr)
    dr.set_defaults(run=doctor.run)

    from zerokl import demo
    d = sub.add_parser("demo", help="GRPO on countdown through the five services with exact zero KL; writes a report")
    demo.add_arguments(d)
    d.set_defaults(run=demo.run)
    from zerokl import jobs_cli
    j = sub.add_parser("jobs", help="submit, follow, list and cancel SFT/RL jobs on the scheduler",
                       description=jobs_cli.__doc__.splitlines()[0])
    jobs_cli.add_arguments(j)
    j.set_defaults(run=jobs_cli.run)
    for name, (module_name, help_line) in _TORCH_COMMANDS.items():
        c = sub.add_parser(name, help=help_line)
        if name == chosen:
            module = importlib.import_module(module_name)
            c.description = module.__doc__.splitlines()[0]
            module.add_arguments(c)
            c.set_defaults(run=module.run)

    g = sub.add_parser(
        "generate", help="stream a completion through the scheduler (or straight from a decode replica)",
        description="Stream a completion. --json prints ONE object instead: token_ids, logprobs, text, "
                    "finish_reason (of sample 0), samples (every sample, each with index, token_ids, logprobs, "
                    "text, finish_reason, and prompt_logprobs when asked), usage, request_id, weights_version "
                    "and numerics_fingerprint. Logprobs are the exact fp32 values; a prompt token outside "
                    "top-k/top-p has logprob -Infinity.")
    g.add_argument("prompt", nargs="?", default=None, help="prompt text (encoded by the server's tokenizer)")
    g.add_argument("--prompt-ids", type=int_list, default=None, metavar="1,2,3", help="prompt token ids")
    add_connection_arguments(g, "the scheduler (as `zerokl up` starts it) or of a replica")
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, 1 = off (default %(default)s)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=0,
                   help="with the sample index and position, fixes every draw (default %(default)s)")
    g.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per sample (default %(default)s)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=int_list, default=(), metavar="1,2",
                   help="extra token ids that end a sample (included in the output, like eos)")
    g.add_argument("--n", type=int, default=1, help="samples of the prompt")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past eos")
    g.add_argument("--prompt-logprobs", action="store_true", help="also return the prompt tokens' logprobs")
    g.add_argument("--request-id", default=None, help="the id to abort or trace it by (default: generated)")
    g.add_argument("--weights-version", default=None, help="refuse unless the server serves this version")
    g.add_argument("--numerics-fingerprint", default=None, help="refuse unless the server has this fingerprint")
    g.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(run=_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one `zerokl` command; its exit status.

    A reader that closes our stdout early (`zerokl jobs watch ID | head`) ends the command as it
    ends `cat` or `seq`: quietly, no traceback, with the status a process killed by SIGPIPE
    shows in a shell (128 + 13 = 141); gRPC calls in flight are cancelled as the command unwinds."""
    try:
        args = build_parser(argv).parse_args(argv)
        run: Callable[[argparse.Namespace], int] = args.run
        status = run(args)
        sys.stdout.flush()            # what is still buffered fails here, not at interpreter exit
        return status
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush has nowhere to fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
