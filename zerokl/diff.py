"""`zerokl diff A B`: name the first op where two computations of the same tokens part.

Each side is traced (kernels/zerokl/kernels/trace.py: one 64-bit digest per op output per token, in
execution order) for the same token ids, and the traces are compared: the first op
in execution order whose digest differs at some token, and the lowest such token, is
where the two sides part. Its rows are then fetched in full (a second, captured
trace: every side is deterministic) to name the first differing element, both values
and their ULP distance. A per-layer table says how far the difference spread.

A side is one of:
  host:port        a replica (Score) or the trainer (ForwardLogprobs), told apart by
                   their Info; needs the operator credential when auth is on
  local:MODEL[,backend=B][,dtype=D][,seed=N]
                   an in-process run: MODEL is a preset ("tiny", seeded random weights)
                   or a checkpoint directory
  FILE.json        a trace written earlier by --save (or kernels.trace.Trace.to_json)

Exit status: 0 when the two sides computed the same bits for every traced op, 1 when
they differ, 2 when they cannot be compared (different tokens, unreachable, refused).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pathlib
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from zerokl.kernels.dtypes import dtype_name
from zerokl.kernels.trace import MODEL_LAYER, OpTrace, Trace, trace_sequence

__all__ = ["Divergence", "LayerSummary", "DiffReport", "compare", "ulp_distance", "Side", "parse_side",
           "trace_side", "diff", "diff_backends", "describe", "format_report", "add_arguments", "run"]


# ----------------------------------------------------------------------------- comparing two traces

@dataclass
class Divergence:
    """The first op (execution order) and token (lowest position) whose bits differ."""

    layer: int
    op: str
    token: int                                  # position in the sequence
    tokens: list[int]                           # every position where this op differs
    index: list[int] | None = None              # first differing element within the token's row
    a: float | int | None = None                # the two values there (None: rows not captured)
    b: float | int | None = None
    ulp: int | None = None                      # ULP distance (None: integers, NaN)
    ulp_dtype: str = ""                         # the dtype the ULPs are of (the coarser one when the sides differ)
    a_dtype: str = ""
    b_dtype: str = ""
    note: str = ""                              # e.g. "slot 0 = expert 5" for mlp.experts


@dataclass
class LayerSummary:
    layer: int
    ops: int                                    # ops compared in this layer
    differing_ops: int
    first_op: str | None                        # the layer's first differing op
    first_token: int | None
    tokens_differing: int                       # tokens whose last traced output of the layer differs


@dataclass
class DiffReport:
    identical: bool
    token_ids: list[int]
    a: dict[str, str]
    b: dict[str, str]
    first: Divergence | None
    layers: list[LayerSummary]
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["first_divergence"] = d.pop("first")
        return d


def _keyed(trace: Trace) -> dict[tuple[int, str, int], OpTrace]:
    """Ops by (layer, op, occurrence): an op recorded twice in a layer stays two entries."""
    seen: dict[tuple[int, str], int] = {}
    out = {}
    for o in trace.ops:
        n = seen.get((o.layer, o.op), 0)
        seen[(o.layer, o.op)] = n + 1
        out[(o.layer, o.op, n)] = o
    return out


def _ordered_int(bits: int, width: int) -> int:
    """A float's bit pattern mapped to an integer that orders like the float (-0 == +0)."""
    sign = 1 << (width - 1)
    return bits if not bits & sign else -(bits & (sign - 1))


_FLOAT_BITS = {torch.float32: (torch.int32, 32), torch.bfloat16: (torch.int16, 16), torch.float16: (torch.int16, 16),
               torch.float64: (torch.int64, 64)}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """How many representable values of their (common, float) dtype lie between scalars a and b; None for
    NaN, integers or two dtypes."""
    if a.dtype != b.dtype or a.dtype not in _FLOAT_BITS or bool(torch.isnan(a)) or bool(torch.isnan(b)):
        return None
    view, width = _FLOAT_BITS[a.dtype]
    mask = (1 << width) - 1
    ia = int(a.reshape(1).view(view)[0]) & mask
    ib = int(b.reshape(1).view(view)[0]) & mask
    return abs(_ordered_int(ia, width) - _ordered_int(ib, width))


def _scalar(x: torch.Tensor) -> float | int:
    return float(x) if x.dtype.is_floating_point else int(x)


