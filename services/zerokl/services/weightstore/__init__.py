"""zerokl.services.weightstore: versioned model weights (safetensors shards + manifest).

- :mod:`.store`: :class:`VersionStore`, the logic (atomic publish, verified
  reads, pins, retention), usable directly without gRPC.
- :mod:`.backends`: :class:`LocalDirBackend` and :class:`S3Backend` under it.
- :mod:`.versions`: version names: what a name may be, and :class:`~.versions.WeightsVersion`, the
  name of a step's version (``<run>-step000012``) built and read back.
- :mod:`.service` / :mod:`.server`: the ``zerokl.v1.WeightStore`` gRPC service and its command line.
- :mod:`.client`: :class:`WeightStoreClient`, the async gRPC client.
- :mod:`.checkpoint`: state dict <-> Hugging Face style safetensors directory.
- :mod:`.sync`: weight sync in place (a version shared from the trainer's memory to the replicas on
  its host); :mod:`.shared`: :class:`SharedExport`, its descriptor (no torch);
  :mod:`.convert`: the only proto converters.
"""
from zerokl.services.weightstore.backends import LocalDirBackend, S3Backend, StorageBackend
from zerokl.services.weightstore.client import WeightStoreClient
from zerokl.services.weightstore.shared import SharedExport
from zerokl.services.weightstore.store import (
    GcResult,
    ShardInfo,
    UploadStatus,
    VersionEntry,
    VersionSpec,
    VersionStore,
    WeightsManifest,
)

__all__ = [
    "GcResult",
    "LocalDirBackend",
    "S3Backend",
    "SharedExport",
    "ShardInfo",
    "StorageBackend",
    "UploadStatus",
    "VersionEntry",
    "VersionSpec",
    "VersionStore",
    "WeightStoreClient",
    "WeightsManifest",
]
