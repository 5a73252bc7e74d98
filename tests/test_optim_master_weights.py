"""bf16 parameters with fp32 master weights in the optimizer (`optimizer.param_dtype=bf16`).

Specification: the master weights follow exactly the update torch's AdamW makes on fp32 parameters given the same
(bf16) gradients, clipping included; the optimizer keeps them as int16 remainders beside the bf16 parameters, which
are always the master weights rounded to bf16 (to nearest, ties away from zero: kernels/adamw.py `split_master`); the
distributed optimizer's buckets make the same update as the one-process optimizer; checkpoints hold each bf16
parameter with its remainder (`optim/<param>/remainder`) and a restore brings the master weights back exactly (not
their bf16 rounding).
Tolerance: 1e-6 relative (fp32 arithmetic in a different order), exact where a value is only rounded or copied.
"""

from __future__ import annotations

import pytest
import torch

from services.checkpointer.shard import tensor_name
from services.common.config import Config, ModelConfig
from kernels.adamw import join_master, split_master
from services.trainer import checkpointing
from services.trainer.model.transformer import MoETransformer
from services.trainer.optim import DTYPES, MasterWeightAdamW, build_adamw, clip_and_step, param_groups, stays_fp32
from services.trainer.parallel import checkpoint_shards
from services.trainer.parallel.distributed_optimizer import DistributedOptimizer
from services.trainer.parallel.groups import single_process

HYPER = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CFG = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2,
                  moe_ffn_hidden_size=16, ffn_hidden_size=48, vocab_size=64, first_k_dense=1)


def fp32_params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((33, 7), (7,), (3, 4, 5))]


def bf16_grads(params, seed: int, size: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(p.shape, generator=gen) * size).bfloat16() for p in params]


@pytest.mark.parametrize("max_norm, grad_size", [(0.0, 1.0), (1.0, 10.0), (1.0, 0.01)])
def test_master_weights_follow_fp32_adamw_and_the_params_are_their_bf16_rounding(max_norm, grad_size):
    ref, ours = fp32_params(0), fp32_params(0)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **HYPER)
    opt = MasterWeightAdamW(ours, **HYPER)
    assert all(p.dtype == torch.bfloat16 for p in ours)
    for step in range(4):
        grads = bf16_grads(ours, step, grad_size)
        for r, o, g in zip(ref, ours, grads):
            r.grad, o.grad = g.float(), g.clone()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm) if max_norm else None
        ref_opt.step()
        norm = clip_and_step(opt, ours, max_norm)
        if ref_norm is not None:
            torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        for r, o in zip(ref, ours):
            master = opt.master_value(o)
            assert "master" not in opt.state[o] and opt.state[o]["remainder"].dtype == torch.int16
            torch.testing.assert_close(master, r.detach(), rtol=1e-6, atol=1e-7)
            assert torch.equal(o.detach(), split_master(master)[0])


@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_with_fp32_parameters_the_one_process_optimizer_is_torch_adamw_on_the_parameters_themselves(max_norm):
    """`build_adamw` with `optimizer.param_dtype=fp32` (the default): the parameters stay fp32 and are their own master
    weights (no copy is kept), and each step is torch AdamW's, clipping included."""
    ref, model = tiny_model(), tiny_model()
    cfg = Config().optimizer
    cfg.lr, cfg.weight_decay = 0.01, 0.1
    opt = build_adamw(model, cfg)
    ref_opt = torch.optim.AdamW(param_groups(ref, 0.1), lr=0.01, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                foreach=False)
    for p in model.parameters():
        assert p.dtype == torch.float32 and opt.state[p]["master"].data_ptr() == p.data_ptr()
    for step in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad(set_to_none=True)
            backward(m, step)
        if max_norm:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        clip_and_step(opt, model.parameters(), max_norm)
        for (name, r), o in zip(ref.named_parameters(), model.parameters()):
            torch.testing.assert_close(o.detach(), r.detach(), rtol=1e-6, atol=1e-7, msg=name)


def test_only_fp32_parameters_can_hand_over_their_values():
    with pytest.raises(ValueError, match="fp32 parameters"):
        MasterWeightAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], **HYPER)


def tiny_model(seed: int = 1) -> MoETransformer:
    model = MoETransformer(CFG)
    model.init_weights(seed)
    return model


