"""`zerokl experiment countdown` at toy size: the zerokl arm has KL exactly 0, the mismatch arm does not."""
import json
import re
import subprocess
import sys


def test_experiment_puts_both_arms_side_by_side(tmp_path):
    r = subprocess.run([sys.executable, "-m", "zerokl", "experiment", "countdown", "--steps", "2", "--prompts", "2",
                        "--group", "4", "--eval-every", "2", "--eval-prompts", "4", "--train-problems", "300",
                        "--from-scratch", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    arms = {arm: [json.loads(line) for line in (tmp_path / f"metrics-{arm}.jsonl").read_text().splitlines()]
            for arm in ("zerokl", "mismatch")}
    assert [rec["step"] for rec in arms["zerokl"]] == [rec["step"] for rec in arms["mismatch"]] == [1, 2]
    for rec in arms["zerokl"]:
        assert rec["kl"] == 0.0 and rec["mismatched_tokens"] == 0
    # The stock backend's logprobs differ from the trainer's: the check that can fail.
    assert all(rec["kl"] != 0.0 and rec["mismatched_tokens"] > 0 for rec in arms["mismatch"])
    # Same seeds and data: the first step's prompts and rewards are drawn alike.
    assert arms["zerokl"][0]["tokens"] > 0 and arms["mismatch"][0]["tokens"] > 0
    report = (tmp_path / "report.md").read_text()
    assert "| zerokl | 0 |" in report and "mismatch" in report
    # zerokl diff names where the stock path first parts from the trainer's, e.g. "layer 0 input_layernorm, token 0".
    assert re.search(r"- where the stock path first parts \(zerokl diff, first test prompt\): "
                     r"(layer \d+|model) \S+, token \d+", report)
    assert (tmp_path / "experiment.png").stat().st_size > 0