def _first_element(oa: OpTrace, ob: OpTrace, token: int, div: Divergence, experts: tuple[OpTrace | None, ...]) -> None:
    """Fill in the first differing element of `token`'s rows, both values and their ULP distance."""
    ta, tb = oa.tensor(), ob.tensor()
    if ta is None or tb is None or ta.shape != tb.shape:
        return
    ra, rb = ta[token].reshape(-1), tb[token].reshape(-1)
    if ra.dtype == rb.dtype:
        view = _FLOAT_BITS.get(ra.dtype, (ra.dtype, 0))[0]
        differs = ra.view(view) != rb.view(view)              # bit patterns: -0 and +0, NaN payloads count
    else:
        differs = ra.double() != rb.double()
    where = torch.nonzero(differs)
    if not len(where):
        return
    flat = int(where[0])
    div.index = [int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(ta.shape[1:]))] if ta.dim() > 1 else []
    div.a, div.b = _scalar(ra[flat]), _scalar(rb[flat])
    va, vb = ra[flat], rb[flat]
    if va.dtype != vb.dtype and va.dtype.is_floating_point and vb.dtype.is_floating_point:
        # Two dtypes (a bf16 side beside an fp32 one): count ULPs of the coarser, the finer value rounded to it.
        coarse = max(va.dtype, vb.dtype, key=lambda d: torch.finfo(d).eps)
        va, vb = va.to(coarse), vb.to(coarse)
    div.ulp = ulp_distance(va, vb)
    div.ulp_dtype = dtype_name(va.dtype) if div.ulp is not None else ""
    if oa.op == "mlp.experts" and div.index:
        ids = [e.tensor() if e is not None else None for e in experts]
        slot = div.index[0]
        names = [f"{s} expert {int(t[token, slot])}" for s, t in zip("AB", ids) if t is not None]
        div.note = f"slot {slot}: " + ", ".join(names) if names else f"slot {slot}"


def compare(a: Trace, b: Trace) -> DiffReport:
    """Compare two traces of the same tokens (ValueError when the tokens differ)."""
    if list(a.token_ids) != list(b.token_ids):
        raise ValueError(f"the two sides traced different tokens: {a.token_ids[:8]}... vs {b.token_ids[:8]}...")
    ka, kb = _keyed(a), _keyed(b)
    first: Divergence | None = None
    layers: dict[int, LayerSummary] = {}
    last_out: dict[int, list[int]] = {}
    for key, oa in ka.items():
        ob = kb.get(key)
        if ob is None:
            continue
        layer = key[0]
        s = layers.setdefault(layer, LayerSummary(layer, 0, 0, None, None, 0))
        s.ops += 1
        tokens = [t for t, (da, db) in enumerate(zip(oa.digests, ob.digests)) if da != db or oa.dtype != ob.dtype]
        if len(oa.digests) != len(ob.digests):
            tokens = tokens or [min(len(oa.digests), len(ob.digests))]
        last_out[layer] = tokens
        if not tokens:
            continue
        s.differing_ops += 1
        if s.first_op is None:
            s.first_op, s.first_token = oa.op, tokens[0]
        if first is None:
            first = Divergence(layer, oa.op, tokens[0], tokens, a_dtype=oa.dtype, b_dtype=ob.dtype)
            experts = tuple(k.get((layer, "mlp.gate.experts", 0)) for k in (ka, kb))
            _first_element(oa, ob, tokens[0], first, experts)
    for layer, s in layers.items():
        s.tokens_differing = len(last_out.get(layer, []))
    only_a = [f"{k[0]}:{k[1]}" for k in ka if k not in kb]
    only_b = [f"{k[0]}:{k[1]}" for k in kb if k not in ka]
    # Decoder layers in order, then the ops outside them (embedding, final norm, logits, logprobs).
    summary = [layers[n] for n in sorted(layers) if n != MODEL_LAYER] + [layers[n] for n in layers if n == MODEL_LAYER]
    identical = first is None and not only_a and not only_b
    return DiffReport(identical, list(a.token_ids), dict(a.meta), dict(b.meta), first, summary, only_a, only_b)


# ----------------------------------------------------------------------------- the sides

@dataclass(frozen=True)
class Side:
    """One side of a diff: kind "service" (address), "local" (in-process spec) or "file" (path)."""

    kind: str
    where: str
    options: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        return self.where if self.kind != "local" else "local:" + ",".join([self.where, *(f"{k}={v}" for k, v in self.options)])


