"""The trainer beyond one device: data (FSDP2), tensor and expert parallelism on torch.distributed.

    layout = Layout(dp=2, tp=1, ep=2)                    # world = dp * tp ranks
    group = ParallelGroup.init(layout, rank, port)       # gloo on CPU, NCCL one GPU per rank
    dt = DistributedTrainer(Trainer(model, config), group)   # every rank: the same full trainer
    dt.forward_logprobs(seqs); dt.forward_backward("sft", seqs); dt.optim_step()   # every rank, same calls

Ranks: world rank = d * tp + t (data rank d in [0, dp), TP rank t in [0, tp)). Data rank d
holds its contiguous share of every batch. Expert parallelism borrows from the data ranks
(as TorchTitan's does): ep divides dp, data ranks q*ep .. q*ep+ep-1 (same t) form an EP
group whose members dispatch tokens to each other's experts by all-to-all
(zerokl.kernels.model.parallel.DispatchMoE).

* TP (zerokl.kernels.model.parallel, exact layout): forward bits equal one device's; backward by the
  transposes of the split-tree joins and of the vocabulary gather, with the replicated
  activations' gradients all-reduced where they enter a sharded consumer.
* FSDP2 over the dp ranks of each TP rank (`fully_shard` per block and the root): parameters,
  gradients and AdamW state sharded; the forward all-gathers the weights (bytes only), so its
  bits are unchanged. Experts of a DispatchMoE are ignored by FSDP (already split by EP; the
  dp / ep replicas of one EP shard all-reduce their gradients).
* Gradients: each data rank scales its loss by dp times its share of the batch's units
  (tokens for SFT and PPO, pairs for DPO) and FSDP averages over the dp ranks (experts under
  EP: their replicas' sum over dp here), so the update is the one-process one up to the order
  of the sums (not bitwise: docs/scale.md gives the tolerance).

Every rank must make the same calls with the same arguments (lockstep). A served group does
that with LockstepTrainer on rank 0 (owner of gRPC) and `follow` on the others, as the TP
serving replicas do (services/zerokl/services/inference/tensor_parallel.py).
"""
from __future__ import annotations

import dataclasses
import datetime
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from zerokl.kernels.model import Model
from zerokl.kernels.model.model import MoE
from zerokl.kernels.model.parallel import DispatchMoE, apply_tensor_parallel
from zerokl.services.runtime import lockstep
from zerokl.services.trainer.optim import optimizer_step
from zerokl.services.trainer.trainer import Trainer

__all__ = ["ENV_RANK", "ENV_PORT", "Layout", "ParallelGroup", "DistributedTrainer", "LockstepTrainer", "ServedTrainer",
           "follow", "apply_training_parallel", "start_group", "run_follower", "serve_distributed"]

ENV_RANK = "ZEROKL_TRAINER_RANK"     # set on followers: their world rank (1 .. world - 1)
ENV_PORT = "ZEROKL_TRAINER_PORT"     # rank 0's rendezvous port on 127.0.0.1


@dataclass(frozen=True)
class Layout:
    """dp data-parallel (FSDP2) x tp tensor-parallel ranks; ep expert-parallel ranks out of the dp."""

    dp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp

    def check(self, config=None) -> None:
        problems = []
        if min(self.dp, self.tp, self.ep) < 1:
            problems.append("dp, tp and ep must be >= 1")
        elif self.dp % self.ep:
            problems.append(f"ep = {self.ep} must divide dp = {self.dp} (expert parallelism runs over the data ranks)")
        if config is not None and config.n_routed_experts % (self.ep * self.tp):
            problems.append(f"n_routed_experts = {config.n_routed_experts} is not divisible by ep * tp")
        if problems:
            raise ValueError("invalid layout: " + "; ".join(problems))

    def coords(self, rank: int) -> tuple[int, int]:
        """(data rank, TP rank) of a world rank."""
        return rank // self.tp, rank % self.tp

    def __str__(self) -> str:
        return f"dp={self.dp} tp={self.tp} ep={self.ep}"


