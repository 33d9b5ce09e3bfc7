"""The names of torch dtypes, defined once: name <-> torch.dtype for every layer of zerokl.

A leaf of the numerics library (it imports nothing of zerokl), so the model, the services and
the command line read one table. A dtype's canonical name is torch's own without "torch."
("float32", "bfloat16", "float8_e4m3fn"): what config.json, the wire (ServiceIdentity.dtype,
KV and weight tensor layouts), fingerprint keys and trace records write. Where a user names
the dtype a fleet, a replica or a trainer computes in (`--dtype`, `TrainConfig.dtype`), one
alias is accepted besides: "fp8", an FP8 model (block-scaled e4m3 projections, bf16
activations; NUMERICS.md, "FP8"), whose canonical name is "float8_e4m3fn". Compare dtypes,
or canonical names (`canonical_name`), never an alias with a name as strings.
"""
from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["FP8", "FP8_ALIAS", "DTYPES", "DTYPES_ALIASES", "COMPUTE_DTYPES", "MODEL_DTYPES", "dtype_name", "canonical_name", "names_fp8",
           "to_dtype"]

#: The dtype of an FP8 model's quantized weights, and the fingerprint key's dtype of an FP8 model.
FP8 = torch.float8_e4m3fn
#: How a --dtype flag or TrainConfig.dtype spells FP8.
FP8_ALIAS = "fp8"

#: canonical name -> dtype: every dtype zerokl names (weights and activations, FP8 values, the
#: integer tensors of the wire).
DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64, torch.int32)}
#: Accepted spelling -> canonical name, for the spellings that are not canonical names.
DTYPES_ALIASES = {FP8_ALIAS: "float8_e4m3fn"}
#: The compute dtypes a fleet, a replica or a trainer is asked for, as spelled there.
COMPUTE_DTYPES = ("float32", "bfloat16", FP8_ALIAS)
#: The dtypes of a model's unquantized tensors (config.json's "dtype", a KV handoff's tensors).
MODEL_DTYPES = ("float32", "bfloat16", "float16")


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of `dtype`: torch.bfloat16 -> "bfloat16" (the one place "torch." is cut)."""
    return str(dtype).removeprefix("torch.")


def canonical_name(name: str) -> str:
    """The canonical name of an accepted spelling: "fp8" -> "float8_e4m3fn", a canonical name as it is.
    ValueError for any other."""
    name = DTYPES_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: expected one of {', '.join([*DTYPES, FP8_ALIAS])}")
    return name


def to_dtype(name: str, among: Iterable[str] | None = None) -> torch.dtype:
    """The torch dtype of `name` (a canonical name or "fp8"). ValueError for an unknown name, or,
    with `among` (names as a caller accepts them, e.g. COMPUTE_DTYPES), for one not among them."""
    if among is not None and name not in (allowed := tuple(among)):
        raise ValueError(f"dtype {name!r}: expected one of {', '.join(allowed)}")
    return DTYPES[canonical_name(name)]


def names_fp8(name: str | None) -> bool:
    """True when `name` spells FP8 ("fp8" or "float8_e4m3fn"); False for any other string or None
    (a check, not a validation: it never raises)."""
    return name is not None and DTYPES_ALIASES.get(name, name) == dtype_name(FP8)
