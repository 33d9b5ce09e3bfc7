"""Batch-invariance self-test: does a row's result depend on its batch?

For each op, random rows are computed alone and again inside batches of random
size, at a random position, among random neighbours (including neighbours with
longer or shorter key lists), and the bits are compared with torch.equal. The
same harness backs the test suite and `zerokl verify` (a user's check of new
hardware or a new backend).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
from typing import Callable, Sequence

import torch

from zerokl.kernels import ops
from zerokl.kernels.backend import use_backend
from zerokl.kernels.fingerprint import fingerprint, fingerprint_key, golden_digests
from zerokl.kernels.sampling import SamplingParams, sample, sampling_logprobs
from zerokl.kernels.version import __version__

__all__ = ["OpCase", "OP_CASES", "InvarianceResult", "check_op", "GOLDEN_TABLE", "GoldenCheck", "check_golden",
           "SHARD_CHECKS", "check_sharding", "format_table"]

Row = tuple  # the per-row tensors of one op call
_INDEXER_TOPK = 8  # k of the indexer case: below and above its key-list lengths


@dataclasses.dataclass(frozen=True)
class OpCase:
    """How to exercise one op: make random rows, make shared operands, collate rows, call."""

    name: str
    make_row: Callable[[torch.Generator, dict], Row]
    make_shared: Callable[[torch.Generator, dict], tuple]
    collate: Callable[[list[Row]], tuple]
    call: Callable[..., torch.Tensor | tuple]
    dims: dict  # default problem dimensions


@dataclasses.dataclass
class InvarianceResult:
    op: str
    cases: int = 0
    mismatches: int = 0


def _randn(g: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def _stack(rows: list[Row]) -> tuple:
    return tuple(torch.stack([r[i] for r in rows]) for i in range(len(rows[0])))


def _pad_index(rows: list[torch.Tensor]) -> torch.Tensor:
    width = max(r.numel() for r in rows)
    out = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


def _key_list(g: torch.Generator, d: dict) -> torch.Tensor:
    """A random ascending subset of cache slots, 1..max_keys long."""
    n = int(torch.randint(1, d["max_keys"] + 1, (1,), generator=g))
    return torch.randperm(d["slots"], generator=g)[:n].sort().values


def _attention_rows(rows: list[Row]) -> tuple:
    return (torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]), _pad_index([r[2] for r in rows]))


def _sampling_call(logits, temperature, top_k, top_p, seed, position):
    params = SamplingParams(temperature, top_k, top_p, seed, position)
    draw = sample(logits, params)
    return torch.stack([draw.tokens.float(), draw.logprobs,
                        sampling_logprobs(logits, (draw.tokens + 1) % logits.shape[1], params)], 1)


def _sampling_row(g, d):
    v = d["vocab"]
    logits = _randn(g, v) * 3
    logits[int(torch.randint(0, v, (1,), generator=g))] = logits.max()   # an exact tie for greedy
    temperature = torch.tensor([0.0, 0.7, 1.0][int(torch.randint(0, 3, (1,), generator=g))])
    # A third of the rows filter nothing (top_k 0, top_p 1), so batches mix rows that
    # need the vocab sort with rows that do not.
    unfiltered = bool(torch.rand((), generator=g) < 1 / 3)
    top_k = torch.tensor(0) if unfiltered else torch.randint(0, 8, (), generator=g)
    top_p = torch.tensor(1.0) if unfiltered else torch.rand((), generator=g) * 0.5 + 0.5
    return (logits, temperature, top_k, top_p,
            torch.randint(0, 2**40, (), generator=g), torch.randint(0, 4096, (), generator=g))


def _route_call(logits, bias, d):
    w, ids = ops.moe_route(logits, bias, d["top_k"], d["n_group"], d["topk_group"], 2.5)
    return torch.cat([w, ids.float()], 1)


def _expert_row(g, d):
    e, k = d["experts"], d["top_k"]
    ids = torch.randperm(e, generator=g)[:k]
    if torch.rand((), generator=g) < 0.5:           # crowd expert 0 so group sizes vary a lot
        ids[0] = 0 if 0 not in ids[1:] else ids[0]
    return (_randn(g, d["hidden"], dtype=d["dtype"]), torch.rand(k, generator=g), ids)


OP_CASES: dict[str, OpCase] = {
    "linear": OpCase(
        "linear",
        lambda g, d: (_randn(g, d["k"], dtype=d["dtype"]),),
        lambda g, d: (_randn(g, d["n"], d["k"], dtype=d["dtype"]) * 0.1, _randn(g, d["n"])),
        _stack,
        lambda x, w, b: ops.linear(x, w, b),
        {"k": 67, "n": 33, "dtype": torch.float32},
    ),
    "grouped_linear": OpCase(
        "grouped_linear",
        lambda g, d: (_randn(g, d["k"], dtype=d["dtype"]), torch.randint(0, d["groups"], (), generator=g)),
        lambda g, d: (_randn(g, d["groups"], d["n"], d["k"], dtype=d["dtype"]) * 0.1,),
        _stack,
        lambda x, grp, w: _grouped_call(x, grp, w),
        {"k": 40, "n": 24, "groups": 3, "dtype": torch.float32},
    ),
    "rms_norm": OpCase(
        "rms_norm",
        lambda g, d: (_randn(g, d["k"], dtype=d["dtype"]) * 3,),
        lambda g, d: (_randn(g, d["k"]),),
        _stack,
        lambda x, w: ops.rms_norm(x, w, 1e-6),
        {"k": 96, "dtype": torch.float32},
    ),
    "layer_norm": OpCase(
        "layer_norm",
        lambda g, d: (_randn(g, d["k"], dtype=d["dtype"]) * 3 + 1,),
        lambda g, d: (_randn(g, d["k"]), _randn(g, d["k"])),
        _stack,
        lambda x, w, b: ops.layer_norm(x, w, b, 1e-6),
        {"k": 80, "dtype": torch.float32},
    ),
    "log_softmax": OpCase(
        "log_softmax",
        lambda g, d: (_randn(g, d["vocab"], dtype=d["dtype"]) * 4,),
        lambda g, d: (),
        _stack,
        lambda x: torch.cat([ops.log_softmax(x), ops.softmax(x)], -1),
        {"vocab": 333, "dtype": torch.float32},
    ),
    "silu_sigmoid": OpCase(
        "silu_sigmoid",
        lambda g, d: (_randn(g, d["k"], dtype=d["dtype"]) * 6,),
        lambda g, d: (),
        _stack,
        lambda x: torch.cat([ops.silu(x), ops.sigmoid(x)], -1),
        {"k": 37, "dtype": torch.float32},
    ),
    "rope": OpCase(
        "rope",
        lambda g, d: (_randn(g, d["heads"], d["dim"], dtype=d["dtype"]), torch.randint(0, 100000, (), generator=g)),
        lambda g, d: (ops.rope_inv_freq(d["dim"], 10000.0),),
        _stack,
        lambda x, pos, inv: torch.cat([ops.rope(x, pos, inv, True), ops.rope(x, pos, inv, False)], -1),
        {"heads": 3, "dim": 16, "dtype": torch.float32},
    ),
    "mla_attention": OpCase(
        "mla_attention",
        lambda g, d: (_randn(g, d["heads"], d["rank"], dtype=d["dtype"]), _randn(g, d["heads"], d["rope"], dtype=d["dtype"]),
                      _key_list(g, d)),
        lambda g, d: (_randn(g, d["slots"], d["rank"], dtype=d["dtype"]), _randn(g, d["slots"], d["rope"], dtype=d["dtype"])),
        _attention_rows,
        lambda ql, qr, idx, kv, kr: ops.mla_attention(ql, qr, kv, kr, idx, 0.125),
        {"heads": 4, "rank": 32, "rope": 8, "slots": 80, "max_keys": 50, "dtype": torch.float32},
    ),
    "indexer": OpCase(
        "indexer",
        lambda g, d: (_randn(g, d["heads"], d["dim"]), torch.rand(d["heads"], generator=g) - 0.3, _key_list(g, d)),
        lambda g, d: (_randn(g, d["slots"], d["dim"]),),
        _attention_rows,
        lambda q, w, idx, k: _indexer_call(q, w, idx, k, _INDEXER_TOPK),
        {"heads": 4, "dim": 16, "slots": 70, "max_keys": 45},
    ),
    "moe_route": OpCase(
        "moe_route",
        lambda g, d: (_tied_router_logits(g, d),),
        lambda g, d: (torch.randint(-2, 3, (d["experts"],), generator=g).float() * 0.25,),
        _stack,
        lambda logits, bias: _route_call(logits, bias, OP_CASES["moe_route"].dims),
        {"experts": 16, "top_k": 4, "n_group": 4, "topk_group": 2},
    ),
    "moe_experts": OpCase(
        "moe_experts",
        _expert_row,
        lambda g, d: (_randn(g, d["experts"], d["inter"], d["hidden"]) * 0.2, _randn(g, d["experts"], d["inter"], d["hidden"]) * 0.2,
                      _randn(g, d["experts"], d["hidden"], d["inter"]) * 0.2),
        _stack,
        ops.moe_experts,
        {"experts": 6, "top_k": 2, "hidden": 24, "inter": 20, "dtype": torch.float32},
    ),
    "split_linear": OpCase(
        "split_linear",
        lambda g, d: (_randn(g, d["k"], dtype=d["dtype"]),),
        lambda g, d: (_randn(g, d["n"], d["k"], dtype=d["dtype"]) * 0.1, _randn(g, d["n"])),
        _stack,
        lambda x, w, b: ops.split_linear(x, w, b),
        {"k": 96, "n": 33, "dtype": torch.float32},
    ),
    "sampling": OpCase("sampling", _sampling_row, lambda g, d: (), _stack, _sampling_call, {"vocab": 97}),
}


def _grouped_call(x, group, weight):
    order = torch.sort(group, stable=True).indices
    counts = torch.bincount(group, minlength=weight.shape[0]).tolist()
    out = ops.grouped_linear(x[order], weight, [0, *itertools.accumulate(counts)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return out[inverse]


def _indexer_call(q, w, idx, k, topk):
    scores = ops.indexer_scores(q, k, w, idx)
    chosen = ops.topk_positions(scores, idx, topk).float()
    # Score columns beyond a row's own keys are padding; check_op compares the row's own width.
    return torch.cat([chosen, scores], 1)


def _tied_router_logits(g, d):
    e = d["experts"]
    logits = torch.randint(-3, 4, (e,), generator=g).float() * 0.5  # coarse values: many exact ties
    return logits


def _row_slice(out, i: int, width: int | None = None) -> torch.Tensor:
    row = out[i]
    return row if width is None else row[..., :width]


def check_op(case: OpCase, backend: str, seed: int, batches: Sequence[int] = (1, 3, 8, 17),
             dims: dict | None = None, probes: int = 3, device: str | None = None) -> InvarianceResult:
    """Compare `probes` rows alone against the same rows inside random batches.

    Inputs are drawn on CPU (reproducible everywhere) and moved to `device` (default:
    CUDA when present) before each call.
    """
    d = {**case.dims, **(dims or {})}
    g = torch.Generator().manual_seed(seed)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    to_dev = lambda ts: tuple(t.to(device) for t in ts)  # noqa: E731
    shared = to_dev(case.make_shared(g, d))
    result = InvarianceResult(case.name)
    # Rows are compared up to the op's own output width: attention/indexer outputs are
    # padded to the widest neighbour, and padding is not part of the row's result.
    width_of = (lambda r: None) if case.name != "indexer" else (lambda r: _INDEXER_TOPK + r[2].numel())
    with use_backend(backend):
        for _ in range(probes):
            probe = case.make_row(g, d)
            alone = _row_slice(case.call(*to_dev(case.collate([probe])), *shared), 0, width_of(probe))
            for size in batches:
                rows = [case.make_row(g, d) for _ in range(size)]
                where = int(torch.randint(0, size + 1, (1,), generator=g))
                rows.insert(where, probe)
                out = case.call(*to_dev(case.collate(rows)), *shared)
                got = _row_slice(out, where, width_of(probe))
                result.cases += 1
                result.mismatches += int(not torch.equal(got, alone))
    return result


# ---------------------------------------------------------------- golden vectors
#
# The golden table (tests/assets/golden/numerics.json in the source tree) records each op's
# digest per fingerprint key. `zerokl verify` says whether this machine's key has a recorded
# entry and whether its bits match it; a key with no entry is reported, not failed.

GOLDEN_TABLE = pathlib.Path(__file__).resolve().parents[3] / "tests" / "assets" / "golden" / "numerics.json"


@dataclasses.dataclass(frozen=True)
class GoldenCheck:
    key: str                 # the fingerprint key checked, e.g. torch/cpu/float32
    fingerprint: str
    recorded: bool           # the golden table has an entry for this key (and numerics version)
    changed: tuple = ()      # ops whose digests differ from the recorded ones

    def describe(self) -> str:
        if not self.recorded:
            where = GOLDEN_TABLE if GOLDEN_TABLE.exists() else "(no golden table in this install)"
            return f"{self.key}  fingerprint {self.fingerprint}  golden: none recorded for this key {where}"
        verdict = "matches" if not self.changed else f"DIFFERS in {', '.join(self.changed)}"
        return f"{self.key}  fingerprint {self.fingerprint}  golden: {verdict}"


def check_golden(backend: str, dtype: torch.dtype = torch.float32) -> GoldenCheck:
    """Compare this machine's golden digests for `backend` with the recorded table."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    key = fingerprint_key(backend, dtype=dtype)
    table = json.loads(GOLDEN_TABLE.read_text()) if GOLDEN_TABLE.exists() else {}
    entry = table.get("entries", {}).get(key) if table.get("numerics_version") == __version__ else None
    fp = fingerprint(backend, device, dtype)
    if entry is None:
        return GoldenCheck(key, fp, recorded=False)
    with use_backend(backend):
        got = golden_digests(device, dtype)
    want = entry["digests"]
    return GoldenCheck(key, fp, True, tuple(sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))))


