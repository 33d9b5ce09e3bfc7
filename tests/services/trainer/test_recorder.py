"""The record process (trainer/recorder.py): a weights-only version's files written by a child process of its own
from the trainer's shared export. The child says when it holds the bytes, before it writes them, so a co-located
trainer frees the export (23 GiB of device memory for the GLM-5 slice) while the files are still being written:
after that the export is never read again, and the files hold exactly the shared bytes."""
from __future__ import annotations

import asyncio
import pathlib

import pytest
import torch

from zerokl.kernels.model import Model, ModelConfig
from zerokl.services.trainer.recorder import RecordWorker
from zerokl.services.trainer.server import build_parser
from zerokl.services.weightstore.shared import SharedUnavailable
from zerokl.services.weightstore.sync import export_shared, open_shared

pytestmark = pytest.mark.timeout(120)


def test_the_export_may_go_once_the_record_process_says_it_copied_it(tmp_path: pathlib.Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))     # the record's directory (the child inherits it)
    model = Model(ModelConfig.preset("tiny"), seed=3, dtype=torch.bfloat16)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    shared = export_shared(model.state_dict(), "rec-step000001")
    worker = RecordWorker(build_parser().parse_args(["--weights-dir", str(tmp_path / "w")]), deltas="off")
    order: list[str] = []

    def copied() -> None:
        order.append("copied")
        shared.close()      # the trainer frees its export: nothing reads it again
        with pytest.raises(SharedUnavailable):
            open_shared(shared.export)

    async def main() -> pathlib.Path:
        try:
            directory = await worker.write(shared.export, model.config, torch.bfloat16, copied=copied)
            order.append("written")
            return directory
        finally:
            await worker.close()

    directory = asyncio.run(main())
    assert order == ["copied", "written"]
    loaded = Model.from_pretrained(directory).state_dict()
    assert list(loaded) == list(want) and all(torch.equal(loaded[k], want[k]) for k in want)
