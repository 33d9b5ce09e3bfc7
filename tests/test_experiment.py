"""`zerokl experiment countdown`: the arms side by side, pieces that resume bitwise, the sweep, the map's
cells (estimators, corrections, the routing-flip arm, search-trace answers, RL seeds).

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
from zerokl.experiment_state import TELEMETRY_KEYS, TIMING_KEYS

TOY = ["countdown", "--device", "cpu", "--preset", "tiny", "--dtype", "float32", "--prompts", "2", "--group", "4",
       "--eval-every", "2", "--eval-prompts", "4", "--train-problems", "300", "--max-tokens", "8"]
SFT = ["--start", "sft", "--sft-steps", "3", "--sft-batch", "4", "--sft-eval-every", "3"]


def _telemetry_is_recorded(arms: dict[str, list[dict]]) -> None:
    """Every step of every arm carries the stability telemetry; a zerokl arm's says its numbers are exact."""
    for arm, records in arms.items():
        for rec in records:
            assert {"grad_norm", "entropy", "max_abs_log_ratio", "low_prob_fraction"} <= set(rec), arm
            assert math.isfinite(rec["grad_norm"]) and rec["entropy"] > 0.0 and 0.0 <= rec["low_prob_fraction"] <= 1.0
            if arm.startswith("zerokl"):
                assert rec["kl"] == 0.0 and rec["mismatched_tokens"] == 0 and rec["max_abs_log_ratio"] == 0.0
            if "-" in arm and arm.rsplit("-", 1)[-1] in ("tis", "mis"):
                assert {k for k in TELEMETRY_KEYS if k.startswith("correction")} <= set(rec), arm


