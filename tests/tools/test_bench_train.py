"""tools/bench/bench_train.py's CPU smoke run: every part and arm runs and the report is written,
so the script cannot rot between GPU runs. (No timing is asserted: figures come from GPU runs.)"""
import importlib.util
import json
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "tools" / "bench" / "bench_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_runs_every_part_and_writes_the_report(tmp_path):
    bench = _bench()
    assert bench.main(["--smoke", "--device", "cpu", "--out", str(tmp_path), "--profile", "small/zerokl/torch"]) == 0
    results = json.loads((tmp_path / "bench_train.json").read_text())
    rows = {(r["part"], r["name"]): r for r in results["rows"]}
    assert {("small", "zerokl/torch"), ("small", "zerokl/stock"), ("slice", "zerokl/torch"),
            ("long", "zerokl/torch")} <= rows.keys()
    for key in [("small", "zerokl/torch"), ("slice", "zerokl/torch"), ("long", "zerokl/torch")]:
        assert rows[key]["tokens_per_s"] > 0 and 0 < rows[key]["mfu"] < rows[key]["mfu_with_attention"]
    assert "profile_top" in rows[("small", "zerokl/torch")]
    for part in ("small", "slice"):          # the FP8 arms, beside the bf16 ones
        fp8 = rows[(part, "zerokl/torch/fp8")]
        assert fp8["tokens_per_s"] > 0 and fp8["vs_bf16"] > 0 and "FP8" in fp8["note"]
    hf = rows.get(("small", "transformers"))
    if hf is not None and "skipped" not in hf:
        assert hf["tokens_per_s"] > 0 and rows[("small", "zerokl/torch")]["vs_transformers"] > 0
    table = (tmp_path / "bench_train.md").read_text()
    assert table.count("\n| ") >= 5 and "zerokl/stock" in table
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench_train.png").stat().st_size > 0


def test_device_init_is_deterministic_and_initializes_every_tensor():
    bench = _bench()
    from zerokl.kernels.model import ModelConfig
    c = ModelConfig.preset("tiny")
    a, b = bench.build_model(c, "cpu", torch.float32, seed=1), bench.build_model(c, "cpu", torch.float32, seed=1)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y) and bool(torch.isfinite(x).all()), name
    from zerokl.kernels.model import Model
    assert torch.equal(a.inv_freq, Model(c).inv_freq)
    assert a.layers[1].mlp.gate.weight.dtype == torch.float32