class ParallelGroup:
    """This process's place in the layout: the meshes and process groups (built collectively)."""

    def __init__(self, layout: Layout, device: torch.device):
        from torch.distributed.device_mesh import init_device_mesh
        layout.check()
        if dist.get_world_size() != layout.world:
            raise ValueError(f"world size {dist.get_world_size()} != dp * tp = {layout.world}")
        self.layout, self.device = layout, device
        self.rank = dist.get_rank()
        self.data_rank, self.tp_rank = layout.coords(self.rank)
        kind = device.type
        self.mesh = init_device_mesh(kind, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
        self.dp_mesh = self.mesh["dp"]
        self.tp_group = self.mesh["tp"].get_group() if layout.tp > 1 else None
        ep_mesh = init_device_mesh(kind, (layout.dp // layout.ep, layout.ep, layout.tp),
                                   mesh_dim_names=("replica", "ep", "tp"))
        self.ep_group = ep_mesh["ep"].get_group() if layout.ep > 1 else None
        # The dp / ep ranks holding the same experts (they all-reduce the experts' gradients).
        self.replica_group = ep_mesh["replica"].get_group() if layout.dp // layout.ep > 1 else None
        # Calls (objects) travel over gloo whatever the compute backend; a served trainer may sit
        # idle for hours between calls, so its followers wait without a timeout that matters.
        self.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
        self.followers: list[subprocess.Popen] = []
        self.lockstep: LockstepTrainer | None = None
        self.closing = False

    def close(self, timeout: float = 30.0) -> None:
        """Rank 0: tell the followers to stop, wait for them, end the group."""
        self.closing = True
        if self.lockstep is not None:
            self.lockstep.stop()
        lockstep.reap(self.followers, timeout)
        dist.destroy_process_group()

    @staticmethod
    def init(layout: Layout, rank: int, port: int, device: str | torch.device | None = None) -> "ParallelGroup":
        """Join the world (tcp://127.0.0.1:port) as `rank` and build the groups: gloo on CPU,
        NCCL with cuda:rank on GPUs."""
        dev = lockstep.rank_device(device, rank)
        lockstep.join_world(rank, layout.world, port, dev)
        return ParallelGroup(layout, dev)


@torch.no_grad()
def apply_training_parallel(model: Model, tp_group=None, ep_group=None) -> Model:
    """Expert parallelism (DispatchMoE over ep_group) then tensor parallelism (tp_group), in
    place; every parameter trainable. Forward bits are the one-device model's."""
    if ep_group is not None and dist.get_world_size(ep_group) > 1:
        for block in model.layers:
            if isinstance(block.mlp, MoE):
                block.mlp = DispatchMoE(block.mlp, ep_group, tp_group)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        apply_tensor_parallel(model, tp_group)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def _forget_weight_slices() -> None:
    """Drop the torch backend's cached weight slices (kernels/zerokl/kernels/portable.py). They are keyed by
    the weight tensor and its version counter; FSDP2 refills its unsharded parameters in place
    under a preserved version counter, so after the sharded weights change (an optimizer step,
    a load) a cached slice would be stale."""
    from zerokl.kernels import portable
    with portable._SLICE_CACHE_LOCK:
        portable._SLICE_CACHE.clear()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class DistributedTrainer:
    """A Trainer sharded over a ParallelGroup: the Trainer's low-level API, called in lockstep.

    Built from a full single-process Trainer (the same weights, optimizer state and counters on
    every rank, e.g. from a seed or a published checkpoint): its model is sharded in place.
    """

    def __init__(self, trainer: Trainer, group: ParallelGroup):
        c = _without_masters(trainer)
        if c.lora_rank > 0 or c.kl_coef > 0 or trainer.reference is not None:
            raise ValueError("the distributed trainer trains full weights without a reference model "
                             "(lora_rank = 0, kl_coef = 0)")
        self.group, self.layout, self.config = group, group.layout, c
        full = trainer.model
        self.model_config, self.dtype = full.config, full.dtype
        self.full_shapes = {k: tuple(v.shape) for k, v in full.state_dict().items()}
        full_opt = _named_optimizer_state(trainer)
        model = apply_training_parallel(full, group.tp_group, group.ep_group)
        self.experts = {n for n, p in model.named_parameters()
                        if isinstance(_owner(model, n), DispatchMoE) and n.rsplit(".", 1)[1] in ("gate_proj", "up_proj", "down_proj")}
        self.tp_local = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if self.layout.dp > 1:
            self._fully_shard(model)
        self.model = model
        # No CUDA graphs here: a rank's step holds collectives (TP all-reduces, FSDP's gathers) that
        # every rank would have to capture and replay in lockstep.
        self.trainer = Trainer(model, dataclasses.replace(c, cuda_graphs=False))
        self.trainer.step, self.trainer.tokens_seen = trainer.step, trainer.tokens_seen
        self._params = dict(model.named_parameters())
        self._load_optimizer_state({n: {k: v for k, v in s.items()} for n, s in full_opt.items()})

    # ------------------------------------------------------------------ setup

    def _fully_shard(self, model: Model) -> None:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
        ignored = {p for n, p in model.named_parameters() if n in self.experts}
        for block in model.layers:
            fully_shard(block, mesh=self.group.dp_mesh, ignored_params=ignored & set(block.parameters()) or None)
        # The trainer runs Model.hidden_states, then the final norm and lm_head chunk by chunk
        # (kernels/zerokl/kernels/logprob.py), outside Model.forward: each is its own FSDP unit, and
        # hidden_states is registered so the root unit (the embedding) all-gathers around it.
        fully_shard(model.norm, mesh=self.group.dp_mesh)
        fully_shard(model.lm_head, mesh=self.group.dp_mesh)
        # FSDP averages gradients over the dp ranks (a pre-divide by dp, then a sum: gloo has no
        # pre-multiplied sum); each rank's loss is pre-scaled by dp * its share of the batch.
        fully_shard(model, mesh=self.group.dp_mesh, ignored_params=ignored or None)
        register_fsdp_forward_method(model, "hidden_states")

    @property
    def step(self) -> int:
        return self.trainer.step

    @property
    def tokens_seen(self) -> int:
        return self.trainer.tokens_seen

    @property
    def device(self) -> torch.device:
        return self.group.device

    # ------------------------------------------------------------------ layout of tensors

    def _shard(self, name: str, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full (one-device) tensor named `name`, laid out like `like`."""
        t = full.to(self.device)
        local_shape = self.tp_local[name]
        for dim, (a, b) in enumerate(zip(self.full_shapes[name], local_shape)):
            if a != b:
                index = self._shard_index(name)
                t = t.narrow(dim, index * b, min(b, a - index * b)) if index * b < a else t.narrow(dim, 0, 0)
                if t.shape[dim] < b:      # lm_head's vocabulary padding
                    pad = list(t.shape)
                    pad[dim] = b - t.shape[dim]
                    t = torch.cat([t, t.new_zeros(pad)], dim)
                break
        t = t.to(like.dtype).contiguous()
        if hasattr(like, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor
            t = distribute_tensor(t, like.device_mesh, like.placements, src_data_rank=None)
        return t

    def _shard_index(self, name: str) -> int:
        if name in self.experts:            # experts e*tp + t of ep*tp
            e = self.group.data_rank % self.layout.ep
            return e * self.layout.tp + self.group.tp_rank
        return self.group.tp_rank

    def _gather(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The full (one-device) tensor of a parameter-shaped local tensor (collective: every rank)."""
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        t = t.detach()
        full_shape = self.full_shapes[name]
        if tuple(t.shape) == full_shape:
            return t.cpu().clone()
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        dim = next(d for d, (a, b) in enumerate(zip(full_shape, t.shape)) if a != b)
        count = -(-full_shape[dim] // t.shape[dim])
        return torch.cat(parts[:count], dim).narrow(dim, 0, full_shape[dim]).cpu()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The one-device model's state dict (CPU tensors; collective)."""
        state = self.model.state_dict()
        return {k: self._gather(k, v) for k, v in state.items()}

    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW state per parameter name, one-device shapes (collective)."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in self._params.items():
            s = self.trainer.optimizer.state.get(p)
            if s:
                out[name] = {k: (self._gather(name, v) if k != "step" else _local(v).detach().cpu().clone())
                             for k, v in s.items()}
        return out

    def _load_optimizer_state(self, full: dict[str, dict[str, torch.Tensor]]) -> None:
        self.trainer.optimizer.state.clear()
        for name, s in full.items():
            p = self._params[name]
            self.trainer.optimizer.state[p] = {k: (self._shard(name, v, p) if k != "step" else v.clone())
                                               for k, v in s.items()}

    @torch.no_grad()
    def load_full(self, model_state: dict[str, torch.Tensor], optimizer_state: dict | None = None,
                  step: int | None = None, tokens_seen: int | None = None) -> None:
        """Load one-device weights (and AdamW state, counters) into this layout; gradients dropped."""
        for name, t in self.model.state_dict().items():
            _local(t).copy_(_local(self._shard(name, model_state[name], t)))
        if optimizer_state is not None:
            self._load_optimizer_state(optimizer_state)
        if step is not None:
            self.trainer.step = step
        if tokens_seen is not None:
            self.trainer.tokens_seen = tokens_seen
        self.trainer.optimizer.zero_grad(set_to_none=True)
        _forget_weight_slices()

    def full_trainer(self) -> Trainer:
        """A one-process Trainer holding this trainer's weights, AdamW state and counters (collective):
        what the existing publish path (checkpointing.write_checkpoint) writes."""
        sd, opt = self.full_state_dict(), self.full_optimizer_state()
        model = Model.empty(self.model_config, self.dtype)
        model.load_state_dict(sd)
        t = Trainer(model, self.config)
        by_name = dict(model.named_parameters())
        for name, s in opt.items():
            t.optimizer.state[by_name[name]] = {k: v.clone() for k, v in s.items()}
        t.step, t.tokens_seen = self.trainer.step, self.trainer.tokens_seen
        return t

    # ------------------------------------------------------------------ work

    def _share(self, n: int) -> slice:
        dp, d = self.layout.dp, self.group.data_rank
        if n < dp:
            raise ValueError(f"a batch of {n} item(s) cannot be split over dp = {dp} data ranks")
        return slice(d * n // dp, (d + 1) * n // dp)

    def _from_data_ranks(self, obj: Any) -> list:
        """Every data rank's `obj` (TP rank 0's), in data-rank order."""
        objs: list = [None] * dist.get_world_size()
        dist.all_gather_object(objs, obj, group=self.group.control)
        return objs[::self.layout.tp]

    def forward_logprobs(self, seqs: Sequence) -> list[torch.Tensor]:
        """The same list as Trainer.forward_logprobs (every rank gets it)."""
        mine = self.trainer.forward_logprobs(list(seqs)[self._share(len(seqs))])
        return [t for part in self._from_data_ranks(mine) for t in part]

    def forward_backward(self, method: str, items: Sequence, **kw) -> dict:
        """Trainer.forward_backward on this data rank's share; metrics of the whole batch."""
        start = time.perf_counter()
        items = list(items)
        share = self._share(len(items))
        if method == "dpo":
            units = [1.0] * len(items)
        else:
            seqs = [getattr(i, "sequence", i) for i in items]
            units = [float(len(s.completion_ids)) for s in seqs]
        total = sum(units)
        fsdp = self.layout.dp if self.layout.dp > 1 else 1
        # The loss (a mean over this rank's units) weighted by dp * its share of the batch's units:
        # FSDP's average over the dp ranks is then the one-process batch mean's gradient.
        scale = fsdp * sum(units[share]) / total if total else 0.0
        if "advantages" in kw:
            kw = dict(kw, advantages=kw["advantages"][share])
        m = self.trainer.forward_backward(method, items[share], loss_scale=scale, **kw)
        for name in sorted(self.experts):           # EP experts: outside FSDP, so its average is done here
            g = self._params[name].grad
            if g is not None:
                if self.group.replica_group is not None:      # the dp / ep replicas of these experts
                    dist.all_reduce(g, group=self.group.replica_group)
                g.div_(fsdp)
        metrics = _merge_metrics(self._from_data_ranks((sum(units[share]), m)))
        metrics["tokens_per_s"] = metrics["tokens"] / max(time.perf_counter() - start, 1e-9)
        self.trainer.tokens_seen += metrics["tokens"] - m["tokens"]
        return metrics

    def _grad_norm(self) -> float:
        """The global gradient norm: each local gradient counted once over the world."""
        total = torch.zeros((), dtype=torch.float64)
        for name, p in self._params.items():
            if p.grad is None:
                continue
            g = _local(p.grad).detach().double()
            copies = 1
            if self.tp_local[name] == self.full_shapes[name]:
                copies *= self.layout.tp                          # replicated over TP ranks
            if not hasattr(p, "device_mesh"):
                copies *= (self.layout.dp // self.layout.ep) if name in self.experts else self.layout.dp
            total += (g * g).sum().cpu() / copies
        dist.all_reduce(total, group=self.group.control)
        return float(total.sqrt())

    def optim_step(self, lr: float | None = None, adam=None) -> dict:
        """Trainer.optim_step's contract (clip to the global norm, AdamW, undo a non-finite step)."""
        t = self.trainer

        def non_finite() -> str | None:      # every rank's verdict, so all of them undo the step or none
            bad = torch.tensor([float(any(not bool(torch.isfinite(_local(p)).all()) for p in self._params.values()))])
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group.control)
            return "a weight non-finite" if bad.item() else None

        grads = [p.grad for p in self._params.values() if p.grad is not None]
        return optimizer_step(t, grads, self._grad_norm(), lr, non_finite=non_finite, release=_forget_weight_slices,
                              adam=adam)

    def sft_step(self, examples: Sequence) -> dict:
        return self.forward_backward("sft", examples) | self.optim_step()

    def grpo_step(self, rollouts: Sequence, group_size: int) -> dict:
        from zerokl.services.trainer.losses import group_advantages
        adv = group_advantages(torch.tensor([r.reward for r in rollouts]), group_size)
        m = self.forward_backward("ppo", rollouts, advantages=adv)
        m["reward"] = float(sum(r.reward for r in rollouts) / len(rollouts))
        return m | self.optim_step()


def _owner(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model


_SUMMED = ("tokens", "mismatched_tokens")


def _merge_metrics(parts: list[tuple[float, dict]]) -> dict:
    """One batch's metrics from the data ranks' (units, metrics): counts summed, extremes
    taken, the rest weighted by each rank's share of the batch."""
    total = sum(u for u, _ in parts) or 1.0
    out: dict = {}
    for key in parts[0][1]:
        values = [m[key] for _, m in parts]
        if key in _SUMMED:
            out[key] = type(values[0])(sum(values))
        elif key == "ratio_min":
            out[key] = min(values)
        elif key == "ratio_max":
            out[key] = max(values)
        else:
            out[key] = sum(u * float(m[key]) for u, m in parts) / total
    return out


class LockstepTrainer:
    """Rank 0's DistributedTrainer: each call is sent to the followers (in call order) before it
    runs here, so every rank makes the same collective calls."""

    CALLS = ("forward_logprobs", "forward_backward", "optim_step", "full_trainer", "load_full",
             "save_sharded", "load_sharded")

    def __init__(self, trainer: DistributedTrainer):
        self.trainer = trainer

    def __getattr__(self, name: str) -> Any:
        if name in self.CALLS:
            def call(*args, **kwargs):
                lockstep.send(self.trainer.group.control, name, *args, **kwargs)
                return _dispatch(self.trainer, name, args, kwargs)
            return call
        return getattr(self.trainer, name)

    def stop(self) -> None:
        lockstep.send(self.trainer.group.control, lockstep.STOP)


def _dispatch(trainer: DistributedTrainer, name: str, args, kwargs):
    if name in ("save_sharded", "load_sharded"):
        from zerokl.services.trainer import checkpointing
        return getattr(checkpointing, name)(trainer, *args, **kwargs)
    return getattr(trainer, name)(*args, **kwargs)


def follow(trainer: DistributedTrainer) -> None:
    """A follower's life: run rank 0's calls in order until it says stop. A call that fails
    here fails the same way on rank 0 (same state, same arguments), which reports it."""
    lockstep.follow(trainer.group.control, lambda name, args, kwargs: _dispatch(trainer, name, args, kwargs),
                    "trainer", trainer.group.rank)


# ----------------------------------------------------------------------------- the served group

def start_group(layout: Layout, argv: Sequence[str], device: str | None) -> ParallelGroup:
    """Rank 0 (no ENV_RANK): spawn the world - 1 followers (`python -m zerokl.services.trainer
    <argv>` with their rank in the environment; rank r uses cuda:r) and join them; a follower:
    join. A follower ends when rank 0 is gone; rank 0 exits (status 1) when a follower dies, so
    the supervisor restarts the whole group, which resumes from the run's last checkpoint."""
    rank, port, followers = lockstep.rendezvous(layout.world, ENV_RANK, ENV_PORT, ["-m", "zerokl.services.trainer", *argv],
                                                stdout=subprocess.DEVNULL)
    group = ParallelGroup.init(layout, rank, port, device)
    group.followers = followers
    if followers:
        lockstep.watch_followers(followers, lambda: group.closing, "trainer group")
    return group


def _trainer_from(doc: dict, device: torch.device) -> Trainer:
    model = Model.empty(doc["model_config"], doc["dtype"]).to(device)
    model.load_state_dict(doc["model"])
    t = Trainer(model, doc["config"])
    by_name = dict(model.named_parameters())
    for name, st in doc["optimizer"].items():
        t.optimizer.state[by_name[name]] = {k: v.to(device) if k != "step" else v for k, v in st.items()}
    t.step, t.tokens_seen = doc["step"], doc["tokens_seen"]
    return t


def _without_masters(t: Trainer):
    """t's TrainConfig for the distributed trainer, which keeps no fp32 master weights (and refuses what it
    cannot do: an offloaded optimizer, micro-batches).

    FSDP2-sharded masters (and their gather/shard for checkpoints) are not built: the distributed
    trainer steps its parameters in their own dtype, as before master weights existed. Asked for
    explicitly they are refused; on by default (a bf16 model) they are turned off."""
    if t.config.offload_optimizer:
        raise ValueError("the distributed trainer keeps its optimizer state on the devices: use "
                         "TrainConfig(offload_optimizer=False) or train in one process")
    if t.config.micro_batch_tokens:
        # Each rank would split its own share by its own lengths: ranks running different numbers of forwards
        # would wait on each other's FSDP collectives forever.
        raise ValueError("the distributed trainer takes each rank's share in one forward + backward: use "
                         "TrainConfig(micro_batch_tokens=0) or train in one process")
    if t.config.master_weights:
        raise ValueError("the distributed trainer does not keep fp32 master weights: use "
                         "TrainConfig(master_weights=False) (steps in the model's dtype) or train in one process")
    return dataclasses.replace(t.config, master_weights=False) if t.masters is not None else t.config


def _named_optimizer_state(t: Trainer) -> dict[str, dict]:
    """t's AdamW state per parameter name (state of fp32 masters under their parameter's name;
    _shard casts it to the parameter's dtype)."""
    names = {id(p): n for n, p in t.model.named_parameters()}
    names.update({id(m): names[id(p)] for p, m in zip(t.params, t.masters or [], strict=False)})
    return {names[id(p)]: s for p, s in t.optimizer.state.items()}


def _trainer_doc(t: Trainer) -> dict:
    return {"model_config": t.model.config, "dtype": t.model.dtype, "config": _without_masters(t),
            "model": {k: v.detach().cpu() for k, v in t.model.state_dict().items()},
            "optimizer": {n: {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
                          for n, st in _named_optimizer_state(t).items()},
            "step": t.step, "tokens_seen": t.tokens_seen}


def run_follower(group: ParallelGroup) -> None:
    """A follower rank: receive the starting trainer from rank 0, shard it, follow its calls."""
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=group.control)
    follow(DistributedTrainer(_trainer_from(box[0], group.device), group))
    dist.destroy_process_group()


class ServedTrainer:
    """What TrainerService holds on a distributed rank 0: the Trainer interface it uses, run in
    lockstep over the group. Publishing (write_checkpoint) sees the gathered one-process
    trainer, so the weight store gets the usual HF-named checkpoint and trainer state."""

    def __init__(self, lockstep: LockstepTrainer):
        self.lockstep, self.dt = lockstep, lockstep.trainer
        self.model, self.config, self.reference = self.dt.model, self.dt.config, None
        self.masters = None                 # the distributed trainer keeps none (_without_masters)
        self.fp8 = self.dt.trainer.fp8      # what a checkpoint's config.json says the serving weights are
        self._full: Trainer | None = None

    step = property(lambda self: self.dt.step)
    tokens_seen = property(lambda self: self.dt.tokens_seen)
    device = property(lambda self: self.dt.device)

    def forward_logprobs(self, seqs):
        return self.lockstep.forward_logprobs(list(seqs))

    def forward_backward(self, method: str, items, **kw):
        if method == "dpo":
            from zerokl.services.runtime.errors import FailedPrecondition
            raise FailedPrecondition("DPO needs a reference model: not supported by a --dp/--tp/--ep trainer")
        self._full = None
        return self.lockstep.forward_backward(method, list(items), **kw)

    def freeze_reference(self):
        from zerokl.services.runtime.errors import FailedPrecondition
        raise FailedPrecondition("DPO needs a reference model: not supported by a --dp/--tp/--ep trainer")

    def optim_step(self, lr: float | None = None, adam=None) -> dict:
        self._full = None
        return self.lockstep.optim_step(lr, adam)

    def full(self) -> Trainer:
        if self._full is None:
            self._full = self.lockstep.full_trainer()
        return self._full

    def serving_model(self) -> Model:
        return self.full().serving_model()

    def serving_state_dict(self, copy: bool = True) -> dict:
        return self.full().serving_state_dict(copy=copy)

    @property
    def optimizer(self):
        return self.full().optimizer

    def adopt(self, trainer: Trainer) -> None:
        """Load a one-process trainer's weights, AdamW state and counters into every rank."""
        doc = _trainer_doc(trainer)
        self._full = None
        self.lockstep.load_full(doc["model"], doc["optimizer"], step=doc["step"], tokens_seen=doc["tokens_seen"])


def serve_distributed(service, group: ParallelGroup):
    """Rank 0: shard `service`'s trainer over the group (the followers get its state), and make
    the service drive the group: its trainer becomes a ServedTrainer, and a trainer it loads
    later (LoadWeights) is adopted into the group."""
    from zerokl.services.trainer.service import TrainerService
    full = service.trainer
    dist.broadcast_object_list([_trainer_doc(full)], src=0, group=group.control)
    group.lockstep = LockstepTrainer(DistributedTrainer(full, group))
    served = ServedTrainer(group.lockstep)

    class DistributedTrainerService(TrainerService):
        @property
        def _trainer(self):
            return self._served

        @_trainer.setter
        def _trainer(self, trainer):
            if isinstance(trainer, Trainer):
                self._served.adopt(trainer)
            else:
                self._served = trainer

    service._served = served
    service.__class__ = DistributedTrainerService
    return service
