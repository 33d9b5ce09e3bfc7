"""The record process (trainer/recorder.py): a weights-only version's files written by a child process of its own
from the trainer's shared export. The child says when it holds the bytes, before it writes them, so a co-located
trainer frees the export (23 GiB of device memory for the GLM-5 slice) while the files are still being written:
after that the export is never read again, and the files hold exactly the shared bytes: on disk (``--record-deltas
previous``) or in the child's memory (``start``, ``off``), read back from the store once uploaded."""
from __future__ import annotations

import asyncio
import pathlib

import pytest
import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.trainer.recorder import RecordWorker
from zerokl.services.trainer.server import build_parser
from zerokl.services.weightstore import LocalDirBackend, VersionStore
from zerokl.services.weightstore.store import VersionSpec
from zerokl.services.weightstore.shared import SharedUnavailable
from zerokl.services.weightstore.sync import export_shared, open_shared

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("deltas", ["previous", "off"])
def test_the_export_may_go_once_the_record_process_says_it_copied_it(tmp_path: pathlib.Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     deltas: str) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))     # the record's directory (the child inherits it)
    model = Model(ModelConfig.preset("tiny"), seed=3, dtype=torch.bfloat16)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    shared = export_shared(model.state_dict(), "rec-step000001")
    worker = RecordWorker(build_parser().parse_args(["--weights-dir", str(tmp_path / "w")]), deltas=deltas)
    order: list[str] = []

    def copied() -> None:
        order.append("copied")
        shared.close()      # the trainer frees its export: nothing reads it again
        with pytest.raises(SharedUnavailable):
            open_shared(shared.export)

    async def main() -> None:
        try:
            directory = await worker.write(shared.export, model.config, torch.bfloat16, copied=copied)
            order.append("written")
            await worker.upload(directory, "rec-step000001", VersionSpec(step=1), 1)
        finally:
            await worker.close()

    asyncio.run(main())
    assert order == ["copied", "written"]
    VersionStore(LocalDirBackend(tmp_path / "w")).fetch("rec-step000001", tmp_path / "read")
    loaded = Model.from_pretrained(tmp_path / "read").state_dict()
    assert list(loaded) == list(want) and all(torch.equal(loaded[k], want[k]) for k in want)
