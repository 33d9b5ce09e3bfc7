"""zerokl.services.trainer: SFT, DPO and GRPO on the serving forward; the trainer service."""