def _metrics(out) -> dict[str, list[dict]]:
    arms: dict[str, list[dict]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        arms.setdefault(r["arm"], []).append(r)
    return arms


def test_cli_smoke_sft_then_three_arms_side_by_side(tmp_path):
    """CI's CPU smoke of the GPU command: SFT warm start on the device, then the GRPO-clip arms (with the
    token-level corrections: truncated and masked IS)."""
    doc = tmp_path / "rl.md"
    doc.write_text("# RL\n\nbefore\n<!-- experiment-table:begin -->\nold\n<!-- experiment-table:end -->\nafter\n")
    r = subprocess.run([sys.executable, "-m", "zerokl", "experiment", *TOY, *SFT, "--steps", "2",
                        "--arms", "zerokl,mismatch,mismatch-tis,mismatch-mis", "--out", str(tmp_path),
                        "--update-doc", str(doc)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    arms = _metrics(tmp_path)
    assert {a: [x["step"] for x in v] for a, v in arms.items()} == \
        {"zerokl": [1, 2], "mismatch": [1, 2], "mismatch-tis": [1, 2], "mismatch-mis": [1, 2]}
    _telemetry_is_recorded(arms)
    for rec in arms["zerokl"]:
        assert rec["kl"] == 0.0 and rec["mismatched_tokens"] == 0 and rec["clip_fraction"] == 0.0
        assert rec["ratio_min"] == rec["ratio_max"] == 1.0
    # The stock backend's logprobs differ from the trainer's: the check that can fail. (A step's KL,
    # a mean of per-token log-ratios, can still come out exactly 0.0 when 1-ulp differences cancel:
    # seen on an Intel CPU at numerics 0.3.2 with 19 of 64 tokens differing.)
    for rec in arms["mismatch"]:
        assert 0 < rec["mismatched_fraction"] <= 1.0
    assert any(rec["kl"] != 0.0 for rec in arms["mismatch"])
    # Same warm start, seeds and backend: the corrected arms' first rollouts are the mismatch arm's.
    first = arms["mismatch"][0]
    for corrected in ("mismatch-tis", "mismatch-mis"):
        c = arms[corrected][0]
        assert (c["kl"], c["mismatched_tokens"], c["reward"]) == (first["kl"], first["mismatched_tokens"],
                                                                  first["reward"])
        assert 0.0 <= c["correction_discarded_weight"] < 1.0 and c["clip_fraction"] == 0.0
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


def test_trend_separates_a_rise_from_noise():
    flat = [0.2, 0.3] * 10
    rising = [0.1 + 0.02 * i + (0.01 if i % 2 else -0.01) for i in range(20)]
    assert abs(experiment.trend(flat)["t"]) < 2
    t = experiment.trend(rising)
    assert t["window"] == 5 and math.isclose(t["rise"], 0.304, rel_tol=1e-9) and t["t"] > 2


def test_fp8_arms_smoke(tmp_path):
    """CI's CPU smoke of the FP8 arms (`--arms zerokl-fp8,mismatch-fp8,mismatch-fp8-seq-mis`, tiny, 2 steps): sampling
    in FP8 and training on the same FP8 forward gives KL exactly 0.0 and no mismatched token at
    every step; sampling in FP8 while training in bf16 (the industry's setup) mismatches."""
    assert experiment.main([*TOY, "--start", "shipped", "--steps", "2", "--eval-every", "0",
                            "--arms", "zerokl-fp8,mismatch-fp8,mismatch-fp8-seq-mis", "--out", str(tmp_path)]) == 0
    arms = _metrics(tmp_path)
    assert {a: [x["step"] for x in v] for a, v in arms.items()} == \
        {"zerokl-fp8": [1, 2], "mismatch-fp8": [1, 2], "mismatch-fp8-seq-mis": [1, 2]}
    # A correction on FP8 rollouts: the same first rollouts as the uncorrected arm, the update re-weighted.
    assert arms["mismatch-fp8-seq-mis"][0]["kl"] == arms["mismatch-fp8"][0]["kl"]
    assert 0.0 <= arms["mismatch-fp8-seq-mis"][0]["correction_dropped_fraction"] <= 1.0
    for rec in arms["zerokl-fp8"]:
        assert rec["kl"] == 0.0 and rec["mismatched_tokens"] == 0 and rec["clip_fraction"] == 0.0
        assert rec["ratio_min"] == rec["ratio_max"] == 1.0
    _telemetry_is_recorded(arms)
    assert any(rec["mismatched_tokens"] > 0 for rec in arms["mismatch-fp8"])
    # Same warm start, seeds and FP8 engine at step 1: the two arms sampled the same rollouts.
    assert arms["zerokl-fp8"][0]["reward"] == arms["mismatch-fp8"][0]["reward"]
    report = (tmp_path / "report.md").read_text()
    assert "| zerokl-fp8 | 2 / 2 | **0.0 at every step** | 0 of" in report and "| mismatch-fp8 | 2 / 2 |" in report


def test_reinforce_with_the_routing_flip_arm_and_masked_is_on_search_trace_answers(tmp_path):
    """CI's CPU smoke of a map cell (`--cell reinforce-router-trace`: REINFORCE without a clip; rollouts whose
    MoE routers run in bf16; sequence-level masked IS; search-trace answers on 4-number problems) at toy
    scale: the zerokl arm exact at every step, the routing-flip arm's flipped router decisions measured;
    then --map assembles the map from the cells run into one folder (this one)."""
    out = tmp_path / "reinforce-router-trace"
    assert experiment.main([*TOY, "--cell", "reinforce-router-trace", *SFT, "--sft-steps", "1", "--sft-batch", "2",
                            "--steps", "2", "--max-tokens", "12", "--train-problems", "60", "--out", str(out)]) == 0
    arms = _metrics(out)
    assert set(arms) == {"zerokl", "mismatch-router", "mismatch-router-seq-mis"}
    _telemetry_is_recorded(arms)
    for rec in arms["zerokl"]:
        assert "router_flip_fraction" not in rec and rec["clip_fraction"] == 0.0
    flips = [rec["router_flip_fraction"] for rec in arms["mismatch-router"] + arms["mismatch-router-seq-mis"]]
    assert all(0.0 <= f < 0.5 for f in flips) and any(f > 0.0 for f in flips)
    assert all(rec["router_decisions"] > 0 for rec in arms["mismatch-router"])
    run = json.loads((out / "run.json").read_text())
    assert run["setting"]["estimator"] == "reinforce" and run["setting"]["answers"] == "trace"
    assert run["setting"]["difficulty"] == "hard" and run["setting"]["max_tokens"] == 12      # the flag after the cell
    report = (out / "report.md").read_text()
    assert "- cell: reinforce-router-trace:" in report and "Stability telemetry" in report
    assert (out / "state" / "cells" / "reinforce-router-trace" / "arm-zerokl.pt").exists()
    sft = json.loads((out / "sft.json").read_text())
    assert sft["recipe"]["answers"] == "trace"
    assert experiment.main(["countdown", "--map", str(tmp_path)]) == 0
    table = (tmp_path / "map.md").read_text()
    # The outcome row: final reward and greedy test accuracy of the pair (binomial s.e. over 4 problems).
    assert re.search(r"\| reinforce-router-trace \| mismatch-router \| 1 × 2 \| \d\.\d{3} / \d\.\d{3} \| "
                     r"\d\.\d{3} ± \d\.\d{3} / \d\.\d{3} ± \d\.\d{3} \|", table)
    assert "| reinforce-router-trace | mismatch-router-seq-mis | 1 × 2 |" in table
    # The telemetry rows: the contract for the zerokl arm, the flips for the routing-flip arm.
    assert "| reinforce-router-trace | zerokl | **0.0 at every step** | 0 of " in table
    assert re.search(r"\| reinforce-router-trace \| mismatch-router \| [^|]+ \| [\d,]+ of [\d,]+ \([\d.]+%\) \|"
                     r" [^|]+ \| [^|]+ \| [\d.]+ → [\d.]+ \| [\d.]+% \| [\d.]+% \| - \|", table)
    assert "| clip-bf16 | not run |" in table
    assert (tmp_path / "map.png").stat().st_size > 0 and (tmp_path / "map-telemetry.png").stat().st_size > 0


def test_gspo_over_two_rl_seeds_reports_mean_and_standard_error(tmp_path):
    """CI's CPU smoke of the sequence-level estimator (GSPO) and of --seeds: each arm once per RL seed from the
    same warm start, the report's mean ± s.e. over seeds and each arm's difference to its zerokl partner."""
    assert experiment.main([*TOY, "--start", "shipped", "--steps", "2", "--eval-every", "2", "--estimator", "gspo",
                            "--arms", "zerokl,mismatch-seq-mis", "--seeds", "0,1", "--out", str(tmp_path)]) == 0
    units = _units(tmp_path)
    assert sorted(units) == ["mismatch-seq-mis-seed0", "mismatch-seq-mis-seed1", "zerokl-seed0", "zerokl-seed1"]
    _telemetry_is_recorded({u: v for u, v in units.items()})
    # The seeds sample different rollouts; a pair shares its seed's (the same first-step rewards).
    assert units["zerokl-seed0"][0]["reward"] == units["mismatch-seq-mis-seed0"][0]["reward"]
    assert [r["seed"] for r in units["zerokl-seed1"]] == [1, 1]
    report = (tmp_path / "report.md").read_text()
    assert "Over RL seeds (mean ± standard error" in report
    assert re.search(r"\| mismatch-seq-mis \| 2 \| [+-]\d\.\d{3} ± \d\.\d{3} \|", report)
    with pytest.raises(SystemExit, match="seq-mis"):
        experiment.main([*TOY, "--start", "shipped", "--estimator", "gspo", "--arms", "zerokl,mismatch-tis",
                         "--out", str(tmp_path / "refused")])


def test_the_map_says_whether_the_mismatch_hurts_over_seeds(tmp_path):
    """--map's statistics on a cell's metrics lines: a mismatched arm whose reward falls while its zerokl
    partner's rises, on each of two seeds, is "lower" beyond 2 s.e. of the seeds' spread; the ± of the final
    reward and test accuracy are over seeds; a cell still running is marked incomplete."""
    cell = tmp_path / "clip-bf16"
    cell.mkdir()
    lines = []
    for seed in (0, 1):
        for arm, slope in (("zerokl", 0.01), ("mismatch", -0.01 - 0.002 * seed)):
            for step in range(1, 21):
                lines.append({"arm": arm, "seed": seed, "step": step, "reward": 0.3 + slope * step + 0.002 * seed,
                              "kl": 0.0 if arm == "zerokl" else 1e-3, "tokens": 100,
                              "mismatched_tokens": 0 if arm == "zerokl" else 40, "grad_norm": 1.0 + seed,
                              "test_accuracy": (0.5 + 0.1 * seed if arm == "zerokl" else 0.2) if step == 20 else None,
                              "entropy": 0.5, "max_abs_log_ratio": 0.0 if arm == "zerokl" else 0.3,
                              "low_prob_fraction": 0.01})
    (cell / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (cell / "run.json").write_text(json.dumps({"complete": False, "setting": {"eval_prompts": 128}}))
    table = experiment.write_map(tmp_path)
    row = next(line for line in table.splitlines() if line.startswith("| clip-bf16 (incomplete) | mismatch |"))
    # Final reward: the last 5 steps' mean per seed (zerokl 0.48 and 0.482, mismatch 0.12 and 0.086), ± their
    # s.e. over the 2 seeds; the rises' differences -0.30 and -0.33.
    assert "| 2 × 20 | 0.481 ± 0.001 / 0.103 ± 0.017 | 0.550 ± 0.050 / 0.200 ± 0.000 |" in row
    assert "| -0.315 ± 0.015 | **yes**: the rise is lower by 0.315 (21.0 s.e.) |" in row
    assert "| clip-bf16 | zerokl | **0.0 at every step** | 0 of 4,000 (0.0%) | 0 | 1.5 ± 0.500 |" in table
    assert ("| clip-bf16 | mismatch | 0.001 | 1,600 of 4,000 (40.0%) | 0.3 | 1.5 ± 0.500 | 0.500 → 0.500 | 1.00% |"
            in table)


def _units(out) -> dict[str, list[dict]]:
    units: dict[str, list[dict]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        units.setdefault(f"{r['arm']}-seed{r['seed']}", []).append(r)
    return units


def test_the_grid_lists_at_least_eight_cells_each_a_zerokl_mismatched_pair(capsys):
    assert experiment.main(["countdown", "--grid"]) == 0
    table = capsys.readouterr().out
    assert len(experiment.CELLS) >= 8
    for name, (_, flags) in experiment.CELLS.items():
        assert f"--cell {name} " in table
        arms = flags[flags.index("--arms") + 1].split(",")
        numerics = [experiment.NUMERICS[experiment.parse_arm(a)[0]] for a in arms]
        assert numerics[0].exact and any(not n.exact for n in numerics), name
        # Every arm of every cell is a valid estimator/correction pair.
        estimator = flags[flags.index("--estimator") + 1]
        for a in arms:
            experiment.PolicyObjective(estimator=estimator, correction=experiment.parse_arm(a)[1])
    # Together the cells cover every estimator, every rollout numerics, both answer lengths and two learning rates.
    every = [x for _, flags in experiment.CELLS.values() for x in flags]
    assert {"grpo-clip", "reinforce", "gspo"} <= set(every) and {"short", "trace"} <= set(every)
    assert {"1e-5", "1e-4"} <= set(every)
    arms = {a for _, flags in experiment.CELLS.values() for a in flags[flags.index("--arms") + 1].split(",")}
    assert {experiment.parse_arm(a)[0] for a in arms} == set(experiment.NUMERICS)
    assert {experiment.parse_arm(a)[1] for a in arms} == {"none", "tis", "mis", "seq-mis"}
