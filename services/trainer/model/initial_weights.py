"""The model's initial weights as a function of (seed, parameter name, box), so that a rank draws only its own slices.

A rank of a parallel layout must start from exactly the slice of the one model a single process would initialise,
whatever the layout. Building the whole model on every rank and slicing it (the obvious way) costs every rank the
whole model's memory and random numbers: 120 GB of fp32 and minutes of `randn` per rank for Qwen3-30B-A3B. Instead:

- `parameters_on_meta()`: the model is constructed with its parameters on the meta device (no memory, and the layers'
  default initialisation does nothing); buffers (RoPE frequencies, router state) are real;
- services/trainer/parallel/ slices the meta model to the rank's layout (shapes only);
- `materialize` gives each remaining parameter uninitialised memory on the device, keeping what parallelism attached;
- `SeededInit` is the initial model read like a checkpoint (`global_shape`, `read(name, offsets, shape)`), so the
  rank reads its own box of each parameter the way it reads a checkpoint (parallel/checkpoint_shards.py `read_local`).

Values: matrices are normal(0, std) (std / sqrt(2 L) for the residual branches' output projections, GPT-2 style),
vectors are ones (norm scales) or zeros (biases). The random numbers are drawn in blocks of whole rows of the
parameter's first dimension, each from its own CPU generator seeded by (seed, name, block), not from one generator over
the model in order (which makes every rank draw every number before its own, on one core): so they are the same on any
device and for any box, a box costs only the blocks its rows touch (an expert-parallel rank draws its own experts only;
a box cut along a later dimension, as TP's and ETP's are, draws its rows whole), and the blocks are drawn on all cores.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
from torch import nn

from services.checkpointer.load import resolve_box
from services.common.config import ModelConfig

# Random numbers per block (at least one row of the parameter's first dimension). Part of the values: another size
# draws other numbers, so every layout must use the same one.
BLOCK_ELEMS = 1 << 22
RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "experts.w2")  # scaled down by sqrt(2 L)


def block_seed(seed: int, name: str, block: int) -> int:
    """A 64-bit seed per (seed, parameter, block), the same in every process (Python's `hash` of a str is salted)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest(), "little")


class SeededInit:
    """The initial weights of a model of `cfg` whose parameters have the global `shapes` (name -> shape, as the
    single-process model names them), readable box by box like a checkpoint."""

    def __init__(self, cfg: ModelConfig, seed: int, shapes: dict[str, tuple[int, ...]]):
        self.seed, self.shapes = seed, shapes
        self.std = cfg.init_std
        self.out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)

    def global_shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read(self, name: str, offsets: tuple[int, ...] | None = None,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The box of parameter `name` at `offsets` of `shape` (defaults: the whole parameter), fp32 on the CPU. A
        parameter's shape may be given in another view with the same first dimension and the same C order after it
        (w13 as [E, h, 2, f] or [E, h, 2f]): the values are the same."""
        g = self.shapes[name]
        lo, size = resolve_box(name, g, offsets, shape)
        if name.endswith(".bias"):
            return torch.zeros(size)
        if len(g) < 2:
            return torch.ones(size)
        std = self.out_std if name.endswith(RESIDUAL_OUTPUTS) else self.std
        row = math.prod(g[1:])
        per = max(1, BLOCK_ELEMS // row)  # rows per block
        r0, r1 = lo[0], lo[0] + size[0]
        values = torch.empty(r1 - r0, row)  # the box's rows, whole; only they and a block per thread are held

        def fill(b: int) -> None:  # block b's rows inside [r0, r1), scaled, into `values`
            first, n = b * per, min(per, g[0] - b * per)
            block = torch.randn(n, row, generator=torch.Generator().manual_seed(block_seed(self.seed, name, b)))
            a, z = max(r0, first), min(r1, first + n)
            torch.mul(block[a - first:z - first], std, out=values[a - r0:z - r0])

        blocks = range(r0 // per, -(-r1 // per))
        if len(blocks) > 1:  # one generator per block, so the blocks can be drawn on all cores at once
            with ThreadPoolExecutor(min(len(blocks), os.cpu_count() or 1)) as pool:
                list(pool.map(fill, blocks))
        else:
            for b in blocks:
                fill(b)
        return values.view(-1, *g[1:])[(slice(None), *(slice(o, o + s) for o, s in zip(lo[1:], size[1:])))].contiguous()


def initial_state(model: nn.Module, seed: int) -> None:
    """Every parameter of a whole (unsliced) `model` from `SeededInit`."""
    params = dict(model.named_parameters())
    init = SeededInit(model.cfg, seed, {name: tuple(p.shape) for name, p in params.items()})
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(init.read(name))


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules constructed inside register their parameters on the meta device (their default initialisation then
    costs nothing); buffers stay where they are made."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def materialize(model: nn.Module, device: torch.device) -> None:
    """Each meta parameter of `model` becomes an uninitialised one on `device`, with the attributes and gradient hooks
    parallelism set on it (e.g. `tensor_parallel_dim`, `expert_box`, sequence parallel's sum over TP); a parameter
    several modules share stays one."""
    made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(meta parameter) -> (it, its replacement)
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is None or p.device.type != "meta":
                continue
            if id(p) not in made:
                new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                for hook in (p._backward_hooks or {}).values():  # e.g. sequence parallel's gradient sum over TP
                    new.register_hook(hook)
                made[id(p)] = (p, new)
            module._parameters[key] = made[id(p)][1]
