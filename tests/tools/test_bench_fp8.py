"""tools/bench/bench_fp8.py's CPU smoke runs (the Triton interpreter, tiny shapes): the grid and the
tile-config sweep run and write their JSON, and a config that cannot launch is reported and skipped,
so the script cannot rot between GPU runs. (No timing is asserted: figures come from GPU runs.)"""
import importlib.util
import json
import os
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The smoke runs interpret the kernels on the CPU; a CUDA process has them compiled (and runs the bench itself).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke runs need the Triton interpreter")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_fp8", ROOT / "tools" / "bench" / "bench_fp8.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_grid_and_sweep_write_their_rows(tmp_path):
    bench = _bench()
    assert bench.main(["--smoke", "--json", str(tmp_path / "grid.json")]) == 0
    rows = json.loads((tmp_path / "grid.json").read_text())["rows"]
    assert [(r["n"], r["k"], r["m"]) for r in rows] == [(n, k, m) for n, k in bench.SMOKE_SHAPES for m in bench.SMOKE_MS]
    assert all(r["invariant"] for r in rows)
    assert bench.main(["--smoke", "--sweep", "--ms", "70", "--json", str(tmp_path / "sweep.json")]) == 0
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert len(result["sweep"]) == len(bench.smoke_candidates()) * len(bench.SMOKE_SHAPES)
    assert all(r["bit_identical"] for r in result["sweep"])          # the interpreter's block dot is exact
    assert all(b["best"] is not None and b["table_vs_cublaslt"] is not None for b in result["best"])


def test_a_config_that_does_not_launch_is_reported_and_skipped():
    bench = _bench()
    from zerokl.kernels import use_backend
    from zerokl.kernels.triton.fp8 import Fp8GemmConfig as C
    with use_backend("triton"):
        rows, best = bench.sweep([(200, 96)], [3], "cpu", bench._timer(smoke=True), [C(64, 96, 4, 3), C(64, 64, 4, 3)])
    assert "error" in rows[0] and rows[1]["bit_identical"]          # a 96-wide tile is no power of two
    assert best[0]["best"] == {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "GROUP_M": 8, "TMA": False,
                                 "PROGRAMS_PER_SM": 0}


def test_smoke_grouped_sweep_checks_every_config_against_the_tables_bits(tmp_path):
    """--sweep-grouped (the MoE experts' grouped GEMM): every config's rows, each checked against the table's
    config's bits; no TMA or persistent config among them (the grouped launch loads by pointer)."""
    bench = _bench()
    assert bench.main(["--smoke", "--sweep-grouped", "--tokens", "3", "--json", str(tmp_path / "grouped.json")]) == 0
    result = json.loads((tmp_path / "grouped.json").read_text())
    assert len(result["sweep_grouped"]) == len(bench.grouped_candidates()[::4]) * len(bench.SMOKE_GROUPED_SHAPES)
    assert all(r["bit_identical"] and r["rows"] == 3 * 4 for r in result["sweep_grouped"])   # 3 tokens x 4 experts
    assert not any(r["config"]["TMA"] or r["config"]["PROGRAMS_PER_SM"] for r in result["sweep_grouped"])
    assert [r["in_table"] for r in result["sweep_grouped"]].count(True) == 1