def backward(model: MoETransformer, seed: int) -> None:
    """One forward/backward under bf16 autocast (as the trainer runs bf16 parameters, fp32 embedding and norms)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (12,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens, torch.arange(12), torch.tensor([0, 12], dtype=torch.int32))
    torch.nn.functional.cross_entropy(logits.float().reshape(12, -1), tokens).backward()


def bf16_config(moment_dtype: str = "fp32") -> Config:
    cfg = Config()
    cfg.optimizer.param_dtype = "bf16"
    cfg.optimizer.moment_dtype = moment_dtype
    return cfg


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_distributed_optimizer_buckets_make_the_one_process_update(moment_dtype):
    """One process through the bucketed path (bf16 buckets, fp32 gradient buckets and master range) against
    MasterWeightAdamW on an identical model: same bf16 forward, so the same gradients, then the same update."""
    cfg = bf16_config(moment_dtype)
    plain, bucketed = tiny_model(), tiny_model()
    opt = build_adamw(plain, cfg.optimizer)
    dist_opt = DistributedOptimizer(bucketed, single_process(cfg), cfg.optimizer, bucket_mb=0.01)
    assert len(dist_opt.buckets) > 1
    for b in dist_opt.buckets:
        assert all(b.params.dtype == (torch.float32 if stays_fp32(s.name, s.param) else torch.bfloat16)
                   for s in b.slots)
    assert all(b.exp_avg_sq.dtype == opt.state[p]["exp_avg_sq"].dtype == DTYPES[moment_dtype]
               for b, p in zip(dist_opt.buckets, plain.parameters()))
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        dist_opt.zero_grad()
        dist_opt.begin_step(1)
        backward(plain, step)
        backward(bucketed, step)
        norm = clip_and_step(opt, plain.parameters(), cfg.optimizer.clip_grad)
        torch.testing.assert_close(dist_opt.step(cfg.optimizer.lr), norm, rtol=1e-6, atol=0)
    masters = bucket_masters(dist_opt)
    # The two sum the squared gradients for the clipping norm in different orders (per bucket, per tensor): the norms
    # can differ by an ulp, which flips the bf16 rounding of a few parameters, so the next step's gradients differ
    # slightly too. Masters agree to 1% of one step's update (measured: 4e-7 at lr 3e-3 after 3 steps, one element).
    for (name, p), q in zip(plain.named_parameters(), bucketed.parameters()):
        torch.testing.assert_close(masters[name].view_as(p), opt.master_value(p), rtol=1e-6,
                                   atol=0.01 * cfg.optimizer.lr)
        torch.testing.assert_close(q.detach().float(), p.detach().float(), rtol=0, atol=2 ** -7 * p.abs().max().item())


def bucket_masters(opt: DistributedOptimizer) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 master weight in the buckets (one process: it owns every range)."""
    out = {}
    for b in opt.buckets:
        flat = b.master if b.remainder is None else join_master(b.params[b.lo:b.hi], b.remainder)
        out.update({s.name: flat[s.start - b.lo:s.start - b.lo + s.numel] for s in b.slots})
    return out


