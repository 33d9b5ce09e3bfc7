"""The RL loop's ports: what :func:`~zerokl.services.rl.loop.run_rl` needs from inference and the trainer.

- :class:`RolloutPort`: generate n samples per prompt on a pinned weights version;
- :class:`TrainerPort`: one GRPO update, and publish the weights it produced.

In-process ports (:class:`LocalEnginePort`, :class:`LocalTrainerPort`) serve
tests and the embedded demo; the Jobs API's gRPC ports (the fleet through the
scheduler, the trainer service) live with the jobs that drive them
(:mod:`zerokl.services.jobs.manager`), since they run on the job manager's
event loop and honour its cancellation.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol, Sequence

from zerokl.services.weightstore.versions import WeightsVersion
from zerokl.vocab import Rollout, SamplingOptions

__all__ = ["Sampled", "RolloutPort", "TrainerPort", "LocalTrainerPort", "LocalEnginePort", "sampling_seed"]


def sampling_seed(value: int) -> int:
    """``value`` as a request's seed: wrapped into the proto's uint64 (a job's seed may be any uint64)."""
    return value % 2**64


@dataclass(frozen=True)
class Sampled:
    """What inference returned for one sample."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    weights_version: str


class RolloutPort(Protocol):
    """``options.n`` samples per prompt on ``weights_version``; prompt ``i`` is sampled with seed
    ``sampling_seed(options.seed + i)``, so a group's draws do not depend on the prompts beside it."""

    def generate(self, prompts: Sequence[tuple[int, ...]], options: SamplingOptions,
                 weights_version: str) -> list[list[Sampled]]: ...


class TrainerPort(Protocol):
    """One GRPO update, then its weights published and served.

    A port may publish inside grpo_step (as one unit with the update, so a restart redoes
    both); its metrics then carry ``sync_s``, the seconds from the optimizer step's end to
    the new version served, and publish() only names that version.
    """

    @property
    def weights_version(self) -> str: ...
    def grpo_step(self, rollouts: Sequence[Rollout], group_size: int) -> dict: ...
    def publish(self) -> str: ...



# ----------------------------------------------------------------------------- in-process ports

class LocalTrainerPort:
    """The Trainer in this process; publishing keeps the serving weights in memory by version."""

    def __init__(self, trainer, run: str = "run"):
        self.trainer, self.run = trainer, run
        self.versions: dict[str, dict] = {}
        self._version = str(WeightsVersion.in_process(run, 0))
        self.versions[self._version] = trainer.serving_state_dict()

    @property
    def weights_version(self) -> str:
        return self._version

    def grpo_step(self, rollouts, group_size):
        return self.trainer.grpo_step(rollouts, group_size)

    def publish(self) -> str:
        self._version = str(WeightsVersion.in_process(self.run, self.trainer.step))
        self.versions[self._version] = self.trainer.serving_state_dict()
        return self._version


class LocalEnginePort:
    """An in-process Engine that loads each pinned weights version from a LocalTrainerPort.

    `backend` picks the kernels inference computes with: the trainer's own backend gives
    KL == 0; "stock" is the mismatched arm of the experiment.
    """

    def __init__(self, trainer_port: LocalTrainerPort, tokenizer, engine_config=None, backend: str | None = None):
        from zerokl.services.engine.types import EngineConfig
        self.trainer_port, self.tokenizer = trainer_port, tokenizer
        self.engine_config = engine_config or EngineConfig(max_num_batched_tokens=512, num_blocks=2048)
        self.backend = backend
        self._model, self._loaded = None, ""

    def _model_for(self, version: str):
        from zerokl.kernels.model import Model
        if version != self._loaded:
            trainer = self.trainer_port.trainer
            # On the trainer's device: KL == 0 is promised per device type.
            model = Model.empty(trainer.model.config, trainer.model.dtype).to(trainer.device)
            if getattr(trainer, "fp8", False):
                from zerokl.kernels.model.fp8 import quantize_fp8
                quantize_fp8(model)         # the served FP8 layout: the version's e4m3 values and scales go in
            model.load_state_dict(self.trainer_port.versions[version])
            self._model, self._loaded = model.eval(), version
        return self._model

    def _engine_for(self, version: str):
        """A fresh Engine on the version's model (each call: no state carries between calls)."""
        from zerokl.services.engine.engine import Engine
        return Engine(self._model_for(version), self.engine_config, tokenizer=self.tokenizer)

    def generate(self, prompts, options, weights_version):
        from zerokl.kernels import use_backend
        from zerokl.kernels.backend import get_backend
        from zerokl.services.engine.engine import run_to_completion
        from zerokl.services.engine.types import GenerateRequest
        reqs = [GenerateRequest(f"p{i}", p, dataclasses.replace(options, seed=sampling_seed(options.seed + i)))
                for i, p in enumerate(prompts)]
        with use_backend(self.backend or get_backend()):
            outs = run_to_completion(self._engine_for(weights_version), reqs)
        groups = []
        for r in reqs:
            per: dict[int, list] = {}
            for d in outs[r.request_id]:
                toks, lps, text = per.get(d.index, ([], [], ""))
                per[d.index] = [toks + d.token_ids, lps + d.logprobs, text + d.text]
            groups.append([Sampled(r.prompt_ids, tuple(per[i][0]), tuple(per[i][1]), per[i][2], weights_version)
                           for i in range(options.n)])
        return groups