# ---------------------------------------------------------------- sharding (tensor parallelism)
#
# A tensor-parallel rank computes an op on a shard of a weight (some output columns, some
# heads, some experts, some K segments). Each check computes the full op once and every
# shard of it for TP degrees 2 and 4, and compares the shards with the matching slices of
# the full result by torch.equal (split_linear: the ranks' partials joined by the tree).

def _r(g: torch.Generator, d: dict, *shape, dtype=None) -> torch.Tensor:
    return _randn(g, *shape, dtype=dtype or d["dtype"]).to(d["device"])


def _shard_linear_columns(g, d, tp):
    x = _r(g, d, d["m"], d["k"])
    w, b = _r(g, d, d["n"] * tp, d["k"]) * 0.1, _r(g, d, d["n"] * tp, dtype=torch.float32)
    full, n = ops.linear(x, w, b), d["n"]
    ok = [torch.equal(ops.linear(x, w[r * n:(r + 1) * n], b[r * n:(r + 1) * n]), full[:, r * n:(r + 1) * n])
          for r in range(tp)]
    return ok + [torch.equal(ops.linear(x, w[1:2], b[1:2]), full[:, 1:2])]    # a one-column shard, off any tile edge


def _shard_split_linear(g, d, tp):
    k = d["k"] // ops.REDUCTION_SPLITS * ops.REDUCTION_SPLITS or ops.REDUCTION_SPLITS
    x, w = _r(g, d, d["m"], k), _r(g, d, d["n"], k) * 0.1
    b, kr = _r(g, d, d["n"], dtype=torch.float32), k // tp
    parts = [ops.split_partial(x[:, r * kr:(r + 1) * kr], w[:, r * kr:(r + 1) * kr], ops.REDUCTION_SPLITS // tp)
             for r in range(tp)]
    return [torch.equal(ops.split_combine(parts, b, x.dtype), ops.split_linear(x, w, b))]


def _shard_attention_heads(g, d, tp):
    h, t = d["heads"] * tp, d["m"]
    ql, qr = _r(g, d, t, h, d["rank"]), _r(g, d, t, h, 8)
    kv, kr = _r(g, d, 60, d["rank"]), _r(g, d, 60, 8)
    idx = _pad_index([_key_list(g, {"slots": 60, "max_keys": 50}) for _ in range(t)]).to(d["device"])
    full, hs = ops.mla_attention(ql, qr, kv, kr, idx, 0.125), d["heads"]
    return [torch.equal(ops.mla_attention(ql[:, r * hs:(r + 1) * hs], qr[:, r * hs:(r + 1) * hs], kv, kr, idx, 0.125),
                        full[:, r * hs:(r + 1) * hs]) for r in range(tp)]


def _shard_experts(g, d, tp):
    e, k, dim, inter = d["heads"] * tp, 2, d["hidden"], d["inter"]
    x = _r(g, d, d["m"], dim)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(d["m"])]).to(d["device"])
    gate, up = _r(g, d, e, inter, dim) * 0.2, _r(g, d, e, inter, dim) * 0.2
    down = _r(g, d, e, dim, inter) * 0.2
    pairs, full = ops.moe_expert_outputs(x, ids, gate, up, down)
    ok, el = [], d["heads"]
    for r in range(tp):
        sl = slice(r * el, (r + 1) * el)
        mine, out = ops.moe_expert_outputs(x, ids, gate[sl], up[sl], down[sl], first_expert=r * el)
        owned = (ids.reshape(-1) // el == r)
        ok.append(torch.equal(mine, torch.nonzero(owned).squeeze(1)) and torch.equal(out, full[owned[pairs]]))
    return ok


SHARD_CHECKS: dict[str, Callable] = {
    "linear_columns": _shard_linear_columns,
    "split_linear_ranks": _shard_split_linear,
    "mla_attention_heads": _shard_attention_heads,
    "experts": _shard_experts,
}
# m rows; linear K and per-rank N; heads (and experts) per rank; latent rank; expert hidden/inter.
SHARD_DIMS = {"m": 5, "k": 67, "n": 24, "heads": 2, "rank": 32, "hidden": 24, "inter": 20, "dtype": torch.float32}


def check_sharding(backend: str, seed: int, dims: dict | None = None, degrees: Sequence[int] = (2, 4),
                   device: str | None = None) -> list[InvarianceResult]:
    """Every op a tensor-parallel rank runs on a shard, compared with the slice of the full op.

    Inputs are drawn on CPU from `seed` and computed on `device` (default CUDA when present).
    """
    d = {**SHARD_DIMS, **(dims or {}), "device": device or ("cuda" if torch.cuda.is_available() else "cpu")}
    results = []
    with use_backend(backend):
        for i, (name, check) in enumerate(SHARD_CHECKS.items()):
            result = InvarianceResult(name)
            for tp in degrees:
                oks = check(torch.Generator().manual_seed(seed * 1000 + i * 10 + tp), d, tp)
                result.cases += len(oks)
                result.mismatches += sum(not ok for ok in oks)
            results.append(result)
    return results


def format_table(rows: list[tuple[str, str, int, int]]) -> str:
    """(backend, check, cases, mismatches) rows as a fixed-width table."""
    wc = max([22] + [len(c) for _, c, _, _ in rows])
    wn = max([6] + [len(str(n)) for _, _, n, _ in rows])
    head = f"{'backend':<8} {'check':<{wc}} {'cases':>{wn}} {'mismatches':>10}"
    lines = [head, "-" * len(head)]
    lines += [f"{b:<8} {c:<{wc}} {n:>{wn}} {m:>10}" for b, c, n, m in rows]
    return "\n".join(lines)
