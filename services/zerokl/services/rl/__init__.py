"""zerokl.services.rl: the on-policy RL loop, independent of transport.

- :mod:`.loop`: :func:`run_rl` (sample, reward, update, publish, switch), its config and step records.
- :mod:`.ports`: what the loop needs from inference (:class:`RolloutPort`) and the trainer
  (:class:`TrainerPort`), and the in-process ports.
"""
