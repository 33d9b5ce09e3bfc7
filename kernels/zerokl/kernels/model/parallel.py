"""Tensor parallelism applied from outside the model, with the same bits at every TP degree.

    model = Model(config, seed=0)                 # or Model.from_pretrained(...)
    apply_tensor_parallel(model, group)          # shards weights in place, swaps in parallel modules
    logits = model.forward_tokens(tokens, batch, cache)   # identical on every rank, == TP=1 bits

Every rank runs the same tokens (the batch, the KV cache layout and the sampling are
replicated); only weights and the work they imply are split. What is split and how its
result is joined (NUMERICS.md, "Tensor parallelism"):

* column-parallel (no reduction crosses ranks, so nothing to reorder): q_b_proj and
  kv_b_proj by attention heads (MLAttention runs on its local heads), the dense/shared
  MLP's gate_proj and up_proj by hidden units, lm_head by vocabulary (logits all-gathered,
  so log_softmax and sampling see the full row exactly as on one device). A column's
  bits never depend on how many columns a weight has (kernels: fixed column tiles).
* row-parallel (o_proj, dense and shared-expert down_proj): the single-device op is
  ops.split_linear, whose K reduction is REDUCTION_SPLITS segments joined by a fixed
  pairwise tree. A rank holds REDUCTION_SPLITS / tp aligned segments, reduces them to its
  subtree (ops.split_partial), the fp32 subtrees are all-gathered and joined by the same
  tree (ops.split_combine): the same additions in the same order as on one device.
* expert-parallel (routed experts): rank r holds experts [r E/tp, (r+1) E/tp). The router
  is replicated, so every rank knows every (token, slot) pair's owner; each rank runs its
  pairs, the outputs are all-gathered (packed, owner order) and each slot takes its
  owner's value (a select, no arithmetic), then the single-device fixed-order combine.
* replicated: embeddings, norms, q_a/kv_a projections, the indexer, the router, the KV
  cache (MLA's latent is shared by all heads, so every rank keeps the full cache).

`mode="all_reduce"` is the conventional layout joined by plain `dist.all_reduce` sums (the
Megatron/vLLM way): it exists as the baseline the tests and benchmarks compare against;
its bits depend on the TP degree and the collective's algorithm.

Training (the exact layout): each join has its transpose (a row-parallel join passes the
replicated dL/dy to every rank's subtree; the vocabulary gather keeps the rank's columns;
the expert exchange keeps the rank's pairs), and a replicated activation entering a
sharded consumer (q_b_proj's input, the latent and rope key feeding the local heads, the
MLP's and local experts' input, lm_head's input) all-reduces its gradient over the group
(copy_to_parallel, Megatron's `f`). Gradients equal one device's up to the order of those
sums. The all_reduce baseline is forward only.

DispatchMoE is expert parallelism over ranks holding different tokens (the trainer's data
ranks): all-to-all dispatch, the same per-pair results and the one-device combine order.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from zerokl.kernels import ops
from zerokl.kernels.backend import backend_module, get_backend
from zerokl.kernels.ops import REDUCTION_SPLITS
from zerokl.kernels.model.model import MLP, Linear, MLAttention, Model, MoE, RMSNorm

__all__ = ["MODES", "JOINS", "DEFAULT_JOIN", "COLUMN_ALIGN", "p2p_join_available", "row_parallel_join", "apply_tensor_parallel", "shard_state_dict", "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP",
           "ExpertParallelMoE", "DispatchMoE", "ColumnShardLinear", "copy_to_parallel", "supported_tp_degrees"]

MODES = ("exact", "all_reduce")
# Vocabulary shards start at multiples of this many rows: Triton's bf16 GEMM column tile
# (BLOCK_N), so every logit sits at the same position of the same tile shape as on one
# device (GPU tensor cores are not promised position-blind; the torch backend's sums are
# exact and need no alignment).
COLUMN_ALIGN = 128


# ----------------------------------------------------------------------------- collectives

class _NoBackward(torch.autograd.Function):
    """Marks a collective's output in the all_reduce baseline layout: no backward there."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("backward through the all_reduce baseline layout is not implemented "
                                  "(the exact layout trains)")


