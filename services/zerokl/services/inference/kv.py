"""The KV handoff as bytes: exact cache rows out of one replica, into another.

A :class:`~zerokl.services.engine.types.KVHandoff` holds three tensors
[layers, num_tokens, dim] (normalized latent, rotated rope key, indexer key) of
the whole prompt, and the first token each sample drew from it on the prefill
replica. The tensors travel as ONE blob, their raw little-endian row-major bytes
back to back, described by a :class:`KVHeader` (layouts, total size, SHA-256,
the first tokens and their logprobs) and sent as checksummed 4 MiB chunks.
Nothing is converted on the way: the receiver reinterprets the same bytes as
the same dtype, so the decode replica's cache holds the bits the prefill
replica computed.

On GPUs the bytes go device -> pinned host buffer (the engine's export) ->
wire -> pinned host buffer (:class:`KVReceiver` assembles into one) -> device
(the engine's import copies from it): no pageable staging copy on either side.
"""
from __future__ import annotations

import hashlib
import math
import sys
from typing import Any, Mapping

import torch

from zerokl.kernels.dtypes import DTYPES, dtype_name
from zerokl.services.engine.types import KVHandoff
from zerokl.services.inference.types import KVHeader, TensorLayout
from zerokl.services.runtime.chunks import Chunk, verify_chunk
from zerokl.services.runtime.errors import DataLoss, FailedPrecondition, InvalidArgument, PreconditionViolation
from zerokl.services.runtime.info import ServiceIdentity

__all__ = ["KV_TENSORS", "handoff_to_blob", "expected_layouts", "check_header", "KVReceiver"]

KV_TENSORS = ("latent", "rope", "index_k")

# The blob is defined as little-endian; a big-endian host would have to swap,
# and none of the supported devices is one.
if sys.byteorder != "little":  # pragma: no cover - no such host in use
    raise ImportError("zerokl KV handoff needs a little-endian host")

