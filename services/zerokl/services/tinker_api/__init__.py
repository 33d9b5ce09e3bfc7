"""The Tinker endpoint: Thinking Machines' Tinker REST API, which the official ``tinker`` SDK speaks,
served on zerokl's trainer, sampler replicas and weight store (``zerokl serve tinker``; docs/api.md).

Named ``tinker_api``, not ``tinker``: the SDK's own package is ``tinker``.
"""

__all__: list[str] = []
