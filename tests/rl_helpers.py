"""Small models and references shared by the RL tests."""

from __future__ import annotations

import torch

from services.common.config import ModelConfig
from services.trainer.model.transformer import MoETransformer


def tiny_model_config(**overrides) -> ModelConfig:
    # A dense first layer and a shared expert so the cached forward is checked on every kind of block.
    base = dict(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=96, first_k_dense=1,
                num_experts=4, top_k=2, moe_ffn_hidden_size=48, shared_expert_ffn_hidden_size=32)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32, **overrides) -> MoETransformer:
    model = MoETransformer(tiny_model_config(**overrides))
    model.init_weights(seed)
    # Larger-than-training init so that a random model has peaked, seed-dependent next-token distributions.
    with torch.no_grad():
        model.output.weight.mul_(20)
    return model.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def full_forward(model: MoETransformer, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Uncached forward of one sequence: (logits [T, V] fp32, routing [moe layers, T, k]) recorded by router hooks."""
    taps = []
    hooks = [m.router.register_forward_hook(lambda mod, inp, out: taps.append(out.expert_ids.cpu()))
             for m in model.moe_layers()]
    try:
        dev = next(model.parameters()).device
        t = torch.tensor(tokens, device=dev)
        logits = model(t, torch.arange(len(tokens), device=dev),
                       torch.tensor([0, len(tokens)], dtype=torch.int32, device=dev))
    finally:
        for h in hooks:
            h.remove()
    return logits.float().cpu(), torch.stack(taps) if taps else torch.zeros(0, len(tokens), 0, dtype=torch.int64)


def micro_batches(groups, dp_size: int = 1, max_tokens: int = 4096, std_normalize: bool = True,
                  cp_cfg=None, finer: tuple[int, int] | None = None) -> list[list[dict]]:
    """Trajectory groups (proto messages) as the dataloader serves them: per dp rank, its micro-batch dicts. With
    `cp_cfg` (a Config) each carries the CP size the RL source gives it for `parallel.cp`/`cp_sizes` and the
    `data.cp_max_*` budget, as the client hands it over (`cp_size`, an int64 0-dim tensor); without, none (the trainer
    then cuts over its whole CP group). `finer`: (dp rank, tokens): that rank re-packs the samples the source dealt it
    into micro-batches of at most `tokens` (a test-only unevenness: it runs more micro-batches than the others)."""
    from services.dataloader.cp_sizing import CPBudget, allowed_cp_sizes, choose_cp_size
    from services.dataloader.packing import best_fit_decreasing
    from services.dataloader.rollout_source import build_rank, pack_step, plan_step, step_samples

    layers, top_k = groups[0].moe_layers, groups[0].top_k
    sizes, budget = [1], CPBudget()
    if cp_cfg is not None:
        sizes = allowed_cp_sizes(cp_cfg.parallel)
        budget = CPBudget(cp_cfg.data.cp_max_tokens_per_rank, cp_cfg.data.cp_max_attn_per_rank)
    if finer is None:
        per_rank = pack_step(groups, dp_size, max_tokens, std_normalize, layers, top_k, cp_sizes=sizes, budget=budget)
    else:  # pack_step's steps, with the one rank's share re-packed before it is built
        samples, temperature = step_samples(groups, std_normalize, layers, top_k)
        plan = plan_step(samples, dp_size, max_tokens, sizes, budget)
        r, tokens = finer
        plan[r] = [(b, choose_cp_size([s.positions for s in b], sizes, budget))
                   for b in best_fit_decreasing([s for b, _ in plan[r] for s in b], tokens)]
        per_rank = [build_rank(rank, layers, top_k, temperature) for rank in plan]
    if cp_cfg is None:
        return [[dict(mb.tensors) for mb in rank] for rank in per_rank]
    return [[{**mb.tensors, "cp_size": torch.tensor(mb.cp_size, dtype=torch.int64)} for mb in rank]
            for rank in per_rank]


def single_process_rl_steps(model: MoETransformer, cfg, steps):
    """The one-process reference of the RL parity tests: `rl_step` with `build_adamw` and a reference model copied
    from `model`, on each step's groups as the dataloader serves one rank; yields each step's metrics, after the step
    (the caller reads the updated model then)."""
    from services.trainer.optim import build_adamw, set_lr
    from services.trainer.rl.step import rl_step
    from services.trainer.rl.train_rl import reference_model

    ref = reference_model(model, cfg)
    opt = build_adamw(model, cfg.optimizer)
    for step, groups in enumerate(steps):
        set_lr(opt, cfg.optimizer.lr)
        (data,) = micro_batches(groups, dp_size=1, max_tokens=cfg.rl.micro_batch_tokens)
        yield rl_step(model, opt, data, cfg.rl, torch.device("cpu"), cfg.optimizer.clip_grad, ref, version=step,
                      lr=cfg.optimizer.lr).read()
