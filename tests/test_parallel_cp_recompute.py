"""`model.recompute: [attn_core]` (and `[layer]`) under context parallelism: the context-parallel core is recomputed in
backward with the layout of the micro-batch whose forward it repeats, whatever layout is bound when backward runs.

The parity runs pair micro-batches (`parallel.ep_overlap`, EP over the CP ranks): both forwards of a pair run before
their one backward, so when backward recomputes the first one's core the second one's layout is bound; or run 1F1B on
two pipeline stages, where the first stage runs the next micro-batch's forward before a backward. The micro-batches
hold other documents (and, under dynamic CP, one is cut over 2 ranks and the other not cut at all): a recompute that
read the bound layout would attend over the wrong documents, or locally, and its gradients would not be the single
process's. Tolerances as every CP parity test (harness: 1e-5 relative L2, fp32). The last test shows what recomputing
the core frees: everything it made in forward, until backward.
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dynamic_cp_harness import run_dynamic_cp
from parallel_harness import TIMEOUT_S, assert_parity, make_batches, run_parallel, run_reference, spawn_ranks
from test_parallel_cp import cp_config
from services.trainer.model.transformer import MoETransformer


def recomputed_pairs_config(**parallel):
    cfg = cp_config(ep=2, ep_overlap=True, **parallel)
    cfg.data.grad_accum = 2  # one pair per step (the harness passes the micro-batches itself)
    cfg.model.recompute = ["attn_core"]
    return cfg


@pytest.mark.parametrize("comm, offload", [("ring", []), ("allgather", []), ("ring", ["attn"])],
                         ids=["ring", "allgather", "ring-offload-attn"])
def test_cp2_recomputed_attention_core_uses_its_own_micro_batchs_layout_in_backward(tmp_path, comm, offload):
    """With `model.offload: [attn]` too, the attention's saved tensors (the checkpoint's inputs among them) go to the
    host around the recomputed core."""
    cfg = recomputed_pairs_config(cp=2, cp_comm=comm)
    cfg.model.offload = offload
    batches = make_batches(cfg.model, steps=2, micro=2, tokens=32, seed=21)
    for mbs in batches:  # the pair's micro-batches are cut at other places: their layouts differ
        assert not torch.equal(mbs[0]["cu_seqlens"], mbs[1]["cu_seqlens"])
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=2, out_dir=str(tmp_path)))


@pytest.mark.parametrize("recompute", [["attn_core"], ["layer"]])
def test_pp2_cp2_recompute_in_1f1b_uses_the_layout_of_the_micro_batch_it_repeats(tmp_path, recompute):
    """1F1B on PP2: the first stage runs the second micro-batch's forward (binding its layout) before the first one's
    backward, which recomputes the first one's attention core, or its whole decoder blocks ("layer", where the core's
    forward itself runs again)."""
    cfg = cp_config(pp=2, cp=2)
    cfg.model.recompute = recompute
    batches = make_batches(cfg.model, steps=2, micro=2, tokens=32, seed=21)
    assert_parity(run_reference(cfg, batches), run_parallel(cfg, batches, world=4, out_dir=str(tmp_path)))


def test_dynamic_cp_recomputed_attention_core_uses_its_own_micro_batchs_group_in_backward(tmp_path):
    """Sizes [2, 1, 1] on CP2: each rank runs the size-2 micro-batch (cut over both ranks, ring) paired with one
    size-1 micro-batch of its own (not cut, local attention), which is bound when the pair's backward starts."""
    cfg = recomputed_pairs_config(cp=2, cp_sizes=[1, 2], cp_comm="ring")
    batches = make_batches(cfg.model, steps=2, micro=3, tokens=32, seed=22)
    for mbs in batches:
        for mb, size in zip(mbs, (2, 1, 1)):
            mb["cp_size"] = torch.tensor(size)
    assert_parity(run_reference(cfg, batches), run_dynamic_cp(cfg, batches, world=2, out_dir=str(tmp_path)))


