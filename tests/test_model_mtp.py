"""Multi-token prediction (`model.mtp_num_layers`, services/trainer/model/mtp.py), as DeepSeek-V3 §2.2 specifies it.

- Depth k at position i reads token t_{i+k} and predicts t_{i+k+1}, both inside i's own packed document; positions
  whose target lies past their document's end predict nothing.
- The model's returned loss is the main loss, bit for bit; backward adds λ/D times the depths' cross-entropy sums:
  every gradient equals that of a hand-built sum over documents, fp32 1e-5; the depths' mean cross-entropy per target
  token is kept for the step record (`mtp_loss`).
- With λ = 0 (and no router losses, which the MTP block's MoE has as every MoE layer) the main model trains exactly
  as without MTP and the MTP weights get zero gradients.
- The depths' shifted labels come from the whole micro-batch: a context-parallel shard's rows are the whole
  micro-batch's at its tokens, though its zigzag chunks' following tokens sit on another rank.
- The config refuses what MTP does not run with (RL), naming the key.
"""

from __future__ import annotations

import copy

import pytest
import torch

from services.common.config import ConfigError, load_config
from services.trainer.model.loss import IGNORE_INDEX
from services.trainer.model.attention import document_ids
from services.trainer.model.mtp import future_labels, mean_per_target, shift_in_document
from services.trainer.model.transformer import MoETransformer
from services.trainer.parallel.context_parallel import shard_micro_batch, zigzag_index
from services.trainer.parallel.groups import Axis, ParallelGroups, single_process
from parallel_harness import make_batches, tiny_config


def test_shift_in_document_takes_labels_from_the_same_document_only():
    labels = torch.tensor([10, 11, 12, 20, 21, IGNORE_INDEX, IGNORE_INDEX])
    segments = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    assert shift_in_document(labels, segments, 0).tolist() == labels.tolist()
    assert shift_in_document(labels, segments, 1).tolist() == [11, 12, -100, 21, -100, -100, -100]
    assert shift_in_document(labels, segments, 2).tolist() == [12, -100, -100, -100, -100, -100, -100]
    assert future_labels(labels, segments, 2).tolist() == [shift_in_document(labels, segments, k).tolist()
                                                           for k in (1, 2)]


def mtp_model(depths: int, coeff: float = 0.3) -> MoETransformer:
    cfg = tiny_config().model
    cfg.mtp_num_layers, cfg.mtp_loss_coeff, cfg.z_loss_coeff = depths, coeff, 1e-2
    model = MoETransformer(cfg)
    model.init_weights(0)
    return model


def hand_built_loss(model: MoETransformer, batch: dict) -> torch.Tensor:
    """Main loss + λ/D Σ_k CE_k, the depths' targets picked document by document (the model's modules reused)."""
    tokens, labels, cu = batch["tokens"], batch["labels"], batch["cu_seqlens"]
    seen = {}
    model.norm.register_forward_hook(lambda _m, _args, out: seen.setdefault("h", out))  # the main model's output
    depths, model.mtp = model.mtp, None  # the main model alone
    main = model(tokens, batch["position_ids"], cu, labels=labels)
    model.mtp = depths
    h, depth_losses, means = seen["h"], [], []
    segments = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    for k, layer in enumerate(model.mtp, start=1):
        # t_{i+1} = labels[i]: at document position j, read t_{j+k} and predict t_{j+k+1} where both lie inside it
        inputs, targets = torch.zeros_like(tokens), torch.full_like(labels, IGNORE_INDEX)
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            doc_labels = labels[s:e].tolist()
            for j in range(e - s):
                if j + k - 1 < len(doc_labels) and doc_labels[j + k - 1] != IGNORE_INDEX:
                    inputs[s + j] = doc_labels[j + k - 1]
                    if j + k < len(doc_labels):
                        targets[s + j] = doc_labels[j + k]
        x = layer.eh_proj(torch.cat([layer.enorm(model.embed(inputs)), layer.hnorm(h)], dim=-1))
        x, branch = layer.block(x, batch["position_ids"], cu, segments)
        h = layer.norm(x + branch)
        logits = model.output(h).float()
        depth_losses.append(torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX,
                                                              reduction="sum"))
        means.append(depth_losses[-1].detach() / (targets != IGNORE_INDEX).sum())
    model.hand_built_mtp_loss = sum(means) / len(means)
    return main + model.cfg.mtp_loss_coeff / len(model.mtp) * sum(depth_losses)


@pytest.mark.parametrize("depths", [1, 2])
def test_mtp_keeps_the_loss_value_and_adds_lambda_over_d_times_the_depths_gradients(depths):
    model = mtp_model(depths)
    reference = copy.deepcopy(model)
    batch = make_batches(model.cfg, steps=1, micro=1, tokens=40, seed=3)[0][0]
    loss = model(batch["tokens"], batch["position_ids"], batch["cu_seqlens"], labels=batch["labels"])
    plain = mtp_model(0)  # the same main weights: MTP's are initialised after them
    assert torch.equal(loss, plain(batch["tokens"], batch["position_ids"], batch["cu_seqlens"],
                                   labels=batch["labels"]))
    loss.backward()
    hand_built_loss(reference, batch).backward()
    mtp_loss = mean_per_target(model.mtp_loss_sums.take(torch.device("cpu")))  # the step record's mtp_loss
    torch.testing.assert_close(mtp_loss, reference.hand_built_mtp_loss)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"gradient of {name}")
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n.startswith("mtp.") and p.ndim > 1
               and ".experts." not in n)