class ShardCheckpoint:
    """What `load_shards` reads, served from one process's shards (whole tensors) in memory."""

    def __init__(self, shards):
        self.tensors = {n: s.tensor.clone() for n, s in shards.items()}

    @classmethod
    def assembled(cls, ranks: list[dict]) -> ShardCheckpoint:
        """From every rank's written pieces, {key: (piece, global_shape, offsets)}: each element exactly once."""
        tensors, covered = {}, {}
        for pieces in ranks:
            for key, (t, shape, offsets) in pieces.items():
                name = tensor_name(key)
                full = tensors.setdefault(name, torch.zeros(shape, dtype=t.dtype))
                full[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))] = t
                covered[name] = covered.get(name, 0) + t.numel()
        assert all(covered[n] == t.numel() for n, t in tensors.items()), "pieces overlap or leave gaps"
        checkpoint = cls({})
        checkpoint.tensors = tensors
        return checkpoint

    def names(self):
        return list(self.tensors)

    def global_shape(self, name):
        return tuple(self.tensors[name].shape)

    def read(self, name, offsets=None, shape=None):
        t = self.tensors[name]
        if offsets is None:
            return t
        return t[tuple(slice(o, o + n) for o, n in zip(offsets, shape))]

    def read_boxes(self, boxes):
        return (self.read(*box) for box in boxes)


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_bucketed_checkpoints_hold_and_restore_the_fp32_master_weights(moment_dtype):
    cfg = bf16_config(moment_dtype)
    groups = single_process(cfg)
    model = tiny_model()
    opt = DistributedOptimizer(model, groups, cfg.optimizer, bucket_mb=0.01)
    opt.zero_grad()
    opt.begin_step(1)
    backward(model, 0)
    opt.step(cfg.optimizer.lr)
    shards = checkpointing.state_shards(model, opt, rank=0, groups=groups)
    params = dict(model.named_parameters())
    for name, master in bucket_masters(opt).items():
        remainder = f"optim/{name}/remainder"
        bf16 = shards[f"model/{name}"].tensor.dtype == torch.bfloat16
        assert (remainder in shards) == bf16 and bf16 != stays_fp32(name, params[name]), name
        saved = checkpointing.saved_value(lambda n: shards[n].tensor, name, set(shards))
        assert saved.dtype == torch.float32 and torch.equal(saved.reshape(-1), master), name

    fresh = tiny_model(seed=2)
    fresh_opt = DistributedOptimizer(fresh, groups, cfg.optimizer, bucket_mb=0.01)
    checkpoint_shards.load_shards(ShardCheckpoint(shards), fresh, fresh_opt, groups)
    for b, c in zip(opt.buckets, fresh_opt.buckets, strict=True):
        for key in ("master", "remainder", "exp_avg", "exp_avg_sq", "params"):
            assert (getattr(b, key) is None and getattr(c, key) is None) or torch.equal(getattr(b, key),
                                                                                       getattr(c, key)), key
    assert fresh_opt.step_count == 1


def test_gradients_of_several_backward_passes_are_summed_in_fp32():
    """One backward: the bf16 `.grad` is the gradient (no copy). Several: exactly the fp32 sum of each backward's bf16
    gradient, with `.grad` cleared (bf16 accumulation would round every partial sum to 8 bits)."""
    model = tiny_model()
    opt = MasterWeightAdamW(model.parameters(), **HYPER)
    singles = []
    for seed in range(3):
        opt.zero_grad()
        backward(model, seed)
        assert all(opt.grad(p) is p.grad and p.grad.dtype == torch.bfloat16 for p in model.parameters())
        singles.append({p: p.grad.float() for p in model.parameters()})
    opt.zero_grad()
    for seed in range(3):
        backward(model, seed)
    for p in model.parameters():
        assert p.grad is None and opt.grad(p).dtype == torch.float32
        assert torch.equal(opt.grad(p), singles[0][p] + singles[1][p] + singles[2][p])


def test_bf16_moments_stay_close_to_fp32_moments():
    """bf16 moments round each stored moment to 8 bits; the update's math is fp32. Over 20 steps of noisy gradients
    the master weights move as with fp32 moments to within 1% of how far they moved (measured: 0.10-0.21%)."""
    ref, ours = fp32_params(0), fp32_params(0)
    start = [p.detach().clone() for p in ref]
    ref_opt = MasterWeightAdamW(ref, **HYPER)
    opt = MasterWeightAdamW(ours, moment_dtype=torch.bfloat16, **HYPER)
    assert opt.state[ours[0]]["exp_avg"].dtype == torch.bfloat16
    for step in range(20):
        for r, o, g in zip(ref, ours, bf16_grads(ours, step, 1.0)):
            r.grad, o.grad = g.clone(), g.clone()
        ref_opt.step()
        opt.step()
    for r, o, s in zip(ref, ours, start):
        moved, ours_moved = ref_opt.master_value(r) - s, opt.master_value(o) - s
        assert float((ours_moved - moved).norm() / moved.norm()) < 1e-2


def test_bf16_moments_need_bf16_parameters():
    from services.common.config import ConfigError, validate

    cfg = Config()
    cfg.optimizer.moment_dtype = "bf16"
    with pytest.raises(ConfigError, match="optimizer.param_dtype=bf16"):
        validate(cfg)


