"""Golden vectors: any change to an op's bits fails here until the numerics version is bumped."""
import json
import pathlib
import re

import pytest
import torch

from zerokl.kernels import __version__, use_backend
from zerokl.kernels.fingerprint import fingerprint_key, fingerprint_of, golden_digests

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = json.loads((ROOT / "tests" / "assets" / "golden" / "numerics.json").read_text())


def test_golden_file_is_for_this_numerics_version():
    assert GOLDEN["numerics_version"] == __version__, (
        f"numerics version is {__version__} but golden vectors are for {GOLDEN['numerics_version']}: "
        "run `python tools/update_golden.py` on each device type")


def test_changelog_names_this_version():
    text = (ROOT / "NUMERICS.md").read_text()
    assert re.search(rf"^- \*\*{re.escape(__version__)}\*\*", text, re.M), f"NUMERICS.md changelog lacks {__version__}"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_bits_match_golden(backend, dtype):
    key = fingerprint_key(backend, dtype=dtype)
    if key not in GOLDEN["entries"]:
        pytest.skip(f"no golden vectors recorded for {key} (run tools/update_golden.py on such a machine)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with use_backend(backend):
        got = golden_digests(device, dtype)
    want = GOLDEN["entries"][key]["digests"]
    changed = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    assert not changed, (
        f"bits changed for {changed} on {key}: if intended, bump kernels/zerokl/kernels/version.py, add a NUMERICS.md "
        "changelog line and run tools/update_golden.py")
    # fingerprint() is fingerprint_of(golden_digests(...)): the digests above, not computed twice
    assert fingerprint_of(got) == GOLDEN["entries"][key]["fingerprint"]
