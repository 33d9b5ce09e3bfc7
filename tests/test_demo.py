"""`zerokl demo` end to end at toy size through the five services: progress, exact-zero KL per step, the report."""
import json
import subprocess
import sys


def test_demo_writes_a_report_with_zero_kl(tmp_path):
    r = subprocess.run([sys.executable, "-m", "zerokl", "demo", "--sft-steps", "2", "--sft-batch", "8", "--steps", "2",
                        "--prompts", "2", "--group", "4", "--eval-every", "2", "--eval-prompts", "4",
                        "--train-problems", "300", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records] == [1, 2]
    # Each step trained on the version the fleet served and published the next one.
    assert [rec["weights_version"] for rec in records] == ["countdown-step000003", "countdown-step000004"]
    assert "test_accuracy" in records[1]
    assert "weight-store" in r.stdout and "scheduler" in r.stdout  # the five services were started
    for rec in records:
        assert {"step", "reward", "kl", "clip_fraction", "tokens_per_s", "weights_version"} <= rec.keys()
        assert rec["kl"] == 0.0 and rec["mismatched_tokens"] == 0
    assert " kl 0.0 clip_fraction 0 mismatched_tokens 0 " in r.stdout + r.stderr
    assert "hyperparameters: lr 0.0001 " in r.stdout + r.stderr          # the demo's, as the trainer uses it
    for name in ("report.md", "reward.png", "kl.png", "clip_fraction.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "KL exactly 0 at every step: **yes**" in (tmp_path / "report.md").read_text()
