"""Weights version names: built, read back byte for byte, validated with the store's messages."""
from __future__ import annotations

import pytest

from zerokl.services.runtime import InvalidArgument
from zerokl.services.weightstore.versions import WeightsVersion, run_segment, segment_index


def test_the_trainers_and_the_in_process_forms():
    assert str(WeightsVersion("countdown", 3)) == "countdown-step000003"
    assert str(WeightsVersion("job.2", 1234567)) == "job.2-step1234567"      # more digits than the width
    assert str(WeightsVersion.in_process("run", 12)) == "run-00012"


@pytest.mark.parametrize("name, segment, step", [
    ("countdown-step000003", "countdown", 3), ("job.2-step000001", "job.2", 1), ("run-00012", "run", 12),
    ("a-12-34", "a-12", 34), ("a-step-12", "a-step", 12), ("x-step12", "x", 12), ("ephemeral-000001", "ephemeral", 1),
])
def test_parse_reads_the_step_and_gives_the_name_back(name, segment, step):
    v = WeightsVersion.parse(name)
    assert v is not None and (v.segment, v.step) == (segment, step) and str(v) == name


@pytest.mark.parametrize("name", ["v1.0", "hand-named", "step12", "run-step", ""])
def test_a_name_without_a_step_parses_to_none(name):
    assert WeightsVersion.parse(name) is None


def test_validate_keeps_the_stores_messages():
    assert WeightsVersion.validate("run-step000001") == "run-step000001"
    with pytest.raises(InvalidArgument, match="parent_version: 'latest' is reserved"):
        WeightsVersion.validate("latest", "parent_version")
    with pytest.raises(InvalidArgument, match=r"version: '-x' is not 1-128 characters of \[A-Za-z0-9._-\]"):
        WeightsVersion.validate("-x")
    with pytest.raises(InvalidArgument):
        WeightsVersion.validate("a" * 129)


def test_segments():
    assert [run_segment("job", i) for i in (1, 2, 3)] == ["job", "job.2", "job.3"]
    assert [segment_index("job", n) for n in ("job", "job.2", "job.02", "job.1", "jobs.2", "other")] == \
        [1, 2, None, None, None, None]