def test_under_autocast_bf16_parameters_compute_exactly_what_fp32_parameters_do():
    """Only matrices that autocast would cast to bf16 are stored in bf16 (`stays_fp32`): same logits, bit for bit, as
    fp32 parameters holding the same values. (Those are the initial weights except at exact ties, which the stored
    bf16 rounds away from zero where autocast rounds to even: see kernels/adamw.py.)"""
    fp32_model, bf16_model = tiny_model(), tiny_model()
    build_adamw(bf16_model, bf16_config().optimizer)
    with torch.no_grad():
        for p, q in zip(fp32_model.parameters(), bf16_model.parameters()):
            p.copy_(q)
    tokens = torch.randint(0, CFG.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = (m(tokens, torch.arange(12), torch.tensor([0, 12], dtype=torch.int32)) for m in (fp32_model, bf16_model))
    assert bf16_model.output.weight.dtype == torch.bfloat16 and bf16_model.embed.weight.dtype == torch.float32
    assert torch.equal(a, b)


def test_the_optimizer_does_not_keep_itself_or_the_model_alive():
    import gc
    import weakref

    model = tiny_model()
    opt = build_adamw(model, bf16_config().optimizer)
    gone = weakref.ref(opt), weakref.ref(model)
    del model, opt
    gc.collect()
    assert all(ref() is None for ref in gone)


def _sharded_save_worker(rank: int, world: int, out_dir: str) -> None:
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from services.trainer.parallel.groups import init_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        cfg = bf16_config("bf16")
        cfg.parallel.dp = world
        groups = init_groups(cfg)
        model = tiny_model()
        opt = DistributedOptimizer(model, groups, cfg.optimizer, bucket_mb=0.01)
        opt.zero_grad()
        opt.begin_step(1)
        backward(model, rank)  # each replica its own data: the step's update depends on both
        opt.step(cfg.optimizer.lr)
        shards = checkpointing.state_shards(model, opt, rank=rank, groups=groups)
        owned = [(b.lo, b.hi, join_master(b.params[b.lo:b.hi], b.remainder) if b.remainder is not None else
                  b.master.clone()) for b in opt.buckets]
        mine = {n: (s.tensor.clone(), s.global_shape, s.offsets) for n, s in shards.items() if s.written}
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)  # what the checkpointer would receive from every rank
        fresh = tiny_model(seed=2)
        fresh_opt = DistributedOptimizer(fresh, groups, cfg.optimizer, bucket_mb=0.01)
        checkpoint_shards.load_shards(ShardCheckpoint.assembled(everyone), fresh, fresh_opt, groups)
        same = all((getattr(b, k) is None and getattr(c, k) is None) or torch.equal(getattr(b, k), getattr(c, k))
                   for b, c in zip(opt.buckets, fresh_opt.buckets, strict=True)
                   for k in ("remainder", "master", "exp_avg", "exp_avg_sq", "params"))
        slots = [[(s.name, s.start, s.numel) for s in b.slots] for b in opt.buckets]
        torch.save({"pieces": mine, "owned": owned, "slots": slots, "restored": same},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_sharded_save_hands_each_owners_range_and_the_pieces_restore_every_master(tmp_path):
    """Two data-parallel ranks, each owning half of every bucket: each hands the checkpointer only its half (of the
    parameters, remainders and moments: nothing gathered), as boxes that together cover every tensor exactly once; the
    bf16 values joined with the remainders are, for every parameter, the masters of whichever rank owned each element;
    each rank restores its own half from them exactly."""
    from tests.parallel_harness import spawn_ranks

    ranks = spawn_ranks(_sharded_save_worker, (2, str(tmp_path)), 2, str(tmp_path), timeout_s=120)
    assert all(r["restored"] for r in ranks)
    saved = ShardCheckpoint.assembled([r["pieces"] for r in ranks]).tensors
    state = [sum(t.numel() * t.element_size() for n, (t, _, _) in r["pieces"].items()
                 if n.startswith("optim/") and not n.endswith("/step")) for r in ranks]
    assert state[0] > 0 and abs(state[0] - state[1]) <= 0.02 * state[0], state  # each rank writes its half
    for b, slots in enumerate(ranks[0]["slots"]):
        flat = torch.cat([r["owned"][b][2] for r in ranks])  # the owners' ranges, in order, cover the bucket
        assert [r["owned"][b][:2] for r in ranks] == [(0, flat.numel() // 2), (flat.numel() // 2, flat.numel())]
        for name, start, numel in slots:
            value = checkpointing.saved_value(lambda n: saved[n], name, set(saved))
            assert torch.equal(value.reshape(-1).float(), flat[start:start + numel]), name