def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 host tensor (a view when ``t`` is already a contiguous host tensor)."""
    # view(uint8) reinterprets the storage: no conversion touches a bit.
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def handoff_to_blob(handoff: KVHandoff, *, request_id: str, identity: ServiceIdentity,
                    prompt_ids: tuple[int, ...], num_cached_tokens: int = 0,
                    prompt_logprobs: list[float] | None = None) -> tuple[KVHeader, memoryview]:
    """The header and the blob of ``handoff`` (computed by ``identity``'s replica).

    ``prompt_ids`` is the whole prompt; the handoff covers all of it and carries
    each sample's first token. The blob is one host buffer (the three tensors'
    bytes back to back: one copy).
    """
    parts, layouts, offset = [], [], 0
    for name in KV_TENSORS:
        t = getattr(handoff, name)
        raw = _host_bytes(t)
        layouts.append(TensorLayout(name, dtype_name(t.dtype), tuple(t.shape), offset, raw.numel()))
        parts.append(raw)
        offset += raw.numel()
    blob = memoryview(torch.cat(parts).numpy()) if offset else memoryview(b"")
    header = KVHeader(
        request_id=request_id, prompt_ids=tuple(prompt_ids),
        num_tokens=handoff.num_tokens, tensors=tuple(layouts), total_bytes=offset,
        sha256=hashlib.sha256(blob).digest(), weights_version=identity.weights_version,
        numerics_fingerprint=identity.numerics_fingerprint, model_config_hash=identity.model_config_hash,
        num_cached_tokens=num_cached_tokens,
        prompt_logprobs=tuple(prompt_logprobs) if prompt_logprobs is not None else None,
        first_token_ids=tuple(handoff.first_token_ids), first_logprobs=tuple(handoff.first_logprobs))
    return header, blob


def expected_layouts(config: Mapping[str, Any], dtype: str, num_tokens: int) -> tuple[TensorLayout, ...]:
    """The only layouts a replica of ``config`` (ModelConfig.to_dict()) in ``dtype`` (its name) accepts for
    ``num_tokens`` positions."""
    dims = {"latent": config["kv_lora_rank"], "rope": config["qk_rope_head_dim"],
            "index_k": config["index_head_dim"]}
    size = DTYPES[dtype].itemsize
    out, offset = [], 0
    for name in KV_TENSORS:
        shape = (config["num_hidden_layers"], num_tokens, dims[name])
        nbytes = shape[0] * shape[1] * shape[2] * size
        out.append(TensorLayout(name, dtype, shape, offset, nbytes))
        offset += nbytes
    return tuple(out)


def check_header(header: KVHeader, identity: ServiceIdentity, config: Mapping[str, Any], dtype: str,
                 max_model_len: int, num_samples: int) -> None:
    """Refuse a header this replica cannot use (of ``config``, ModelConfig.to_dict(), in the dtype named
    ``dtype``), before any byte of the blob is buffered.

    FAILED_PRECONDITION when the KV was computed with other weights, numerics
    or model config (its bits would not be this replica's); INVALID_ARGUMENT
    for a malformed header, first tokens included (one per sample of the
    request's ``num_samples``, in the vocabulary, finite logprobs). Sizes are
    fixed by the model, so a verified header also bounds the memory the blob
    may take.
    """
    mismatches = [
        PreconditionViolation(kind, theirs or "(none)", f"the KV was computed with {kind} {theirs or '(none)'!r}; "
                                                       f"this replica serves {ours!r}")
        for kind, theirs, ours in (("WEIGHTS_VERSION", header.weights_version, identity.weights_version),
                                   ("NUMERICS_FINGERPRINT", header.numerics_fingerprint, identity.numerics_fingerprint),
                                   ("MODEL_CONFIG_HASH", header.model_config_hash, identity.model_config_hash))
        if theirs != ours]
    if mismatches:
        raise FailedPrecondition("KV handoff from an incompatible replica: "
                                 + "; ".join(v.description for v in mismatches), precondition_violations=mismatches)
    n = len(header.prompt_ids)
    if n < 1:
        raise InvalidArgument.field("kv.prompt_token_ids", "the prompt is empty")
    if header.num_tokens != n:
        raise InvalidArgument.field("kv.num_tokens", f"got {header.num_tokens}; the KV of a {n}-token prompt "
                                                     f"covers the whole prompt, {n} positions")
    if n >= max_model_len:
        raise InvalidArgument.field("kv.prompt_token_ids",
                                    f"prompt of {n} tokens does not fit the context of {max_model_len}")
    if len(header.first_token_ids) != num_samples or len(header.first_logprobs) != num_samples:
        raise InvalidArgument.field("kv.first_token_ids", f"got {len(header.first_token_ids)} first tokens and "
                                                          f"{len(header.first_logprobs)} logprobs; the request has "
                                                          f"{num_samples} samples, one of each per sample")
    vocab_size = config["vocab_size"]
    bad = next((t for t in header.first_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument.field("kv.first_token_ids", f"token id {bad} is outside the vocabulary "
                                                          f"[0, {vocab_size})")
    if not all(math.isfinite(lp) for lp in header.first_logprobs):
        raise InvalidArgument.field("kv.first_logprobs", f"got {list(header.first_logprobs)}; a drawn token's "
                                                         f"logprob is finite")
    want = expected_layouts(config, dtype, header.num_tokens)
    if header.tensors != want:
        raise InvalidArgument.field("kv.tensors", f"got {[_describe(t) for t in header.tensors]}, this model needs "
                                                  f"{[_describe(t) for t in want]}")
    if header.total_bytes != sum(t.nbytes for t in want):
        raise InvalidArgument.field("kv.total_bytes", f"got {header.total_bytes}, the layouts add up to "
                                                      f"{sum(t.nbytes for t in want)}")
    if len(header.sha256) != 32:
        raise InvalidArgument.field("kv.sha256", f"must be 32 bytes, got {len(header.sha256)}")


def _describe(t: TensorLayout) -> str:
    return f"{t.name}:{t.dtype}{list(t.shape)}@{t.offset}+{t.nbytes}"


class KVReceiver:
    """Assemble a blob announced by a checked header and turn it back into a KVHandoff.

    Each chunk is verified on arrival (contiguous offset, size, its own
    SHA-256: INVALID_ARGUMENT / DATA_LOSS) and written at its offset into one
    host buffer of the header's size (pinned when a GPU will read it); the
    SHA-256 of the whole blob is computed as the chunks arrive and checked
    against the header's once complete. The tensors are views of that buffer.

    ``shared``: the engine runs in another process: the buffer is shared memory from the start (the
    tensors then cross to the engine without a copy, and this process never initialises CUDA for a
    pinned allocation).
    """

    def __init__(self, header: KVHeader, shared: bool = False) -> None:
        self.header = header
        if shared:
            self._buf = torch.empty(header.total_bytes, dtype=torch.uint8).share_memory_()
        else:
            pin = torch.cuda.is_available() and header.total_bytes > 0
            self._buf = torch.empty(header.total_bytes, dtype=torch.uint8, pin_memory=pin)
        self._sha = hashlib.sha256()
        self._received = 0

    @property
    def received(self) -> int:
        return self._received

    @property
    def complete(self) -> bool:
        return self._received == self.header.total_bytes

    def add(self, chunk: Chunk) -> None:
        """Verify and place one chunk (INVALID_ARGUMENT / DATA_LOSS on a bad one)."""
        if self.complete and chunk.data:
            raise InvalidArgument.field("chunk", "the KV blob is already complete")
        verify_chunk(chunk, self._received, self.header.total_bytes)
        if chunk.data:
            self._buf[chunk.offset:chunk.end] = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8)
            self._sha.update(chunk.data)
        self._received = chunk.end

    def handoff(self, trusted: bool = False) -> KVHandoff:
        """The handoff, once complete and matching the header's SHA-256 (over the bytes received here).

        The checksum only catches corruption: whoever sends the blob computes it. ``trusted``
        (the sender authenticated as a peer) is what lets the KV enter the prefix cache.
        """
        if not self.complete:
            raise DataLoss(f"KV blob incomplete: {self._received} of {self.header.total_bytes} bytes received")
        if self._sha.digest() != self.header.sha256:
            raise DataLoss(f"KV blob of {self._received} bytes does not match the header's sha256")
        tensors = {t.name: self._buf[t.offset:t.offset + t.nbytes].view(DTYPES[t.dtype]).reshape(t.shape)
                   for t in self.header.tensors}
        h = self.header
        return KVHandoff(tuple(h.prompt_ids[: h.num_tokens]), tensors["latent"], tensors["rope"], tensors["index_k"],
                         trusted=trusted, first_token_ids=tuple(h.first_token_ids),
                         first_logprobs=tuple(h.first_logprobs))