def parse_side(text: str) -> Side:
    """"host:port" | "local:MODEL[,key=value...]" | a trace file (an existing path or *.json)."""
    if text.startswith("local:"):
        model, *opts = text[len("local:"):].split(",")
        pairs = []
        for o in opts:
            k, sep, v = o.partition("=")
            if not sep or k not in ("backend", "dtype", "seed"):
                raise ValueError(f"{text!r}: options are backend=, dtype=, seed= (got {o!r})")
            pairs.append((k, v))
        return Side("local", model or "tiny", tuple(pairs))
    if text.endswith(".json") or os.path.exists(text):
        return Side("file", text)
    return Side("service", text)


@dataclass
class _Fetched:
    trace: Trace
    logprobs: list[float] | None            # what the service returned beside the trace (None: file / local)


def _local_model(side: Side):
    from zerokl.kernels.model import Model, ModelConfig
    opts = dict(side.options)
    dtype = getattr(torch, opts.get("dtype", "float32"))
    if os.path.isdir(side.where):
        return Model.from_pretrained(side.where, dtype)
    return Model(ModelConfig.preset(side.where), seed=int(opts.get("seed", 0)), dtype=dtype)


def _trace_local(side: Side, ids: Sequence[int], sampling: dict[str, Any], capture: Sequence[str]) -> Trace:
    from zerokl.kernels.backend import device_name, get_backend, use_backend
    backend = dict(side.options).get("backend") or get_backend()
    model = _local_model(side)
    if torch.cuda.is_available() and backend != "torch":
        model = model.cuda()
    with use_backend(backend):
        meta = {"service": "local", "backend": backend, "dtype": dtype_name(model.dtype),
                "device": device_name(model.embed_tokens.weight.device, backend), "weights_version": side.where}
        return trace_sequence(model, ids, capture=capture, meta=meta, **sampling)


async def _trace_service(side: Side, ids: Sequence[int] | None, text: str | None, sampling: dict[str, Any],
                         capture: Sequence[str], security) -> _Fetched:
    import grpc
    from opentelemetry import trace as otel

    from zerokl.services.inference import convert as inference_convert
    from zerokl.services.runtime.optrace import trace_options_to_proto
    from zerokl.services.runtime.server import create_channel
    from zerokl.services.trainer import convert as trainer_convert
    from zerokl.v1 import common_pb2, inference_pb2, inference_pb2_grpc, trainer_pb2, trainer_pb2_grpc

    options = trace_options_to_proto(capture)
    async with create_channel(side.where, token=security.token, credentials=security.credentials(),
                              tracer_provider=otel.NoOpTracerProvider()) as channel:
        try:
            info = await inference_pb2_grpc.InferenceStub(channel).Info(common_pb2.InfoRequest(), timeout=30)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            info = await trainer_pb2_grpc.TrainerStub(channel).Info(common_pb2.InfoRequest(), timeout=30)
        if info.service == "trainer":
            if ids is None:
                raise ValueError(f"{side.where} is the trainer, which has no tokenizer: give --prompt-ids "
                                 "(or put a replica on the other side)")
            if len(ids) < 2:
                raise ValueError("the trainer scores completions: give at least two token ids")
            completion = trainer_pb2.Completion(prompt_ids=list(ids[:1]), completion_ids=list(ids[1:]), **sampling)
            resp = await trainer_pb2_grpc.TrainerStub(channel).ForwardLogprobs(
                trainer_pb2.ForwardLogprobsRequest(completions=[completion], trace=options))
            got = trainer_convert.logprobs_trace(resp)
            lps = list(resp.logprobs[0].values)
        else:
            req = inference_pb2.ScoreRequest(sampling=inference_pb2.SamplingParams(**sampling), trace=options)
            if ids is not None:
                req.prompt_token_ids.ids.extend(ids)
            else:
                req.prompt_text = text or ""
            resp = await inference_pb2_grpc.InferenceStub(channel).Score(req)
            got = inference_convert.score_response_trace(resp)
            lps = list(resp.logprobs)
    if got is None:
        raise RuntimeError(f"{side.where} answered without a trace (a server from before zerokl diff?)")
    got.meta.setdefault("address", side.where)
    return _Fetched(got, lps)