@pytest.mark.parametrize("recompute", [["layer"], ["moe"]], ids=["layer", "moe"])
def test_pp2_dynamic_cp_recomputed_blocks_use_the_cp_group_of_the_micro_batch_they_repeat(recompute, tmp_path):
    """PP2 x CP2, sizes [2, 1, 1]: each first-stage rank runs the size-2 micro-batch's forward, then its own size-1
    one's (not cut: no CP group bound), then the size-2 one's backward, which recomputes its blocks ("layer") or its
    MoE layer ("moe"): the routers' micro-batch aux and z-loss statistics must still sum over the CP group its forward
    summed over."""
    cfg = cp_config(pp=2, cp=2, cp_sizes=[1, 2], cp_comm="ring")
    cfg.model.num_layers, cfg.model.recompute = 4, recompute  # the first stage: a dense and a MoE layer
    batches = make_batches(cfg.model, steps=2, micro=3, tokens=32, seed=23)
    for mbs in batches:
        for mb, size in zip(mbs, (2, 1, 1)):
            mb["cp_size"] = torch.tensor(size)
    assert_parity(run_reference(cfg, batches), run_dynamic_cp(cfg, batches, world=4, out_dir=str(tmp_path)))


# ---------------------------------------------------------------- what the recomputed core keeps


class StoragesMade(TorchDispatchMode):
    """Every storage the ops run under it return, weakly: (reference, bytes, data address)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[StorageWeakRef, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.made.append((StorageWeakRef(s), s.nbytes(), s.data_ptr()))
        return out


def _keeping_worker(rank: int, world: int, out_dir: str) -> None:
    """For the plain and the recomputed CP2 (all-gather) model, one micro-batch: the bytes of the storages the attention
    cores made in forward (not views of their q, k, v or output) that are still alive when forward ends, whatever holds
    them; the K/V all-gathers run in forward and in backward; the gradients."""
    from services.trainer.model.recompute import apply_memory_policy
    from services.trainer.parallel import context_parallel
    from services.trainer.parallel.groups import init_groups
    from services.trainer.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        cfg = cp_config(cp=2, cp_comm="allgather")
        groups = init_groups(cfg)
        mb = context_parallel.shard_micro_batch(make_batches(cfg.model, 1, 1, tokens=64, seed=5)[0][0], groups,
                                                "allgather")
        gather = context_parallel.gather_tokens
        result = {}
        for recompute in ([], ["attn_core"]):
            model = MoETransformer(cfg.model)
            model.init_weights(7)
            parallelize(model, cfg, groups)
            apply_memory_policy(model, recompute, [])
            gathers, mode, passed = [], StoragesMade(), set()  # passed: the cores' inputs' and outputs' storages

            def recorded(forward):
                def run(*args):
                    with mode:
                        out = forward(*args)
                    passed.update(t.untyped_storage().data_ptr() for t in (*args[:3], out))
                    return out
                return run

            for core in model.cp_modules.cores:  # outside the checkpoint, where the policy put one
                core.forward = recorded(core.forward)
            context_parallel.gather_tokens = lambda t, g: gathers.append(t.nbytes) or gather(t, g)
            try:
                context_parallel.bind_micro_batch(model, mb)
                loss = model(mb["tokens"], mb["position_ids"], mb["cu_seqlens"], labels=mb["labels"])
                gc.collect()
                kept = sum(nbytes for ref, nbytes, ptr in {m[2]: m for m in mode.made}.values()
                           if not ref.expired() and ptr not in passed)
                forward_gathers = len(gathers)
                loss.backward()
            finally:
                context_parallel.gather_tokens = gather
            result[tuple(recompute)] = {
                "kept": kept, "forward_gathers": forward_gathers, "backward_gathers": len(gathers) - forward_gathers,
                "gathered_bytes": world * sum(gathers[:forward_gathers]),
                "cores": len(model.cp_modules.cores),
                "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_recomputed_cp_core_keeps_nothing_it_made_until_backward(tmp_path):
    """All-gather CP2: the plain core keeps what it made in forward (the gathered K/V's expansions, the attention
    weights) until backward; the recomputed core keeps none of it (its inputs stay, held by the checkpoint, and its
    output, held by the output projection), gathers K/V again in backward, and the gradients are the plain model's."""
    for result in spawn_ranks(_keeping_worker, (2, str(tmp_path)), 2, str(tmp_path)):
        plain, recomputed = result[()], result[("attn_core",)]
        gathers = 2 * plain["cores"]  # K and V, per layer
        assert plain["forward_gathers"] == gathers and plain["backward_gathers"] == 0
        assert recomputed["forward_gathers"] == gathers and recomputed["backward_gathers"] == gathers
        assert plain["kept"] >= plain["gathered_bytes"] > 0 and recomputed["kept"] == 0, (plain["kept"],
                                                                                         recomputed["kept"])
        for name, grad in plain["grads"].items():
            torch.testing.assert_close(recomputed["grads"][name], grad, rtol=1e-6, atol=1e-7, msg=name)
