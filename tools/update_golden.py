"""Record golden-vector digests for this machine's backends and dtypes.

    python tools/update_golden.py            # refresh tests/assets/golden/numerics.json

The file pins the bits of every op per (backend, device type, dtype). When an op's
bits change, tests/kernels/test_golden.py fails until you (1) bump
kernels/zerokl/kernels/version.py, (2) add a changelog line for the new version to NUMERICS.md,
and (3) run this tool. It refuses to record changed bits under an unchanged
version. GPU entries are recorded the same way on a GPU machine.

    python tools/update_golden.py --backends torch --carry-over

after a bump whose bit changes are confined to the backends recorded here (the changelog
line says why): the other keys' digests are kept, their fingerprints re-derived under the
new version (a fingerprint is a hash of the version and the digests), so a GPU entry need
not wait for a GPU machine. Their golden tests still run there and say if that was wrong.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "assets" / "golden" / "numerics.json"
GOLDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)   # the keys' dtypes (FP8: the FP8 model's)


def current_entries(backends: list[str]) -> dict[str, dict]:
    from zerokl.kernels import use_backend
    from zerokl.kernels.fingerprint import fingerprint, fingerprint_key, golden_digests
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for backend in backends:
        for dtype in GOLDEN_DTYPES:
            with use_backend(backend):
                out[fingerprint_key(backend, dtype=dtype)] = {
                    "fingerprint": fingerprint(backend, device, dtype),
                    "digests": golden_digests(device, dtype),
                }
    return out


def changelog_has(version: str) -> bool:
    text = (ROOT / "NUMERICS.md").read_text()
    return re.search(rf"^- \*\*{re.escape(version)}\*\*", text, re.M) is not None


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description="record golden-vector digests")
    ap.add_argument("--backends", default="torch,triton", help="comma-separated backends to record on this machine")
    ap.add_argument("--carry-over", action="store_true",
                    help="after a version bump, keep the other keys' digests (their bits did not change) under the new version")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        import os
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from zerokl.kernels.version import __version__
    if not changelog_has(__version__):
        print(f"NUMERICS.md has no changelog line '- **{__version__}** ...': add one first")
        return 1
    data = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"numerics_version": __version__, "entries": {}}
    fresh = current_entries(args.backends.split(","))
    if data["numerics_version"] == __version__:
        changed = [k for k, v in fresh.items() if k in data["entries"] and data["entries"][k]["digests"] != v["digests"]]
        if changed:
            print(f"bits changed under unchanged numerics version {__version__} for {changed}: bump kernels/zerokl/kernels/version.py")
            return 1
    elif args.carry_over:
        from zerokl.kernels.fingerprint import fingerprint_of
        kept = {k: {"digests": v["digests"], "fingerprint": fingerprint_of(v["digests"])} for k, v in data["entries"].items()}
        data = {"numerics_version": __version__, "entries": kept}
    else:
        data = {"numerics_version": __version__, "entries": {}}   # old-version digests no longer apply
    data["entries"].update(fresh)
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"recorded {len(fresh)} entries for numerics {__version__} in {GOLDEN.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
