"""`zerokl diff` as a command: in-process sides, trace files, --json, exit statuses, ULP distances.
(Over gRPC, replica against trainer: tests/services/inference/test_diff_trace.py.)"""
from __future__ import annotations

import json

import pytest
import torch

from zerokl.cli import main
from zerokl.diff import compare, parse_side, ulp_distance
from zerokl.kernels.trace import Trace

IDS = "5,6,7,8,9,10,11"


def test_identical_sides_exit_0_and_name_no_divergence(capsys):
    assert main(["diff", "local:tiny", "local:tiny,seed=0", "--prompt-ids", IDS, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical"] is True and report["first_divergence"] is None
    assert report["token_ids"] == [5, 6, 7, 8, 9, 10, 11]
    assert [row["layer"] for row in report["layers"]] == [0, 1, 2, 3, -1]
    assert all(row["differing_ops"] == 0 for row in report["layers"])


def test_the_stock_backend_parts_from_the_invariant_one_at_a_named_op(capsys, tmp_path):
    code = main(["diff", "local:tiny", "local:tiny,backend=stock", "--prompt-ids", IDS, "--json",
                 "--save", str(tmp_path)])
    assert code == 1
    report = json.loads(capsys.readouterr().out)
    first = report["first_divergence"]
    assert report["identical"] is False and report["b"]["backend"] == "stock"
    assert first["op"] and first["token"] in first["tokens"] and first["a"] != first["b"]
    assert first["ulp"] >= 1
    # The saved traces compare the same way offline, and the text report names the spot.
    a, b = (str(tmp_path / f"{n}.json") for n in "ab")
    assert main(["diff", a, b, "--prompt-ids", IDS]) == 1
    text = capsys.readouterr().out
    where = "model" if first["layer"] == -1 else f"layer {first['layer']}"
    assert f"first divergence: {where}, {first['op']}, token {first['token']}" in text
    assert "ULP apart" in text and "first differing op" in text
    assert main(["diff", a, a, "--prompt-ids", IDS]) == 0


def test_a_bf16_side_parts_from_an_fp32_one_at_the_embedding(capsys):
    assert main(["diff", "local:tiny", "local:tiny,dtype=bfloat16", "--prompt-ids", IDS, "--json"]) == 1
    first = json.loads(capsys.readouterr().out)["first_divergence"]
    assert (first["layer"], first["op"], first["token"]) == (-1, "embed_tokens", 0)
    assert (first["a_dtype"], first["b_dtype"]) == ("float32", "bfloat16")
    # The bf16 embedding is the fp32 one rounded: 0 ULP of bf16 apart once A is rounded too.
    assert (first["ulp"], first["ulp_dtype"]) == (0, "bfloat16")


def test_sides_that_cannot_be_compared_exit_2(capsys, tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(Trace([5, 6], [], {}).to_json()))
    assert main(["diff", str(path), "local:tiny", "--prompt-ids", IDS]) == 2
    assert "different tokens" in capsys.readouterr().err
    assert main(["diff", "local:tiny", "local:tiny"]) == 2
    assert main(["diff", "127.0.0.1:1", "local:tiny", "--prompt-ids", IDS]) == 2
    with pytest.raises(ValueError):
        parse_side("local:tiny,colour=red")


def test_ulp_distance():
    one = torch.tensor(1.0)
    assert ulp_distance(one, one) == 0
    assert ulp_distance(one, torch.nextafter(one, torch.tensor(2.0))) == 1
    assert ulp_distance(torch.tensor(-0.0), torch.tensor(0.0)) == 0
    tiny = torch.tensor(1e-45)                                     # the smallest subnormal
    assert ulp_distance(-tiny, tiny) == 2
    assert ulp_distance(torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(1.0078125, dtype=torch.bfloat16)) == 1
    assert ulp_distance(one, torch.tensor(1.0, dtype=torch.bfloat16)) is None
    assert ulp_distance(torch.tensor(3), torch.tensor(4)) is None
    assert ulp_distance(one, torch.tensor(float("nan"))) is None


def test_an_op_missing_on_one_side_is_a_difference():
    from zerokl.kernels.trace import OpTrace
    op = OpTrace(0, "mlp", "float32", (2,), [1, 2])
    extra = OpTrace(0, "mlp.extra", "float32", (2,), [3, 4])
    report = compare(Trace([5, 6], [op], {}), Trace([5, 6], [op, extra], {}))
    assert not report.identical and report.first is None and report.only_in_b == ["0:mlp.extra"]