def _no_backward(t: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    return _NoBackward.apply(t) if torch.is_grad_enabled() and any(i.requires_grad for i in inputs) else t


def _wants_grad(*inputs: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(i.requires_grad for i in inputs)


class _Copy(torch.autograd.Function):
    """A replicated activation entering a sharded consumer: identity forward; backward sums
    the ranks' partial gradients (each rank's consumer saw only its shard), Megatron's `f`."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def copy_to_parallel(t: torch.Tensor, group) -> torch.Tensor:
    """`t` unchanged; its gradient all-reduced over `group` (no-op at one rank or without grad)."""
    if dist.get_world_size(group) == 1 or not _wants_grad(t):
        return t
    return _Copy.apply(t, group)


class _Join(torch.autograd.Function):
    """row_parallel_join with its transpose: y = tree(parts) rounded, so dy/dpart_r = 1 and
    every rank (holding the replicated dL/dy) passes it to its own subtree."""

    @staticmethod
    def forward(ctx, part, group, dtype, how):
        return row_parallel_join(part, group, dtype, how)

    @staticmethod
    def backward(ctx, grad):
        return grad.float(), None, None, None


class _GatherColumns(torch.autograd.Function):
    """Column shards [.., rows] all-gathered to [.., out_features]; backward keeps this rank's columns."""

    @staticmethod
    def forward(ctx, y, group, out_features):
        ctx.rank, ctx.rows = dist.get_rank(group), y.shape[-1]
        return torch.cat(_all_gather(y, group), dim=-1)[..., :out_features]

    @staticmethod
    def backward(ctx, grad):
        lo = ctx.rank * ctx.rows
        mine = grad[..., lo:lo + ctx.rows]
        if mine.shape[-1] < ctx.rows:         # the vocabulary padding: no logits there, zero gradient
            mine = torch.cat([mine, mine.new_zeros(*mine.shape[:-1], ctx.rows - mine.shape[-1])], -1)
        return mine.contiguous(), None, None


class _AllToAll(torch.autograd.Function):
    """Rows [sum(send), D] to the ranks of `group` (send[r] rows to rank r, in order) -> the rows
    received [sum(recv), D] (rank order). Moves bytes only; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = rows.new_empty(sum(recv), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


class _Exchange(torch.autograd.Function):
    """Pairs owned by the ranks of `group` (owner [P], this rank's outputs y [P_mine, D] in
    ascending pair order) -> every pair's output [P, D]: each takes its owner's value (a
    select). Backward: this rank's pairs' gradients."""

    @staticmethod
    def forward(ctx, y, owner, group):
        rank = dist.get_rank(group)
        ctx.mine = owner == rank
        counts = torch.bincount(owner, minlength=dist.get_world_size(group)).tolist()
        width = max(counts) if counts else 0
        packed = torch.cat([y, y.new_zeros(width - y.shape[0], y.shape[1])]) if width > y.shape[0] else y
        out = y.new_empty(owner.numel(), y.shape[1])
        for r, got in enumerate(_all_gather(packed, group)):
            out[owner == r] = got[:counts[r]]        # rank r's pairs, ascending: the order it packed them
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.mine].contiguous(), None, None


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's `t` (same shape everywhere), in rank order. Moves bytes only."""
    t = t.detach().contiguous()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return out


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


# ----------------------------------------------------------------------------- parallel modules

class ColumnParallelLinear(nn.Module):
    """y = x @ W.T with W split by output rows; every rank gets the full y (all-gather).

    weight: this rank's rows, zero-padded to the common shard height (ceil(N / tp) rounded
    up to COLUMN_ALIGN); `out_features` trims the padding after the gather. Used for
    lm_head (the vocabulary).
    """

    def __init__(self, weight: torch.Tensor, out_features: int, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.out_features, self.group = out_features, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.linear(copy_to_parallel(x, self.group), self.weight)
        if _wants_grad(y):
            return _GatherColumns.apply(y, self.group, self.out_features)
        return torch.cat(_all_gather(y, self.group), dim=-1)[..., :self.out_features]


class ColumnShardLinear(Linear):
    """A head-sharded projection (q_b_proj): this rank's output rows, output left sharded
    (the heads that follow are local); the replicated input's gradient is all-reduced."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(copy_to_parallel(x, self.tp_group), self.weight)


class _ReplicatedNorm(RMSNorm):
    """kv_a_layernorm under TP: the latent it makes feeds only this rank's heads, so the
    latent's gradient is partial per rank and is all-reduced here (forward unchanged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_parallel(super().forward(x), self.tp_group)


class _RopeSplitLinear(Linear):
    """kv_a_proj_with_mqa under TP: [latent | rope key]; the rope key feeds only this rank's
    heads (its gradient is all-reduced), the latent goes through _ReplicatedNorm first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kv = ops.linear(x, self.weight)
        if not _wants_grad(kv) or dist.get_world_size(self.tp_group) == 1:
            return kv
        r = self.kv_lora_rank
        return torch.cat([kv[:, :r], copy_to_parallel(kv[:, r:], self.tp_group)], dim=-1)


JOINS = ("auto", "p2p", "gather", "all_reduce_fp32", "reduce_scatter", "gather_list")
DEFAULT_JOIN = "auto"      # p2p where every GPU of the group maps its peers; else all_reduce_fp32 at 2 ranks, else gather


def _tree_round(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """split_combine over the leading dim of fp32 [tp, ...] (rank order), rounded to dtype: one
    Triton launch on CUDA, torch adds elsewhere (the same IEEE additions in the same tree)."""
    if parts.device.type == "cuda" and get_backend() == "triton":
        return backend_module("triton").tree_combine(parts, dtype)
    return ops.split_combine(list(parts.unbind(0)), None, dtype)


class _PeerJoin:
    """The exact join over GPU peer memory (torch symmetric memory; no NVLink multicast).

    Each rank copies its fp32 subtree into its slot of a symmetric buffer, one barrier kernel
    tells every rank that all subtrees are written, then every rank reads the tp subtrees
    where they lie (peer GPUs' memory mapped into this one) and finishes the single-device
    tree: at two ranks one fp32 addition rounded on store (`torch.add(p0, p1, out=bf16)`,
    torch's rounding), from four on the Triton tree kernel over the planes' addresses. Exact
    at any supported degree, 3 launches, no NCCL call: at these sizes a join is all latency,
    and NCCL's is what made the collective joins cost 1.3x and more (docs/perf.md).

    Two slots alternate, so one barrier per join is enough: a rank writes slot s again only
    after the next join's barrier, which every peer reaches only after its read of slot s.
    Buffers grow (collectively: every rank joins the same shapes) and are kept while the
    process lives, since a peer may still read a retired one.
    """

    SLOTS = 2

    def __init__(self, group):
        self.group, self.tp = group, dist.get_world_size(group)
        self.capacity, self.step = 0, 0
        self.buffers: list = []                   # (symmetric tensor, handle), newest last
        self.views: dict[tuple[int, int], tuple] = {}   # (slot, numel) -> (rank-order planes, address table)

    def _grow(self, numel: int, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        with warnings.catch_warnings():                # needed by older torch, deprecated by newer
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(self.group.group_name)
        cap = max(1 << 16, 1 << (numel - 1).bit_length())
        buf = symm_mem.empty(self.SLOTS * cap, dtype=torch.float32, device=device)
        handle = symm_mem.rendezvous(buf, self.group)
        if handle.get_buffer(handle.rank, (1,), torch.float32, 0).data_ptr() != buf.data_ptr():
            raise RuntimeError("symmetric memory: get_buffer does not address this rank's buffer")
        self.buffers.append((buf, handle))
        self.capacity, self.views = cap, {}

    def _planes(self, slot: int, n: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Every rank's slot-`slot` plane of n fp32 values as tensors on this GPU (rank order),
        and from four ranks their addresses as an int64 tensor there (for the tree kernel)."""
        key = (slot, n)
        if key not in self.views:
            buf, handle = self.buffers[-1]
            planes = [handle.get_buffer(r, (n,), torch.float32, slot * self.capacity) for r in range(self.tp)]
            table = None if self.tp == 2 else \
                torch.tensor([p.data_ptr() for p in planes], dtype=torch.int64).to(buf.device)
            self.views[key] = planes, table
        return self.views[key]

    def __call__(self, part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        n = part.numel()
        if n == 0:
            return torch.empty(part.shape, dtype=dtype, device=part.device)
        if n > self.capacity:
            self._grow(n, part.device)
        _, handle = self.buffers[-1]
        slot = self.step % self.SLOTS
        self.step += 1
        planes, table = self._planes(slot, n)
        planes[handle.rank].copy_(part.view(-1))
        handle.barrier(channel=0)
        if self.tp == 2:       # the tree's one level; the add computes in fp32 and rounds on store
            out = torch.empty(part.shape, dtype=dtype, device=part.device)
            torch.add(planes[0], planes[1], out=out.view(-1))
            return out
        return backend_module("triton").tree_combine_planes(table, tuple(part.shape), dtype)


_PEER_JOINS: dict[str, _PeerJoin | None] = {}


def _peer_join(group) -> _PeerJoin | None:
    """The group's _PeerJoin, or None where its GPUs cannot map each other (decided once, by
    all ranks together, so every rank picks the same join)."""
    key = group.group_name
    if key not in _PEER_JOINS:
        ok = torch.cuda.is_available() and get_backend() == "triton"
        try:
            from torch.distributed import _symmetric_memory  # noqa: F401
        except ImportError:
            ok = False
        if ok:      # every rank's GPU index, then each checks it can map all of them
            here = torch.cuda.current_device()
            devices = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=here)
            dist.all_gather_into_tensor(devices, torch.tensor([here], dtype=torch.int64, device=here), group=group)
            ok = all(d == here or torch.cuda.can_device_access_peer(here, d) for d in devices.tolist())
            flag = torch.tensor([int(ok)], device=here)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            ok = bool(flag.item())
        _PEER_JOINS[key] = _PeerJoin(group) if ok else None
    return _PEER_JOINS[key]


def p2p_join_available(group) -> bool:
    """Whether row_parallel_join's p2p join runs on `group` (collective on first use per group)."""
    return _peer_join(group) is not None


def row_parallel_join(part: torch.Tensor, group, dtype: torch.dtype, how: str | None = None) -> torch.Tensor:
    """Join the ranks' fp32 split-tree subtrees into split_linear's bits, rounded to `dtype`.

    auto (default): p2p where the group's GPUs map each other's memory, else all_reduce_fp32
    with two ranks, else gather. p2p: every rank reads the peers' subtrees in place and runs
    the tree (_PeerJoin). gather: one all_gather_into_tensor of the fp32 subtrees, then every
    rank finishes the fixed tree and rounds in one pass. gather_list: the same through a list
    all_gather and torch adds (the first implementation). All three are exact at any
    supported degree. With two ranks the last tree level is ONE fp32 addition p01 + p23 per
    element and IEEE addition is commutative, so a sum-collective computes it exactly
    whatever its algorithm: all_reduce_fp32 (one collective) or reduce_scatter (fp32
    reduce-scatter, round, bf16 all-gather). With more ranks a collective sums in its own
    order: only the gathers and p2p are exact.
    """
    tp = dist.get_world_size(group)
    how = how or DEFAULT_JOIN
    part = part.detach().float().contiguous()
    if tp == 1:
        return ops.split_combine([part], None, dtype)
    if how in ("auto", "p2p") and part.device.type == "cuda":
        peer = _peer_join(group)
        if peer is not None:
            return peer(part, dtype)
        if how == "p2p":
            raise RuntimeError("row_parallel_join: p2p needs CUDA GPUs that map each other's memory "
                               "(torch.cuda.can_device_access_peer) and the triton backend")
    if how in ("auto", "p2p"):
        how = "all_reduce_fp32" if tp == 2 else "gather"
    if how == "gather_list":
        return ops.split_combine(_all_gather(part, group), None, dtype)
    if how == "gather":
        buf = torch.empty(tp * part.numel(), dtype=torch.float32, device=part.device)
        dist.all_gather_into_tensor(buf, part.view(-1), group=group)         # rank r's subtree at [r]
        return _tree_round(buf.view(tp, *part.shape), dtype)
    if tp != 2:
        raise ValueError(f"row_parallel_join: {how!r} is exact only with 2 ranks (got {tp})")
    if how == "all_reduce_fp32":
        t = part.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t.to(dtype)
    if how == "reduce_scatter":
        flat = part.view(-1)
        if flat.numel() % 2:
            return row_parallel_join(part, group, dtype, "all_reduce_fp32")
        half = torch.empty(flat.numel() // 2, dtype=torch.float32, device=part.device)
        dist.reduce_scatter_tensor(half, flat, op=dist.ReduceOp.SUM, group=group)
        out = torch.empty(flat.numel(), dtype=dtype, device=part.device)
        dist.all_gather_into_tensor(out, half.to(dtype), group=group)
        return out.view(part.shape)
    raise ValueError(f"row_parallel_join: unknown join {how!r}; expected one of {JOINS}")


class RowParallelLinear(nn.Module):
    """y = x @ W.T with W split by input columns (this rank's K shard); every rank gets the full y.

    exact: this rank's split-tree subtree in fp32, all-gathered, joined by the single-device
    tree, rounded once: bitwise ops.split_linear on one device. all_reduce: the rank's
    rounded partial product summed by dist.all_reduce (order up to the collective).
    """

    def __init__(self, weight: torch.Tensor, group, mode: str = "exact"):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group, self.mode = group, mode
        self.join = DEFAULT_JOIN              # row_parallel_join's `how` (apply_tensor_parallel sets it)
        self.splits = REDUCTION_SPLITS // dist.get_world_size(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "all_reduce":
            return _no_backward(_all_reduce(ops.linear(x, self.weight), self.group), x)
        part = ops.split_partial(x, self.weight, self.splits)                    # fp32 [.., N]
        if _wants_grad(part):
            return _Join.apply(part, self.group, x.dtype, self.join)
        return row_parallel_join(part, self.group, x.dtype, self.join)


class ParallelMLP(nn.Module):
    """SwiGLU MLP with gate/up column-parallel and down row-parallel (same hidden-unit shard)."""

    def __init__(self, mlp: MLP, rank: int, tp: int, group, mode: str):
        super().__init__()
        hidden = mlp.gate_proj.weight.shape[0]
        lo, hi = rank * hidden // tp, (rank + 1) * hidden // tp
        self.gate_proj, self.up_proj = _linear_rows(mlp.gate_proj, lo, hi), _linear_rows(mlp.up_proj, lo, hi)
        self.down_proj = RowParallelLinear(mlp.down_proj.weight.detach()[:, lo:hi].clone(), group, mode)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.swiglu(copy_to_parallel(x, self.group), self.gate_proj.weight, self.up_proj.weight))


class ExpertParallelMoE(nn.Module):
    """Routed experts split across ranks, router and shared expert as on one device (the
    shared expert's MLP itself tensor-parallel)."""

    def __init__(self, moe: MoE, rank: int, tp: int, group, mode: str):
        super().__init__()
        n_experts = moe.gate_proj.shape[0]
        self.n_local, self.rank, self.group, self.mode = n_experts // tp, rank, group, mode
        self.first = rank * self.n_local
        sl = slice(self.first, self.first + self.n_local)
        self.gate = moe.gate                                                        # replicated router
        self.gate_proj = nn.Parameter(moe.gate_proj.detach()[sl].clone(), requires_grad=False)
        self.up_proj = nn.Parameter(moe.up_proj.detach()[sl].clone(), requires_grad=False)
        self.down_proj = nn.Parameter(moe.down_proj.detach()[sl].clone(), requires_grad=False)
        self.shared_experts = ParallelMLP(moe.shared_experts, rank, tp, group, mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        t, k = ids.shape
        if self.mode == "all_reduce":
            pairs, y = ops.moe_expert_outputs(x, ids, self.gate_proj, self.up_proj, self.down_proj, self.first)
            # Conventional EP: each rank combines its own slots, the ranks' sums are all-reduced.
            mine = torch.zeros(t * k, x.shape[1], dtype=y.dtype, device=x.device).index_copy(0, pairs, y)
            owned = (ids // self.n_local == self.rank).to(weights.dtype)
            routed = _no_backward(_all_reduce(ops.moe_combine(weights * owned, mine.view(t, k, -1)), self.group), x)
        else:
            _, y = ops.moe_expert_outputs(copy_to_parallel(x, self.group), ids, self.gate_proj, self.up_proj,
                                          self.down_proj, self.first)
            routed = ops.moe_combine(weights, self._exchange(ids, y).view(t, k, -1))
        return (routed + self.shared_experts(x).float()).to(x.dtype)

    def _exchange(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """All ranks' expert outputs in (token, slot) order [T*k, D]: each slot takes its owner's
        value. Owners and counts follow from the replicated routing, so only outputs travel:
        each rank sends its pairs packed (padded to the largest rank's count)."""
        return _Exchange.apply(y, ids.reshape(-1) // self.n_local, self.group)


class DispatchMoE(nn.Module):
    """Expert parallelism over ranks holding DIFFERENT tokens (data ranks), with all-to-all
    token dispatch; optionally each expert-parallel rank's experts split again over its TP
    group (tokens replicated there, as ExpertParallelMoE).

    Expert-parallel rank e of `ep` holds experts [e E/ep, (e+1) E/ep); within it TP rank t
    holds the t-th 1/tp of those. Forward: route locally (replicated router); sort this
    rank's (token, slot) pairs by owner (stable: ascending pair order within an owner); one
    all-to-all sends their token rows and expert ids; the owner runs them through its
    experts as one-slot tokens (ops.moe_expert_outputs with first_expert: a pair's result
    depends only on its token row and its expert's weights); a second all-to-all brings
    the outputs back; the one-device fixed-order combine (ops.moe_combine) runs in
    (token, slot) order. Same bits as MoE on one device. Backward: the all-to-alls'
    transposes (torch.distributed.nn.functional), so an expert's gradient sums every
    data rank's tokens routed to it.
    """

    def __init__(self, moe: MoE, ep_group, tp_group=None, mode: str = "exact"):
        super().__init__()
        if mode != "exact":
            raise ValueError("DispatchMoE: only the exact layout")
        n_experts = moe.gate_proj.shape[0]
        self.ep_group, self.tp_group = ep_group, tp_group
        self.ep, self.tp = dist.get_world_size(ep_group), (dist.get_world_size(tp_group) if tp_group else 1)
        e_rank, t_rank = dist.get_rank(ep_group), (dist.get_rank(tp_group) if tp_group else 0)
        if n_experts % (self.ep * self.tp):
            raise ValueError(f"DispatchMoE: n_routed_experts = {n_experts} is not divisible by ep * tp = "
                             f"{self.ep * self.tp}")
        self.per_ep = n_experts // self.ep
        self.per_tp = self.per_ep // self.tp
        self.ep_first = e_rank * self.per_ep
        self.first = self.ep_first + t_rank * self.per_tp
        sl = slice(self.first, self.first + self.per_tp)
        self.gate = moe.gate
        self.gate_proj = nn.Parameter(moe.gate_proj.detach()[sl].clone(), requires_grad=moe.gate_proj.requires_grad)
        self.up_proj = nn.Parameter(moe.up_proj.detach()[sl].clone(), requires_grad=moe.up_proj.requires_grad)
        self.down_proj = nn.Parameter(moe.down_proj.detach()[sl].clone(), requires_grad=moe.down_proj.requires_grad)
        self.shared_experts = (ParallelMLP(moe.shared_experts, t_rank, self.tp, tp_group, mode) if self.tp > 1
                               else moe.shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.sort(flat // self.per_ep, stable=True).indices            # pairs grouped by owner
        send = torch.bincount(flat // self.per_ep, minlength=self.ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        rows = copy_to_parallel(x, self.tp_group) if self.tp > 1 else x
        rows = rows[order // k]                                                  # [T*k, D], owner order
        got_ids = flat.new_empty(sum(recv_sizes))
        dist.all_to_all_single(got_ids, flat[order].contiguous(), recv_sizes, send_sizes, group=self.ep_group)
        got = _AllToAll.apply(rows, send_sizes, recv_sizes, self.ep_group)
        _, y = ops.moe_expert_outputs(got, got_ids.view(-1, 1), self.gate_proj, self.up_proj, self.down_proj,
                                      self.first)
        if self.tp > 1:                     # this EP rank's experts are split over its TP group
            y = _Exchange.apply(y, (got_ids - self.ep_first) // self.per_tp, self.tp_group)
        back = _AllToAll.apply(y, recv_sizes, send_sizes, self.ep_group)
        outputs = back[torch.argsort(order)]                                    # (token, slot) order
        routed = ops.moe_combine(weights, outputs.view(t, k, -1))
        return (routed + self.shared_experts(x).float()).to(x.dtype)


# ----------------------------------------------------------------------------- the transform

def supported_tp_degrees() -> tuple[int, ...]:
    """TP degrees whose row-parallel layers reproduce the single-device split tree."""
    return tuple(2 ** i for i in range(REDUCTION_SPLITS.bit_length()) if REDUCTION_SPLITS % 2 ** i == 0)


def _linear_rows(module: Linear, lo: int, hi: int, cls: type = Linear) -> Linear:
    out = cls(module.weight.shape[1], hi - lo)
    out.weight = nn.Parameter(module.weight.detach()[lo:hi].clone(), requires_grad=False)
    return out


def _check(model: Model, tp: int, mode: str) -> None:
    c = model.config
    problems = []
    if mode not in MODES:
        problems.append(f"mode must be one of {MODES}, got {mode!r}")
    if tp not in supported_tp_degrees():
        problems.append(f"TP degree {tp} does not divide REDUCTION_SPLITS = {REDUCTION_SPLITS} "
                        f"(supported: {supported_tp_degrees()})")
    if c.num_attention_heads % tp:
        problems.append(f"num_attention_heads = {c.num_attention_heads} is not divisible by TP = {tp}")
    if c.n_routed_experts % tp:
        problems.append(f"n_routed_experts = {c.n_routed_experts} is not divisible by TP = {tp}")
    for name, k in [("num_attention_heads * v_head_dim", c.num_attention_heads * c.v_head_dim),
                    ("intermediate_size", c.intermediate_size),
                    ("moe_intermediate_size * n_shared_experts", c.moe_intermediate_size * c.n_shared_experts)]:
        if k % REDUCTION_SPLITS:
            problems.append(f"{name} = {k} is not divisible into REDUCTION_SPLITS = {REDUCTION_SPLITS} segments")
    if any(parametrize.is_parametrized(m) for m in model.modules()):
        problems.append("the model has parametrizations (LoRA): merge them before sharding")
    if getattr(model, "tp_size", 1) != 1:
        problems.append("the model is already tensor-parallel")
    if problems:
        raise ValueError("apply_tensor_parallel: " + "; ".join(problems))


@torch.no_grad()
def shard_state_dict(state_dict: dict[str, torch.Tensor], config, group=None, dtype: torch.dtype = torch.float32,
                     mode: str = "exact") -> dict[str, torch.Tensor]:
    """A full (single-device) state dict cut into this rank's shards: the state dict of a model
    holding these weights after apply_tensor_parallel (the same keys and shapes), for loading
    new weights into an already-sharded model. The full model wraps `state_dict`'s own tensors."""
    with torch.device("meta"):              # no initialization: every tensor comes from state_dict
        model = Model(config, seed=0, dtype=dtype)
    model.load_state_dict(state_dict, assign=True)
    return apply_tensor_parallel(model, group, mode).state_dict()


@torch.no_grad()
def apply_tensor_parallel(model: Model, group=None, mode: str = "exact", join: str = DEFAULT_JOIN) -> Model:
    """Shard `model` in place over the ranks of `group` (default: the world) and return it.

    Every rank must hold the same full weights before the call (same seed or checkpoint).
    mode "exact" (default) gives each rank the single-device bits; "all_reduce" is the
    conventional plain-sum layout, kept as a baseline. `join` picks how the exact layout's
    row-parallel layers join the ranks' subtrees (row_parallel_join; every choice gives the
    same bits, they differ in speed and in what the GPUs must support).
    """
    if join not in JOINS:
        raise ValueError(f"apply_tensor_parallel: join must be one of {JOINS}, got {join!r}")
    group = group if group is not None else dist.group.WORLD
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    _check(model, tp, mode)
    c = model.config
    h_local = c.num_attention_heads // tp
    for block in model.layers:
        attn: MLAttention = block.self_attn
        heads = slice(rank * h_local, (rank + 1) * h_local)
        q_rows = c.qk_head_dim
        attn.q_b_proj = _linear_rows(attn.q_b_proj, heads.start * q_rows, heads.stop * q_rows, ColumnShardLinear)
        attn.q_b_proj.tp_group = group
        if mode == "exact":     # the replicated latent and rope key feed this rank's heads only
            attn.kv_a_layernorm.__class__, attn.kv_a_layernorm.tp_group = _ReplicatedNorm, group
            attn.kv_a_proj_with_mqa.__class__, attn.kv_a_proj_with_mqa.tp_group = _RopeSplitLinear, group
            attn.kv_a_proj_with_mqa.kv_lora_rank = c.kv_lora_rank
        kv_rows = c.qk_nope_head_dim + c.v_head_dim
        attn.kv_b_proj = _linear_rows(attn.kv_b_proj, heads.start * kv_rows, heads.stop * kv_rows)
        o_cols = slice(heads.start * c.v_head_dim, heads.stop * c.v_head_dim)
        attn.o_proj = RowParallelLinear(attn.o_proj.weight.detach()[:, o_cols].clone(), group, mode)
        attn.n_heads = h_local
        if isinstance(block.mlp, MoE):
            block.mlp = ExpertParallelMoE(block.mlp, rank, tp, group, mode)
        elif isinstance(block.mlp, MLP):
            block.mlp = ParallelMLP(block.mlp, rank, tp, group, mode)
    vocab = model.lm_head.weight.shape[0]
    rows = -(-vocab // (tp * COLUMN_ALIGN)) * COLUMN_ALIGN          # ceil(V / tp), rounded up to the tile
    w = model.lm_head.weight.detach()[rank * rows:(rank + 1) * rows]
    w = torch.cat([w, w.new_zeros(rows - w.shape[0], w.shape[1])]) if w.shape[0] < rows else w.clone()
    model.lm_head = ColumnParallelLinear(w, vocab, group)
    for module in model.modules():
        if isinstance(module, RowParallelLinear):
            module.join = join
    model.tp_group, model.tp_size, model.tp_rank = group, tp, rank
    return model
