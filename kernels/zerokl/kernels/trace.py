"""Per-op, per-token digests of one forward pass: what `zerokl diff` compares.

A trace is the model's forward for one sequence with a recorder on: every op output
the numerics contract covers (embedding, norms, projections, RoPE, indexer scores and
selection, attention, router logits / weights / experts, each selected expert's
output, the combine, MLPs, residuals, logits, logprobs) is reduced to one 64-bit
digest per token, in execution order. Two sides that computed the same bits have
the same digests; the first differing (layer, op, token) is where they part.

Where the records come from:
  * module outputs, by forward hooks installed only while tracing (every RMSNorm,
    LayerNorm, Linear, Router, MLP, MoE and Block of the model, named by its path);
  * intermediates that are not module outputs, by `record(...)` lines in
    kernels/zerokl/kernels/model/model.py (q_rope, k_rope, absorbed q, attention output, indexer
    scores, router logits, expert outputs, the combine).

Off costs one global load per `record` line (`_ACTIVE is None`) and no hooks. The
recorder belongs to the thread that started it, so a serving engine computing other
requests on its own thread meanwhile records nothing. Recording never changes bits:
it reads outputs (detached) and writes nothing the forward reads.

The digest of a row is a multilinear hash over the row's raw words (fp32/bf16/int bit
patterns widened to int64): sum_i w_i * word_i mod 2^64 with fixed odd 64-bit w_i.
Integer sums are exact in any order, so device and host, CPU and GPU give the same
digest for the same bits, and any single-word difference always changes the digest.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

import torch

from zerokl.kernels.dtypes import dtype_name

__all__ = [
    "OpTrace",
    "Trace",
    "record",
    "tracing",
    "record_experts",
    "recording",
    "row_digests",
    "trace_sequence",
    "MODEL_LAYER",
]

MODEL_LAYER = -1          # the layer of ops outside the decoder blocks (embedding, final norm, logits, logprobs)
_MASK64 = (1 << 64) - 1
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class OpTrace:
    """One op's output over the traced tokens.

    digests: one unsigned 64-bit digest per token (row), position order.
    shape:   the per-token shape (row = one token's output, e.g. [128] or [2, 128]).
    values:  the rows' raw little-endian bytes [tokens, *shape] when this op was captured, else None.
    """

    layer: int
    op: str
    dtype: str
    shape: tuple[int, ...]
    digests: list[int]
    values: bytes | None = None

    @property
    def key(self) -> str:
        """"layer:op", e.g. "0:self_attn.q_a_proj" or "-1:lm_head" (what `capture` names)."""
        return f"{self.layer}:{self.op}"

    def tensor(self) -> torch.Tensor | None:
        """The captured rows as a tensor [tokens, *shape] (None when not captured)."""
        if self.values is None:
            return None
        dtype = getattr(torch, self.dtype)
        flat = torch.frombuffer(bytearray(self.values), dtype=dtype) if self.values else torch.empty(0, dtype=dtype)
        return flat.view(len(self.digests), *self.shape)


@dataclass
class Trace:
    """A traced forward of one sequence: ops in execution order plus what computed them."""

    token_ids: list[int]
    ops: list[OpTrace] = field(default_factory=list)
    meta: dict[str, str] = field(default_factory=dict)   # backend, device, dtype, weights_version, ...

    def to_json(self) -> dict:
        """A JSON-able dict (values hex-encoded): the trace-file format of `zerokl diff`."""
        return {"token_ids": list(self.token_ids), "meta": dict(self.meta),
                "ops": [{"layer": o.layer, "op": o.op, "dtype": o.dtype, "shape": list(o.shape),
                         "digests": [f"{d:016x}" for d in o.digests],
                         **({"values": o.values.hex()} if o.values is not None else {})} for o in self.ops]}

    @staticmethod
    def from_json(d: dict) -> "Trace":
        ops = [OpTrace(int(o["layer"]), o["op"], o["dtype"], tuple(o["shape"]), [int(x, 16) for x in o["digests"]],
                       bytes.fromhex(o["values"]) if "values" in o else None) for o in d["ops"]]
        return Trace([int(t) for t in d["token_ids"]], ops, {str(k): str(v) for k, v in d.get("meta", {}).items()})


# ----------------------------------------------------------------------------- digests

_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}


def _hash_weights(width: int, device: torch.device) -> torch.Tensor:
    """Fixed odd 64-bit multipliers [width] (splitmix64 of the word index), as int64."""
    key = (width, str(device))
    w = _WEIGHTS.get(key)
    if w is None:
        vals = []
        for i in range(width):
            z = (i + 1) * 0x9E3779B97F4A7C15 & _MASK64
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
            z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
            z = (z ^ (z >> 31)) | 1
            vals.append(z - (1 << 64) if z >> 63 else z)
        w = _WEIGHTS[key] = torch.tensor(vals, dtype=torch.int64, device=device)
    return w


def row_digests(x: torch.Tensor) -> list[int]:
    """One unsigned 64-bit digest per row of x [N, ...] (any dtype), computed where x lives."""
    rows = x.detach().reshape(x.shape[0], -1)
    if rows.dtype == torch.bool:
        rows = rows.to(torch.uint8)
    words = rows.contiguous().view(_INT_VIEW[rows.element_size()]).to(torch.int64)
    # The word count enters too, so rows of different widths never share a digest by padding.
    h = (words * _hash_weights(words.shape[1], words.device)).sum(1) + words.shape[1]
    return [v & _MASK64 for v in h.cpu().tolist()]


# ----------------------------------------------------------------------------- the recorder

class _Recorder:
    def __init__(self, capture: frozenset[str]):
        self.thread = threading.get_ident()
        self.capture = capture
        self.layer = MODEL_LAYER
        self.ops: list[OpTrace] = []

    def add(self, op: str, x: torch.Tensor, layer: int | None = None) -> None:
        layer = self.layer if layer is None else layer
        rows = x.detach()
        entry = OpTrace(layer, op, dtype_name(rows.dtype), tuple(rows.shape[1:]), row_digests(rows))
        if "*" in self.capture or entry.key in self.capture:
            entry.values = rows.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        self.ops.append(entry)


_ACTIVE: _Recorder | None = None
_ONE_AT_A_TIME = threading.Lock()


def _recorder() -> _Recorder | None:
    """The active recorder if this thread owns it."""
    r = _ACTIVE
    return r if r is not None and r.thread == threading.get_ident() else None


def tracing() -> bool:
    """Whether this thread is recording a trace (lets a path take its traced form, same bits)."""
    return _ACTIVE is not None and _recorder() is not None


def record(op: str, x: torch.Tensor | None) -> None:
    """Record x [N, ...] (one row per token) as `op` of the current layer; nothing when not tracing
    or when x is None (the training layout's implicit causal key set has no tensor to record)."""
    if _ACTIVE is None or x is None:
        return
    r = _recorder()
    if r is not None:
        r.add(op, x)


def record_experts(x: torch.Tensor, expert_ids: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor,
                   down_proj: torch.Tensor) -> None:
    """Record each token's k selected experts' outputs [N, k, D] ("mlp.experts").

    ops.moe_experts combines these without returning them; they are recomputed here,
    only while tracing, by the same ops.moe_expert_outputs it calls (the same bits: a
    pair's output depends only on its token and its expert's weights).
    """
    if _ACTIVE is None:
        return
    r = _recorder()
    if r is None:
        return
    from zerokl.kernels import ops
    t, k = expert_ids.shape
    with torch.no_grad():
        _, outputs = ops.moe_expert_outputs(x, expert_ids, gate_proj, up_proj, down_proj)
    r.add("mlp.experts", outputs.view(t, k, -1))


# Tuple-returning modules: the name of each element (None: not recorded, e.g. the
# selection a Block passes along, recorded inside attention already).
_TUPLE_NAMES = {"Router": ("weights", "experts"), "Block": ("out", None)}
# Modules whose outputs are recorded by their hooks (the others are containers or recorded inside).
_HOOKED = {"RMSNorm", "LayerNorm", "Linear", "SplitLinear", "Router", "MLP", "MoE", "Block",
           "Embedding"}


def _split_name(name: str) -> tuple[int, str]:
    """"layers.3.self_attn.q_a_proj" -> (3, "self_attn.q_a_proj"); "lm_head" -> (-1, "lm_head")."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] == "layers" and parts[1].isdigit():
        return int(parts[1]), ".".join(parts[2:]) or "block"
    return MODEL_LAYER, name


class recording:
    """Context manager: trace `model`'s forwards on this thread; `.ops` holds the records after.

    capture: "layer:op" keys whose full rows are kept (with the digests), "*" for all.
    """

    def __init__(self, model: torch.nn.Module, capture: Sequence[str] = ()):
        self.model = model
        self.capture = frozenset(capture)
        self.ops: list[OpTrace] = []
        self._handles: list = []
        self._recorder: _Recorder | None = None

    def __enter__(self) -> "recording":
        global _ACTIVE
        if _ACTIVE is not None and _ACTIVE.thread == threading.get_ident():
            raise RuntimeError("a trace is already recording on this thread")
        _ONE_AT_A_TIME.acquire()           # another thread's trace: wait for it (one recorder per process)
        self._recorder = r = _Recorder(self.capture)
        try:
            for name, module in self.model.named_modules():
                # By class name up the MRO: a LoRA-adapted projection is a torch-generated
                # "ParametrizedLinear" subclass of Linear (kernels/zerokl/kernels/model/lora.py).
                kind = next((c.__name__ for c in type(module).__mro__ if c.__name__ in _HOOKED), None)
                if not name or kind is None:
                    continue
                layer, op = _split_name(name)
                if kind == "Block":
                    self._handles.append(module.register_forward_pre_hook(self._enter_block(layer)))
                    op = "block"
                self._handles.append(module.register_forward_hook(self._hook(layer, op, kind)))
        except BaseException:
            self.__exit__()
            raise
        _ACTIVE = r
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        _ACTIVE = None
        for h in self._handles:
            h.remove()
        self._handles = []
        self.ops = self._recorder.ops if self._recorder else []
        _ONE_AT_A_TIME.release()

    def add(self, op: str, x: torch.Tensor, layer: int = MODEL_LAYER) -> None:
        """Record a value computed outside the model (e.g. the logprobs) under `op`."""
        assert self._recorder is not None
        self._recorder.add(op, x, layer)

    @staticmethod
    def _enter_block(layer: int):
        def pre_hook(module, args):
            r = _recorder()
            if r is not None:
                r.layer = layer
        return pre_hook

    @staticmethod
    def _hook(layer: int, op: str, kind: str):
        names = _TUPLE_NAMES.get(kind)

        def hook(module, args, output):
            r = _recorder()
            if r is None:
                return
            if names is None:
                r.add(op, output, layer)
            else:
                for part, value in zip(names, output):
                    if part is not None:
                        r.add(f"{op}.{part}", value, layer)
            if kind == "Block":
                r.layer = MODEL_LAYER      # back outside the blocks until the next one starts
        return hook


# ----------------------------------------------------------------------------- one traced sequence

@torch.no_grad()
def trace_sequence(model, token_ids: Sequence[int], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   capture: Sequence[str] = (), meta: dict[str, str] | None = None) -> Trace:
    """Trace the full-sequence forward of `token_ids` on `model` and the logprob of each next token.

    The forward is the training path's (one sequence from position 0, no cache); a
    row's bits never depend on the batch, the chunking or the cache (the contract), so
    this is what the replica's engine and the trainer compute for these tokens. The
    last op, "logprobs" ([S-1] rows), is token i+1's logprob given 0..i under the
    sampling distribution of (temperature, top_k, top_p), as Score and ForwardLogprobs
    return them.
    """
    from zerokl.kernels.sampling import SamplingParams, sampling_logprobs
    ids = list(token_ids)
    if not ids:
        raise ValueError("trace_sequence: no tokens")
    dev = model.embed_tokens.weight.device
    tokens = torch.tensor(ids, dtype=torch.int64, device=dev)
    with recording(model, capture) as rec:
        logits = model(tokens.view(1, -1)).view(len(ids), -1)   # the training path: forward_tokens, one sequence
        if len(ids) > 1:
            n = len(ids) - 1
            params = SamplingParams(torch.full((n,), float(temperature), device=dev),
                                    torch.full((n,), int(top_k), dtype=torch.int64, device=dev),
                                    torch.full((n,), float(top_p), device=dev),
                                    torch.zeros(n, dtype=torch.int64, device=dev),
                                    torch.zeros(n, dtype=torch.int64, device=dev))
            lp = sampling_logprobs(logits[:-1], tokens[1:], params)
            rec.add("logprobs", lp.float().view(n, 1))
    return Trace(ids, rec.ops, dict(meta or {}))
