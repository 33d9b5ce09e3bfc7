"""The engine process's wire format: a pass's outputs and the core's errors cross the pipe exactly."""
from __future__ import annotations

from zerokl.services.engine.outputs import CoreError, StepOutputs, dumps, loads, merge_outputs
from zerokl.services.engine.types import SampleOutput


def test_a_pass_of_outputs_crosses_the_pipe_exactly_and_merges_per_sample() -> None:
    outs = [SampleOutput("r", 0, [5, 6], [-0.1234567, -2.5], False, None, [-1.0, -3.25], 7, 3, "ab"),
            SampleOutput("r", 1, [4], [-0.75], False, None, None, 7, 3, "c"),
            SampleOutput("r", 1, [], [], True, "abort", None, 7),
            SampleOutput("r", 0, [9], [float("-inf")], True, "error", error="ValueError: x")]
    step = StepOutputs()
    for out in outs:
        step.add(1, out)
    step.end(1, CoreError("UNAVAILABLE", "gone"))
    got = loads(dumps(step))        # what the engine process sends: one pickle for the pass
    got.index_tokens()
    assert [got.output(i, "r") for i in range(len(outs))] == outs
    assert got.keys == [1] * 4 and [(k, e.status, e.message) for k, e in got.ends] == [(1, "UNAVAILABLE", "gone")]
    # A stream hands on each sample's outputs merged: tokens, logprobs and text in order, the first part's
    # prompt logprobs, the last part's finish and counts.
    assert merge_outputs([(got, i) for i in range(len(outs))], "r") == [
        SampleOutput("r", 0, [5, 6, 9], [-0.1234567, -2.5, float("-inf")], True, "error", [-1.0, -3.25], 0, 0,
                     "ab", error="ValueError: x"),
        SampleOutput("r", 1, [4], [-0.75], True, "abort", None, 7, 0, "c")]


def test_a_core_error_crosses_the_pipe_with_its_status_and_violations() -> None:
    err = CoreError("FAILED_PRECONDITION", "pinned v1", [("WEIGHTS_VERSION", "v1", "this replica serves 'v2'")])
    got = loads(dumps(err))
    assert (type(got), got.status, got.message, str(got), got.violations) == (
        CoreError, "FAILED_PRECONDITION", "pinned v1", "pinned v1", (("WEIGHTS_VERSION", "v1", "this replica serves 'v2'"),))