def test_mtp_with_zero_coefficient_trains_the_main_model_as_without_it():
    model, plain = mtp_model(1, coeff=0.0), mtp_model(0)
    for m in (model, plain):  # the MTP block's own router losses would still reach the shared embedding
        for moe in m.moe_layers():
            moe.router.cfg.aux_loss_coeff = moe.router.cfg.z_loss_coeff = 0.0
    batch = make_batches(model.cfg, steps=1, micro=1, tokens=40, seed=4)[0][0]
    for m in (model, plain):
        m(batch["tokens"], batch["position_ids"], batch["cu_seqlens"], labels=batch["labels"]).backward()
    grads = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            assert p.grad is None or not p.grad.any(), name
        else:
            assert torch.equal(p.grad, grads[name].grad), name


@pytest.mark.parametrize("override, key", [("rl.enabled=true", "rl.enabled"),
                                           ("model.mtp_loss_coeff=-1", "mtp_loss_coeff")])
def test_config_refuses_mtp_where_it_does_not_run_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/tiny.yaml", ["model.mtp_num_layers=1", override])


def test_config_takes_mtp_with_context_parallelism():
    cfg = load_config("configs/tiny.yaml", ["model.mtp_num_layers=1", "parallel.cp=2", "run.nproc=2"])
    assert cfg.model.mtp_num_layers == 1 and cfg.parallel.cp == 2


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_shard_holds_the_whole_micro_batchs_shifted_labels_at_its_tokens(monkeypatch, cp):
    """The chunks' ends: a rank's following tokens are on another rank, so shifting its shard locally would be wrong."""
    batch = make_batches(tiny_config().model, steps=1, micro=1, tokens=48, seed=9)[0][0]
    whole = future_labels(batch["labels"], document_ids(batch["cu_seqlens"], 48), 3)
    locally_shifted_right = []
    for rank in range(cp):
        groups = single_process()
        monkeypatch.setattr(ParallelGroups, "cp_of", lambda self, size, rank=rank: Axis("cp", None, tuple(range(size)), rank))
        local = shard_micro_batch({**batch, "cp_size": torch.tensor(cp)}, groups, mtp_depths=3)
        index = zigzag_index(48, cp, rank)
        assert torch.equal(local["mtp_labels"], whole[:, index])
        assert torch.equal(local["labels"], batch["labels"][index])
        local_shift = future_labels(local["labels"], document_ids(local["cu_seqlens"], len(index)), 3)
        locally_shifted_right.append(torch.equal(local_shift, local["mtp_labels"]))
    # shifting a shard's own labels by its own segments loses the targets past its chunks' ends
    assert not all(locally_shifted_right)


def test_the_depths_residual_stream_has_the_main_streams_dtype_under_bf16_autocast():
    """eh_proj runs in bf16 under autocast; the depth's block still gets the stream in the embedding's dtype (fp32), as
    every main block does, not autocast's bf16."""
    model = mtp_model(1)
    seen = {}
    for name, block in (("main", model.layers["0"]), ("mtp", model.mtp[0].block)):
        block.register_forward_pre_hook(lambda _m, args, name=name: seen.update({name: args[0].dtype}))
    batch = make_batches(model.cfg, steps=1, micro=1, tokens=40, seed=3)[0][0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(batch["tokens"], batch["position_ids"], batch["cu_seqlens"], labels=batch["labels"]).backward()
    assert seen == {"main": torch.float32, "mtp": torch.float32}


def test_the_tokens_and_every_depths_inputs_are_embedded_in_one_lookup():
    """One embedding call per micro-batch: its dense [vocab, h] gradient is made once, not once per depth and summed."""
    model = mtp_model(2)
    calls = []
    model.embed.register_forward_hook(lambda _m, args, _out: calls.append(tuple(args[0].shape)))
    batch = make_batches(model.cfg, steps=1, micro=1, tokens=40, seed=3)[0][0]
    model(batch["tokens"], batch["position_ids"], batch["cu_seqlens"], labels=batch["labels"]).backward()
    assert calls == [(40, 3)]


def test_moe_layers_are_the_blocks_then_the_mtp_depths_moe_layers_in_order_on_a_stage_too():
    """`moe_layers()` reads the layers off the blocks (it is called per micro-batch); it must list what a walk of every
    module finds, in the same order: leading dense layers left out, MTP depths' MoE layers last, a pipeline stage's
    own only."""
    from services.trainer.model.moe.moe_layer import MoELayer
    cfg = tiny_config().model
    cfg.num_layers, cfg.first_k_dense, cfg.mtp_num_layers = 4, 1, 2
    model = MoETransformer(cfg)
    walked = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert model.moe_layers() == walked and len(walked) == 3 + 2
    del model.layers["0"], model.layers["1"]  # what a later pipeline stage holds
    model.mtp = None
    assert model.moe_layers() == [m for m in model.modules() if isinstance(m, MoELayer)] and len(model.moe_layers()) == 2
