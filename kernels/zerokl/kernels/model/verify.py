"""Three-path parity: full forward == chunked prefill (with prefix-cache hits) == decode, bitwise.

Shared by the test suite and `zerokl verify`. A random tiny model reads random prompts
three ways while random neighbour sequences share every batch at random positions,
through a paged cache whose block tables are shuffled.
"""
from __future__ import annotations

import random
from typing import Callable

import torch

from zerokl.kernels import ops
from zerokl.kernels.backend import use_backend
from zerokl.kernels.model.fp8 import quantize_fp8
from zerokl.kernels.model.model import KVCache, Model, ModelConfig
from zerokl.kernels.model.paging import BlockPool, SequenceChunk, batch_for_chunks

__all__ = ["PARITY_CHECKS", "three_path_parity", "run_paths", "INTERPRETER_CONFIG", "sharded_outputs"]

# The Triton interpreter runs every program instance in Python: on CPU its parity check
# uses a 2-layer tiny model with index_topk = 8 (same code paths, dense and sparse).
INTERPRETER_CONFIG = ModelConfig.preset("tiny").replace(num_hidden_layers=2, index_topk=8, max_position_embeddings=64)


class _Seq:
    """A sequence being fed through the cache in steps of varying size."""

    def __init__(self, tokens: torch.Tensor, table: list[int], start: int = 0):
        self.tokens, self.table, self.done = tokens, table, start
        self.logits: list[torch.Tensor] = []

    @property
    def left(self) -> int:
        return len(self.tokens) - self.done


def run_paths(model: Model, prompt: torch.Tensor, rng: random.Random, block_size: int = 8,
              neighbours: int = 3, max_chunk: int = 40) -> dict[str, torch.Tensor]:
    """Logits of `prompt` [S] by full forward, chunked prefill, prefix-cache hit, and decode."""
    c, s, vocab = model.config, len(prompt), model.config.vocab_size
    dev = model.embed_tokens.weight.device
    prompt = prompt.to(dev)
    gen = torch.Generator().manual_seed(rng.randrange(2**63))   # neighbours' tokens: a function of rng only
    with torch.no_grad():
        out = {"full": model(prompt.view(1, -1))[0]}
        blocks_per_seq = -(-c.max_position_embeddings // block_size)
        pool = BlockPool(blocks_per_seq * (neighbours + 3))
        rng.shuffle(pool.free)                                # pages land anywhere in memory
        cache = KVCache.allocate(c, len(pool.free), block_size, model.dtype, dev)

        def new_seq(tokens, shared_prefix_blocks=(), start=0):
            need = -(-len(tokens) // block_size) - len(shared_prefix_blocks)
            return _Seq(tokens, list(shared_prefix_blocks) + pool.take(need), start)

        def run(target: _Seq, step: Callable[[], int]):
            """Feed `target` in steps while random neighbours (prefill or decode) share each batch."""
            others = [new_seq(torch.randint(0, vocab, (rng.randint(1, 3 * c.index_topk),), generator=gen).to(dev))
                      for _ in range(neighbours)]
            while target.left:
                work = [(target, min(step(), target.left))]
                work += [(o, min(rng.randint(1, max_chunk), o.left)) for o in others if o.left]
                rng.shuffle(work)
                chunks = [SequenceChunk(tuple(q.table), q.done, n) for q, n in work]
                logits = model.forward_tokens(torch.cat([q.tokens[q.done:q.done + n] for q, n in work]),
                                              batch_for_chunks(chunks, block_size, dev), cache)
                at = 0
                for q, n in work:
                    q.logits.append(logits[at:at + n])
                    q.done, at = q.done + n, at + n
            for o in others:
                pool.give(o.table)
            return torch.cat(target.logits)

        prefill = new_seq(prompt)
        out["chunked_prefill"] = run(prefill, lambda: rng.randint(1, max_chunk))
        decode = new_seq(prompt)
        out["decode"] = run(decode, lambda: 1)
        # Prefix-cache hit: reuse the prefill sequence's full blocks, compute only the rest.
        hit_blocks = rng.randint(1, max(1, (s - 1) // block_size)) if s > block_size else 0
        hit = new_seq(prompt, prefill.table[:hit_blocks], start=hit_blocks * block_size)
        out["prefix_hit"] = torch.cat([out["full"][: hit.done], run(hit, lambda: rng.randint(1, max_chunk))])
    return out


def three_path_parity(backend: str, seed: int, prompts: int = 2, config: ModelConfig | None = None,
                      dtype: torch.dtype = torch.float32, neighbours: int = 3) -> tuple[int, int]:
    """(cases, mismatching paths) over random prompts shorter and longer than index_topk.
    dtype float8_e4m3fn: the bf16 model with its projections quantized (zerokl.kernels.model.fp8)."""
    rng = random.Random(seed)
    if config is None:
        interpreted = backend == "triton" and not torch.cuda.is_available()
        config = INTERPRETER_CONFIG if interpreted else ModelConfig.preset("tiny")
        neighbours = 1 if interpreted else neighbours
    cases = mismatches = 0
    fp8 = dtype == torch.float8_e4m3fn
    with use_backend(backend), torch.no_grad():
        model = Model(config, seed=seed, dtype=torch.bfloat16 if fp8 else dtype)
        if fp8:
            quantize_fp8(model)
        model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
        for i in range(prompts):
            s = rng.randint(2, config.index_topk) if i % 2 == 0 else rng.randint(config.index_topk + 1, 3 * config.index_topk)
            prompt = torch.randint(0, config.vocab_size, (s,), generator=torch.Generator().manual_seed(seed * 1000 + i))
            paths = run_paths(model, prompt, rng, neighbours=neighbours)
            for name, logits in paths.items():
                if name != "full":
                    cases += 1
                    mismatches += int(not torch.equal(logits, paths["full"]))
    return cases, mismatches


def sharded_outputs(model: Model, seed: int, prompts: int = 2, batch: tuple[int, int] = (3, 50),
                    neighbours: int = 2) -> dict[str, torch.Tensor]:
    """Logits and logprobs of a fixed workload, for comparing TP degrees bit for bit.

    The workload is a function of `seed` only (every rank of a TP group must run the same
    batches): a trainer-style full forward of a [B, S] batch, then `prompts` prompts (below
    and above index_topk) through run_paths: full forward, chunked prefill, prefix-cache hit
    and decode, each among random neighbour sequences. Works on a plain model (TP = 1) and
    on one sharded by zerokl.kernels.model.parallel.apply_tensor_parallel (identical on every rank).
    """
    c = model.config
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dev = model.embed_tokens.weight.device
    out = {}
    with torch.no_grad():
        ids = torch.randint(0, c.vocab_size, batch, generator=gen).to(dev)
        out["batch/full"] = model(ids)
        for i in range(prompts):
            s = rng.randint(2, c.index_topk) if i % 2 == 0 else rng.randint(c.index_topk + 1, 3 * c.index_topk)
            prompt = torch.randint(0, c.vocab_size, (s,), generator=gen)
            for name, logits in run_paths(model, prompt, rng, neighbours=neighbours).items():
                out[f"prompt{i}/{name}"] = logits
        out.update({f"{k}/logprobs": ops.log_softmax(v) for k, v in list(out.items())})
    return out


PARITY_CHECKS: dict[str, Callable[[str, int], tuple[int, int]]] = {"three_path_parity": three_path_parity}
