"""tools/bench/bench_colocate.py: the disk guard that stops the fleet before a full root disk takes the machine."""
import pathlib
import shutil
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools" / "bench"))
import bench_colocate  # noqa: E402


def _watch(workdir: pathlib.Path, reserve: float) -> tuple[bench_colocate.DiskWatch, list[str]]:
    calls: list[str] = []
    watch = bench_colocate.DiskWatch(workdir, reserve)
    watch.on_low = lambda: calls.append("stop")
    return watch, calls


def test_the_disk_guard_stops_the_fleet_once_below_its_reserve(tmp_path: pathlib.Path) -> None:
    """Below the reserve the guard calls on_low once, however many samples follow, and keeps what the workdir held
    by part at that moment; above it, never."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / "zerokl-publish-x").write_bytes(b"\0" * 8192)
    free = shutil.disk_usage(tmp_path).free
    roomy, roomy_calls = _watch(tmp_path, reserve=0.0)
    roomy.sample()
    assert roomy_calls == [] and roomy.tripped is None

    tight, calls = _watch(tmp_path, reserve=free + 2**40)      # more than the disk has: below it at once
    tight.phase = "job"
    tight.sample()
    tight.sample()
    assert calls == ["stop"]
    assert tight.tripped["phase"] == "job" and tight.tripped["free"] < tight.reserve
    assert sum(tight.tripped["parts"].values()) >= 8192
    assert tight.report(8192)["stopped_for_disk"] is tight.tripped


def test_no_fleet_yet_no_stop(tmp_path: pathlib.Path) -> None:
    """While the bench writes the model there is no fleet to stop: the guard waits for on_low to be set."""
    watch = bench_colocate.DiskWatch(tmp_path, shutil.disk_usage(tmp_path).free + 2**40)
    watch.sample()
    assert watch.tripped is None