async def trace_side(side: Side, ids: Sequence[int] | None, text: str | None, sampling: dict[str, Any],
                     capture: Sequence[str] = (), security=None) -> _Fetched:
    """Trace `side` on `ids` (or `text`, tokenized by a replica) under the sampling distribution."""
    if side.kind == "file":
        return _Fetched(Trace.from_json(json.loads(pathlib.Path(side.where).read_text())), None)
    if side.kind == "local":
        if ids is None:
            raise ValueError("an in-process side needs token ids: give --prompt-ids (or a replica on the other side)")
        return _Fetched(await asyncio.to_thread(_trace_local, side, ids, sampling, capture), None)
    from zerokl.up import ClientSecurity
    return await _trace_service(side, ids, text, sampling, capture, security or ClientSecurity())


def _check_logprobs(name: str, fetched: _Fetched, warnings: list[str]) -> None:
    """The trace's own logprobs must be the ones the service returned beside it, bit for bit."""
    if fetched.logprobs is None:
        return
    op = next((o for o in fetched.trace.ops if o.op == "logprobs" and o.layer == MODEL_LAYER), None)
    values = op.tensor() if op is not None else None
    if values is None:
        return
    served = torch.tensor(fetched.logprobs, dtype=torch.float32)
    if values.shape[0] != served.shape[0] or not torch.equal(values.view(-1).view(torch.int32), served.view(torch.int32)):
        warnings.append(f"{name}: the traced forward's logprobs differ from the ones the service returned: its "
                        "serving path does not compute what one sequence alone computes (a batch-invariance bug?) "
                        "or its weights changed meanwhile")


async def diff(a: Side, b: Side, ids: Sequence[int] | None, text: str | None = None,
               sampling: dict[str, Any] | None = None, security=None,
               save: str | None = None) -> DiffReport:
    """Trace both sides, compare, and fetch the first divergent op's rows in full (second pass)."""
    sampling = dict(sampling or {})
    base = ["-1:logprobs"]
    # A replica side first when only text is given: its Score says which ids the text is.
    sides = sorted([("A", a), ("B", b)], key=lambda s: s[1].kind != "service")
    fetched: dict[str, _Fetched] = {}
    for name, side in sides:
        got = await trace_side(side, ids, text, sampling, base, security)
        fetched[name] = got
        if ids is None:
            ids = tuple(got.trace.token_ids)
    report = compare(fetched["A"].trace, fetched["B"].trace)
    first = report.first
    if first is not None and first.a is None:
        capture = [f"{first.layer}:{first.op}"]
        if first.op == "mlp.experts":
            capture.append(f"{first.layer}:mlp.gate.experts")
        for name, side in (("A", a), ("B", b)):
            if side.kind != "file":
                fetched[name] = await trace_side(side, ids, None, sampling, base + capture, security)
        report = compare(fetched["A"].trace, fetched["B"].trace)
        if report.first is None or (report.first.layer, report.first.op) != (first.layer, first.op):
            report.warnings.append("the second trace did not reproduce the first: a side is not deterministic")
    for name in ("A", "B"):
        _check_logprobs(name, fetched[name], report.warnings)
    if save:
        out = pathlib.Path(save)
        out.mkdir(parents=True, exist_ok=True)
        for name in ("A", "B"):
            (out / f"{name.lower()}.json").write_text(json.dumps(fetched[name].trace.to_json()))
    return report


def diff_backends(model, ids: Sequence[int], backend_a: str, backend_b: str) -> DiffReport:
    """One model, one sequence, two backends, in process (e.g. the experiment's trainer vs its stock inference)."""
    from zerokl.kernels.backend import use_backend
    traces = []
    for backend in (backend_a, backend_b):
        with use_backend(backend):
            traces.append(trace_sequence(model, ids, capture=["*"], meta={"backend": backend}))
    return compare(*traces)


def describe(r: DiffReport) -> str:
    """The first divergence in a few words: "layer 0 input_layernorm, token 3 (1 ULP)" or "none"."""
    f = r.first
    if f is None:
        return "none: every traced op has the same bits" if r.identical else "no common op differs"
    where = "model" if f.layer == MODEL_LAYER else f"layer {f.layer}"
    ulp = f" ({f.ulp} ULP)" if f.ulp is not None else ""
    return f"{where} {f.op}, token {f.token}{ulp}"


# ----------------------------------------------------------------------------- output

def _side_line(name: str, label: str, meta: dict[str, str]) -> str:
    keys = ("service", "backend", "device", "dtype", "weights_version", "numerics_fingerprint")
    short = {"weights_version": "weights", "numerics_fingerprint": "fingerprint"}
    parts = [f"{short.get(k, k)}={meta[k][:16] if k == 'numerics_fingerprint' else meta[k]}" for k in keys if meta.get(k)]
    return f"{name}: {label}  " + " ".join(parts)


