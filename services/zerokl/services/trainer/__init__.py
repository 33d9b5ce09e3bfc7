"""zerokl.services.trainer: SFT, DPO and GRPO on the serving forward; the trainer service.

What a client and the scheduler load imports no torch: :mod:`.config` (:class:`~.config.TrainConfig`),
:mod:`.types` (the RPCs' dataclasses), :mod:`.store_marks` (the trainer's marks in the weight store),
:mod:`.convert` (tensors only where logprobs are read) and :mod:`.client`. The rest computes:
:mod:`.trainer`, :mod:`.optim`, :mod:`.losses`, :mod:`.checkpointing`, :mod:`.service` and its process.
"""
