"""`zerokl experiment countdown`: the arms side by side, pieces that resume bitwise, the sweep, the TIS loss.

Everything at toy size on the CPU (`tiny`, 2 prompts x 4 samples): the GPU run is the same
command with --device cuda --preset small --dtype bfloat16 (docs/rl/gpu/README.md).
"""
import json
import math
import re
import subprocess
import sys

import pytest
import torch

from zerokl import experiment
from zerokl.experiment_state import TIMING_KEYS, tis_ppo_loss

TOY = ["countdown", "--device", "cpu", "--preset", "tiny", "--dtype", "float32", "--prompts", "2", "--group", "4",
       "--eval-every", "2", "--eval-prompts", "4", "--train-problems", "300", "--max-tokens", "8"]
SFT = ["--start", "sft", "--sft-steps", "3", "--sft-batch", "4", "--sft-eval-every", "3"]


def _metrics(out) -> dict[str, list[dict]]:
    arms: dict[str, list[dict]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        arms.setdefault(r["arm"], []).append(r)
    return arms


def test_cli_smoke_sft_then_three_arms_side_by_side(tmp_path):
    """CI's CPU smoke of the GPU command: SFT warm start on the device, then every arm."""
    doc = tmp_path / "rl.md"
    doc.write_text("# RL\n\nbefore\n<!-- experiment-table:begin -->\nold\n<!-- experiment-table:end -->\nafter\n")
    r = subprocess.run([sys.executable, "-m", "zerokl", "experiment", *TOY, *SFT, "--steps", "2",
                        "--arms", "zerokl,mismatch,mismatch-tis", "--out", str(tmp_path), "--update-doc", str(doc)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    arms = _metrics(tmp_path)
    assert {a: [x["step"] for x in v] for a, v in arms.items()} == \
        {"zerokl": [1, 2], "mismatch": [1, 2], "mismatch-tis": [1, 2]}
    for rec in arms["zerokl"]:
        assert rec["kl"] == 0.0 and rec["mismatched_tokens"] == 0 and rec["clip_fraction"] == 0.0
        assert rec["ratio_min"] == rec["ratio_max"] == 1.0
    # The stock backend's logprobs differ from the trainer's: the check that can fail. (A step's KL,
    # a mean of per-token log-ratios, can still come out exactly 0.0 when 1-ulp differences cancel:
    # seen on an Intel CPU at numerics 0.3.2 with 19 of 64 tokens differing.)
    for rec in arms["mismatch"]:
        assert 0 < rec["mismatched_fraction"] <= 1.0
    assert any(rec["kl"] != 0.0 for rec in arms["mismatch"])
    # Same warm start, seeds and backend: the TIS arm's first rollouts are the mismatch arm's.
    first, tis = arms["mismatch"][0], arms["mismatch-tis"][0]
    assert (tis["kl"], tis["mismatched_tokens"], tis["reward"]) == (first["kl"], first["mismatched_tokens"],
                                                                     first["reward"])
    assert 0.0 <= tis["tis_discarded_weight"] < 1.0 and tis["clip_fraction"] == 0.0
    for rec in arms["zerokl"] + arms["mismatch"]:
        assert rec["rollout_tokens"] > 0 and rec["rollout_tokens_per_s"] > 0 and rec["tokens_per_s"] > 0
    assert [rec.get("test_accuracy") is not None for rec in arms["zerokl"]] == [False, True]
    sft = json.loads((tmp_path / "sft.json").read_text())
    assert sft["recipe"]["steps"] == 3 and sft["curve"][-1]["step"] == 3
    report = (tmp_path / "report.md").read_text()
    assert "| zerokl | 2 / 2 | **0.0 at every step** | 0 of" in report and "| mismatch-tis | 2 / 2 |" in report
    # zerokl diff names where the stock path first parts from the trainer's, e.g. "layer 0 input_layernorm, token 0".
    assert re.search(r"- where the stock path first parts \(zerokl diff, first test prompt\): "
                     r"(layer \d+|model) \S+, token \d+", report)
    assert (tmp_path / "experiment.png").stat().st_size > 0
    # --update-doc replaced the marked block with the summary table, and nothing else.
    text = doc.read_text()
    assert text.startswith("# RL\n\nbefore\n<!-- experiment-table:begin -->\n") and text.endswith(
        "<!-- experiment-table:end -->\nafter\n")
    assert "old" not in text and "| zerokl | 2 / 2 | **0.0 at every step** | 0 of" in text


def test_pieces_resume_bitwise(tmp_path):
    """SFT + two arms of 2 steps in one go == the same command in pieces of 2 steps (exit 75 until done):
    the same SFT bytes, torch.equal final weights and optimizer state, identical metrics lines."""
    base = [*TOY, *SFT, "--steps", "2", "--arms", "zerokl,mismatch"]
    whole, pieces = tmp_path / "whole", tmp_path / "pieces"
    assert experiment.main([*base, "--out", str(whole)]) == 0
    codes = []
    while not codes or codes[-1] == experiment.INCOMPLETE:
        codes.append(experiment.main([*base, "--out", str(pieces), "--max-steps-this-run", "2"]))
        assert len(codes) < 10
    # SFT 1-2 | SFT 3, zerokl 1 | zerokl 2, mismatch 1 | mismatch 2: the SFT and each arm break across pieces.
    assert codes == [75, 75, 75, 0]
    sft = "state/sft-tiny-demo-float32-cpu/model.safetensors"
    assert (whole / sft).read_bytes() == (pieces / sft).read_bytes()
    for arm in ("zerokl", "mismatch"):
        a, b = (torch.load(d / "state" / f"arm-{arm}.pt", weights_only=False) for d in (whole, pieces))
        assert a["step"] == b["step"] == 2 and a["done"] and b["done"]
        for k, v in a["trainer"]["model"].items():
            assert torch.equal(v, b["trainer"]["model"][k]), k
        for i, s in a["trainer"]["optimizer"]["state"].items():
            assert all(torch.equal(s[k], b["trainer"]["optimizer"]["state"][i][k]) for k in s)
    ma, mb = _metrics(whole), _metrics(pieces)
    assert _strip(ma["zerokl"] + ma["mismatch"]) == _strip(mb["zerokl"] + mb["mismatch"])
    assert any(r["kl"] != 0.0 for r in ma["mismatch"])          # the mismatch arm resumed with its mismatch
    # A finished run re-run: nothing trained, the same report; another setting refuses the checkpoints.
    assert experiment.main([*base, "--out", str(pieces), "--max-steps-this-run", "0"]) == 0
    with pytest.raises(SystemExit, match="differs in lr"):
        experiment.main([*base, "--out", str(pieces), "--lr", "3e-4"])


def test_sweep_reports_every_point(tmp_path):
    r = experiment.main([*TOY, "--start", "scratch", "--steps", "1", "--eval-every", "0", "--sweep",
                         "--sweep-lrs", "1e-4,1e-3", "--out", str(tmp_path)])
    assert r == 0
    md = (tmp_path / "sweep.md").read_text()
    assert "| tiny-demo-lr0.0001 | 1 |" in md and "| tiny-demo-lr0.001 | 1 |" in md
    points = {json.loads(line)["point"] for line in (tmp_path / "sweep.jsonl").read_text().splitlines()}
    assert points == {"tiny-demo-lr0.0001", "tiny-demo-lr0.001"}


def _strip(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def test_processes_run_the_arms_at_once_with_the_same_bits(tmp_path):
    """--processes 2: each arm in its own process of the same command, sharing the device; the
    metrics are the one-process run's (timings aside) and the report says they shared it."""
    base = [*TOY, "--start", "scratch", "--steps", "2", "--arms", "zerokl,mismatch", "--eval-every", "0"]
    assert experiment.main([*base, "--out", str(tmp_path / "one")]) == 0
    assert experiment.main([*base, "--out", str(tmp_path / "two"), "--processes", "2"]) == 0
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert _strip(one["zerokl"] + one["mismatch"]) == _strip(two["zerokl"] + two["mismatch"])
    assert any(r["kl"] != 0.0 for r in two["mismatch"])
    assert "- arms at once: up to 2, one process each" in (tmp_path / "two" / "report.md").read_text()
    assert "arms at once" not in (tmp_path / "one" / "report.md").read_text()


def test_the_zerokl_arm_continues_the_sweep_point_of_its_setting(tmp_path):
    """The sweep's zerokl run at the main run's setting is that arm's first steps: the arm continues it
    (its first metrics line is the sweep's, wall times included) and ends where a direct run ends."""
    common = [*TOY, "--start", "scratch", "--eval-every", "0"]
    assert experiment.main([*common, "--out", str(tmp_path), "--sweep", "--steps", "1", "--sweep-lrs", "1e-4,1e-3",
                            "--processes", "2"]) == 0
    sweep = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert sorted(r["point"] for r in sweep) == ["tiny-demo-lr0.0001", "tiny-demo-lr0.001"]
    assert experiment.main([*common, "--out", str(tmp_path), "--steps", "2", "--arms", "zerokl"]) == 0
    arm = _metrics(tmp_path)["zerokl"]
    point = next(r for r in sweep if r["point"] == "tiny-demo-lr0.0001")
    assert arm[0] == {k: v for k, v in point.items() if k != "point"}
    assert experiment.main([*common, "--out", str(tmp_path / "direct"), "--steps", "2", "--arms", "zerokl"]) == 0
    assert _strip(arm) == _strip(_metrics(tmp_path / "direct")["zerokl"])


def test_a_sweep_point_that_already_ran_every_step_is_the_zerokl_arm_in_the_report(tmp_path):
    """The H200 run's case: the sweep ran the chosen point for all the arms' steps, and the arms run as
    processes; the report's zerokl arm is that point's run, every step of it (not an empty row)."""
    common = [*TOY, "--start", "scratch", "--eval-every", "0", "--steps", "2", "--state-dir", str(tmp_path / "state")]
    assert experiment.main([*common, "--out", str(tmp_path), "--sweep", "--sweep-lrs", "1e-4"]) == 0
    point = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert experiment.main([*common, "--out", str(tmp_path / "arms"), "--arms", "zerokl,mismatch",
                            "--processes", "2"]) == 0
    arms = _metrics(tmp_path / "arms")
    assert arms["zerokl"] == [{k: v for k, v in r.items() if k != "point"} for r in point]
    assert len(arms["mismatch"]) == 2
    assert "| zerokl | 2 / 2 |" in (tmp_path / "arms" / "report.md").read_text()


def test_tis_loss_truncates_and_reports_the_discarded_weight():
    # Two sequences of two tokens; pi_train / pi_infer = 0.5, 1 (equal logprobs), 3, 4 (masked out).
    train = torch.log(torch.tensor([[0.2, 0.3], [0.6, 0.4]])).requires_grad_()
    infer = train.detach() - torch.log(torch.tensor([[0.5, 1.0], [3.0, 4.0]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = tis_ppo_loss(train, infer, torch.tensor([1.0, -1.0]), mask, clip_eps=0.2, cap=2.0)
    # Weights min(ratio, 2) = 0.5, 1, 2; loss = -(0.5 + 1 - 2) / 3.
    assert math.isclose(float(loss.detach()), 0.5 / 3, rel_tol=1e-6)
    assert math.isclose(stats["tis_discarded_weight"], 1.0 / 4.5, rel_tol=1e-6)
    assert math.isclose(stats["tis_truncated_fraction"], 1 / 3, rel_tol=1e-6)
    assert math.isclose(stats["behaviour_clip_fraction"], 2 / 3, rel_tol=1e-6)
    assert stats["clip_fraction"] == 0.0 and stats["mismatched_tokens"] == 2 and stats["tokens"] == 3
    loss.backward()
    # d loss / d logprob = -weight * advantage / tokens (the ratio is 1 at the first update).
    expected = -torch.tensor([[0.5, 1.0], [-2.0, 0.0]]) / 3
    assert torch.allclose(train.grad, expected)


def test_trend_separates_a_rise_from_noise():
    flat = [0.2, 0.3] * 10
    rising = [0.1 + 0.02 * i + (0.01 if i % 2 else -0.01) for i in range(20)]
    assert abs(experiment.trend(flat)["t"]) < 2
    t = experiment.trend(rising)
    assert t["window"] == 5 and math.isclose(t["rise"], 0.304, rel_tol=1e-9) and t["t"] > 2


def test_fp8_arms_smoke(tmp_path):
    """CI's CPU smoke of the FP8 arms (`--arms zerokl-fp8,mismatch-fp8`, tiny, 2 steps): sampling
    in FP8 and training on the same FP8 forward gives KL exactly 0.0 and no mismatched token at
    every step; sampling in FP8 while training in bf16 (the industry's setup) mismatches."""
    assert experiment.main([*TOY, "--start", "shipped", "--steps", "2", "--eval-every", "0",
                            "--arms", "zerokl-fp8,mismatch-fp8", "--out", str(tmp_path)]) == 0
    arms = _metrics(tmp_path)
    assert {a: [x["step"] for x in v] for a, v in arms.items()} == {"zerokl-fp8": [1, 2], "mismatch-fp8": [1, 2]}
    for rec in arms["zerokl-fp8"]:
        assert rec["kl"] == 0.0 and rec["mismatched_tokens"] == 0 and rec["clip_fraction"] == 0.0
        assert rec["ratio_min"] == rec["ratio_max"] == 1.0
    assert any(rec["mismatched_tokens"] > 0 for rec in arms["mismatch-fp8"])
    # Same warm start, seeds and FP8 engine at step 1: the two arms sampled the same rollouts.
    assert arms["zerokl-fp8"][0]["reward"] == arms["mismatch-fp8"][0]["reward"]
    report = (tmp_path / "report.md").read_text()
    assert "| zerokl-fp8 | 2 / 2 | **0.0 at every step** | 0 of" in report and "| mismatch-fp8 | 2 / 2 |" in report