def _fmt_value(v: float | int | None) -> str:
    if v is None:
        return "?"
    if isinstance(v, float) and math.isfinite(v):
        return f"{v!r}"
    return str(v)


def format_report(r: DiffReport, a_label: str = "A", b_label: str = "B") -> str:
    """The human-readable report: both sides, the verdict, the first divergence, the per-layer table."""
    lines = [_side_line("A", a_label, r.a), _side_line("B", b_label, r.b),
             f"tokens: {len(r.token_ids)} ({', '.join(map(str, r.token_ids[:12]))}{', ...' if len(r.token_ids) > 12 else ''})"]
    if r.identical:
        ops = sum(s.ops for s in r.layers)
        lines.append(f"identical: every one of {ops} traced ops has the same bits at every token")
    if r.first is not None:
        f = r.first
        where = "model" if f.layer == MODEL_LAYER else f"layer {f.layer}"
        lines.append(f"first divergence: {where}, {f.op}, token {f.token} "
                     f"({len(f.tokens)} of {len(r.token_ids)} tokens differ there)")
        if f.a is not None:
            at = f"element {f.index}" if f.index else "value"
            if f.ulp is None:
                dist = "not comparable in ULPs"
            elif f.a_dtype != f.b_dtype:
                dist = f"dtypes {f.a_dtype} vs {f.b_dtype}: {f.ulp} ULP of {f.ulp_dtype} apart after rounding to it"
            else:
                dist = f"{f.ulp} ULP apart"
            note = f" ({f.note})" if f.note else ""
            lines.append(f"  {at}{note}: A = {_fmt_value(f.a)}, B = {_fmt_value(f.b)}; {dist}")
        elif f.a_dtype != f.b_dtype:
            lines.append(f"  dtypes differ: A {f.a_dtype}, B {f.b_dtype}")
    for what, keys in (("only in A", r.only_in_a), ("only in B", r.only_in_b)):
        if keys:
            lines.append(f"{what}: {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}")
    lines.append("")
    lines.append(f"{'layer':>5}  {'ops':>4}  {'differ':>6}  {'first differing op':<32} {'token':>5}  {'tokens differing at layer end':>29}")
    for s in r.layers:
        name = "model" if s.layer == MODEL_LAYER else str(s.layer)
        first = s.first_op or "-"
        token = "-" if s.first_token is None else str(s.first_token)
        lines.append(f"{name:>5}  {s.ops:>4}  {s.differing_ops:>6}  {first:<32} {token:>5}  {s.tokens_differing:>29}")
    for w in r.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the command

def add_arguments(p: argparse.ArgumentParser) -> None:
    from zerokl.connect import add_security_arguments
    from zerokl.services.runtime.dataclass_flags import int_list
    p.add_argument("a", metavar="A", help="host:port of a replica or the trainer, local:MODEL[,backend=..,dtype=..,seed=..], "
                                          "or a trace file")
    p.add_argument("b", metavar="B", help="the other side, in the same forms")
    p.add_argument("--prompt-ids", type=int_list, default=None, metavar="5,6,7", help="the token ids to trace")
    p.add_argument("--prompt", default=None, help="prompt text instead (tokenized by a replica side)")
    p.add_argument("--temperature", type=float, default=1.0, help="the logprobs' distribution (default %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="the sampling top-k the logprobs are taken under (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="the sampling top-p the logprobs are taken under (1: off)")
    p.add_argument("--save", default=None, metavar="DIR", help="also write the two traces to DIR/a.json, DIR/b.json")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the report")
    add_security_arguments(p)


def run(args: argparse.Namespace) -> int:
    """`zerokl diff`: exit 0 identical, 1 different, 2 not comparable."""
    import grpc

    from zerokl.connect import client_security
    try:
        a, b = parse_side(args.a), parse_side(args.b)
        if args.prompt_ids is None and args.prompt is None and "file" not in (a.kind, b.kind):
            print("zerokl diff: give --prompt-ids or --prompt (a trace file carries its own)", file=sys.stderr)
            return 2
        security = client_security(args, operator=True)
        sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
        report = asyncio.run(diff(a, b, args.prompt_ids, args.prompt, sampling, security, args.save))
    except grpc.aio.AioRpcError as err:
        print(f"zerokl diff: {err.code().name}: {err.details()}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, OSError) as err:
        print(f"zerokl diff: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(format_report(report, a.label, b.label))
    return 0 if report.identical else 1
