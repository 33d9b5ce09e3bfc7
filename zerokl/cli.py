"""The `zerokl` command line.

    zerokl verify [--backend torch|triton|all]   batch-invariance self-test on this machine
    zerokl info                                   numerics version and fingerprints
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

__all__ = ["main"]


def _verify(args: argparse.Namespace) -> int:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from tqdm import tqdm

    from zerokl.kernels import BACKENDS, device_name, fingerprint, __version__
    from zerokl.kernels.verify import OP_CASES, check_op, format_table

    backends = list(BACKENDS) if args.backend == "all" else [args.backend]
    checks = [(b, name) for b in backends for name in OP_CASES]
    parity = []
    if not args.ops_only:
        from zerokl.model.verify import PARITY_CHECKS
        parity = [(b, name) for b in backends for name in PARITY_CHECKS]
    rows = []
    for backend, name in tqdm(checks + parity, desc="verify", unit="check", disable=args.quiet):
        if name in OP_CASES:
            r = check_op(OP_CASES[name], backend, args.seed)
            rows.append((backend, name, r.cases, r.mismatches))
        else:
            cases, mismatches = PARITY_CHECKS[name](backend, args.seed)
            rows.append((backend, name, cases, mismatches))
    print(f"zerokl numerics {__version__} on {device_name()}")
    print(format_table(rows))
    bad = sum(m for *_, m in rows)
    for b in backends:
        print(f"fingerprint[{b}] = {fingerprint(b)}")
    print("OK: zero mismatches" if bad == 0 else f"FAIL: {bad} mismatching rows")
    return 0 if bad == 0 else 1


def _info(args: argparse.Namespace) -> int:
    from zerokl.kernels import __version__, default_backend, device_name, fingerprint
    print(f"numerics_version  {__version__}")
    print(f"device            {device_name()}")
    print(f"default_backend   {default_backend()}")
    print(f"fingerprint       {fingerprint()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerokl", description="RL post-training and serving with train/inference KL exactly 0")
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="batch-invariance and three-path parity self-test on this machine")
    v.add_argument("--backend", choices=["torch", "triton", "all"], default="all")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--ops-only", action="store_true", help="skip the model parity checks")
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    v.set_defaults(run=_verify)
    i = sub.add_parser("info", help="numerics version, device and fingerprint")
    i.set_defaults(run=_info)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
