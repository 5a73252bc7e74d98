"""The model's initial weights, drawn so that a rank builds only its own slices of them.

A rank of a parallel layout must start from exactly the slice of the one model a single process would initialise,
whatever the layout. Building the whole model on every rank and slicing it (the obvious way) costs every rank the
whole model's memory: 120 GB of fp32 per rank for Qwen3-30B-A3B. Instead:

- `parameters_on_meta()`: the model is constructed with its parameters on the meta device (no memory, and the layers'
  default initialisation does nothing); buffers (RoPE frequencies, router state) are real;
- services/trainer/parallel/ slices the meta model to the rank's layout (shapes only);
- `materialize` gives each remaining parameter uninitialised memory on the device, keeping what parallelism attached;
- `initial_values` draws the whole model's parameters one at a time, in the model's order, and the rank keeps its box
  of each (`Drawn` reads like a checkpoint, so parallel/checkpoint_shards.py `read_local` cuts it) and drops the rest.

Values: matrices are normal(0, std) (std / sqrt(2 L) for the residual branches' output projections, GPT-2 style),
vectors (norm scales) are ones; one CPU generator draws every matrix in turn, so the numbers do not depend on the
device or the layout. A rank holds one whole parameter at a time besides its slices, but still draws the whole
model's random numbers (on one core: minutes for tens of billions of parameters).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from services.checkpointer.load import resolve_box
from services.common.config import ModelConfig

RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "experts.w2")  # scaled down by sqrt(2 L)


def initial_values(cfg: ModelConfig, seed: int,
                   shapes: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, fp32 CPU value) of every parameter of the whole model, whose parameters are `shapes` in the model's
    order (`named_parameters`); one generator seeded by `seed` draws them in that order."""
    gen = torch.Generator().manual_seed(seed)
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
    for name, shape in shapes.items():
        if len(shape) < 2:
            yield name, torch.ones(shape)
        else:
            yield name, torch.randn(shape, generator=gen) * (out_std if name.endswith(RESIDUAL_OUTPUTS) else std)


class Drawn:
    """One drawn parameter read like a checkpoint (`global_shape`, `read(name, offsets, shape)`); its shape may be
    asked for in another view with the same C order (w13 as [E, h, 2, f] or [E, h, 2f])."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def global_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.value.shape)

    def read(self, name: str, offsets: tuple[int, ...] | None = None,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        lo, size = resolve_box(name, self.value.shape, offsets, shape)
        return self.value[tuple(slice(o, o + n) for o, n in zip(lo, size))]


def initial_state(model: nn.Module, seed: int) -> None:
    """Every parameter of a whole (unsliced) `model` from `initial_values`."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in initial_values(model.cfg, seed, {name: tuple(p.shape) for name, p in params.items()}):
            params[name].copy_(value)


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
