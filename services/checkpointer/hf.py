"""Hugging Face interop: our full (unsharded) model state dict <-> HF safetensors + config.json, and dense -> MoE upcycling.

The checkpointer knows parameter names here only (with hf_deepseek.py: DeepSeek-V3's attention and FP8 layouts;
hf_families.py maps config.json); they follow `services/trainer/model/` (MoETransformer): `embed`,
`layers.{i}.attn.{q,k,v,o}_proj` (q/k/v `.bias` with `model.qkv_bias`), `attn.{q,k}_norm` (with `model.qk_norm`) or
MLA's `attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}`, `attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
o_proj}` (with `model.attention=mla`), `attn_norm`, `mlp_norm`, dense `mlp.{gate,up,down}_proj`, MoE `mlp.router.weight`
/ `mlp.router.expert_bias` / `mlp.experts.w13` [E, h, 2f] (gate columns first) / `mlp.experts.w2` [E, f, h] /
`mlp.shared_expert.{gate,up,down}_proj` / `mlp.shared_expert_gate` (with `model.shared_expert_gate`), `norm`, `output`.
HF `nn.Linear` weights are [out, in]; our stacked experts are [in, out], hence transposes.

Families: "mixtral" (MixtralForCausalLM: `block_sparse_moe.gate`, `experts.{e}.w1/w3/w2`, no QK-norm, top-k
probabilities always renormalised), "qwen3_moe" (Qwen3MoeForCausalLM: `mlp.gate`, `experts.{e}.gate_proj/up_proj/
down_proj`, per-head `self_attn.{q,k}_norm`, `norm_topk_prob` as configured, leading dense layers as `mlp_only_layers`),
"qwen2_moe" (Qwen2MoeForCausalLM, Qwen1.5-MoE and Qwen2-MoE: as qwen3_moe without QK-norm, with q/k/v biases and a
`mlp.shared_expert` whose output is scaled by sigmoid(`mlp.shared_expert_gate`)) and "deepseek_v3"
(DeepseekV3ForCausalLM: MLA attention with its RoPE rows reordered, sigmoid group-limited routing whose
`mlp.gate.e_score_correction_bias` is our expert bias, `mlp.shared_experts`, YaRN RoPE, leading dense layers as
`first_k_dense_replace`), "deepseek_v2" (DeepseekV2ForCausalLM, DeepSeek-V2-Lite: as deepseek_v3 with softmax scores,
unnormalised top-k weights, greedy top-k without a group limit, no selection bias, no MTP); and the dense "qwen3"
(Qwen3ForCausalLM: QK-norm), "qwen2" (Qwen2ForCausalLM, Qwen2 and Qwen2.5: q/k/v biases), "llama" (LlamaForCausalLM,
Llama 3.1's RoPE scaling too) and "mistral" (MistralForCausalLM, without a sliding window): our model with every layer's
MLP dense (`model.first_k_dense=num_layers`), to upcycle. Export writes the per-expert ("original") layout, which every
transformers version loads; import also reads the fused layout transformers 5 keeps in memory
(`mlp.experts.gate_up_proj` [E, 2f, h] / `down_proj` [E, h, f], `mlp.gate`), FP8 block-quantised weights (the published
DeepSeek-V3 checkpoints: dequantised on import). DeepSeek-V3's multi-token-prediction layers (`model.layers.{L..}`,
`num_nextn_predict_layers`) are our `mtp.{k}` depths (`mtp.{k}.block.*` the decoder layer, `enorm`, `hnorm`, `eh_proj`,
`norm` for shared_head.norm), both ways.

Conversion is exact or refused: a config or state the family cannot express (a shared expert outside Qwen2-MoE and
DeepSeek, sigmoid or group-limited routing, expert capacity, a trained expert bias, QK-norm on Mixtral or its absence
on Qwen3, MLA or YaRN outside DeepSeek, RoPE types other than plain and YaRN, an output projection's bias, sliding
windows, ...) raises `HFError` naming what does not fit, and so does an HF tensor that import would otherwise drop.
tests/test_checkpointer_hf_transformers.py, tests/test_checkpointer_hf_dense_transformers.py and
tests/test_checkpointer_hf_deepseek_transformers.py check that transformers computes the same logits.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.checkpointer.hf_deepseek import check_block_scales, dequantize_blocks, mla_from_hf, mla_to_hf
from services.checkpointer.hf_families import Family, HFError, check_family, config_from_hf, hf_config
from services.common import logs
from services.common.config import ModelConfig

_MOE = {"mixtral": ("block_sparse_moe", "gate", ("w1", "w3", "w2")),
        "qwen3_moe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
        "qwen2_moe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
        "deepseek_v3": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
        "deepseek_v2": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))}
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_QK_NORM = ("q_norm", "k_norm")
_QKV_BIAS = ("q_proj.bias", "k_proj.bias", "v_proj.bias")  # with model.qkv_bias (Qwen2)
# the families' shared expert, HF's name
_SHARED = {"deepseek_v3": "shared_experts", "deepseek_v2": "shared_experts", "qwen2_moe": "shared_expert"}
_MLP = ("gate_proj", "up_proj", "down_proj")
_MTP = ("enorm", "hnorm", "eh_proj")  # an MTP depth's own weights beside its decoder block and shared_head.norm
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")  # a non-persistent buffer some older HF checkpoints still hold
SHARD_BYTES = 4 << 30  # an export's weights per safetensors file (each file is built in host memory)
INDEX = "model.safetensors.index.json"  # a sharded export's map of tensor names to files
log = logs.logger("checkpointer")


# ---------------------------------------------------------------- weights


def pieces(cfg: ModelConfig) -> int:
    """How many pieces `to_hf_pieces` and `from_hf_pieces` yield: the embedding, final norm and output layer, then
    each layer, then each multi-token-prediction depth."""
    return 1 + cfg.num_layers + cfg.mtp_num_layers


def items(pieces: Iterable[dict[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of `pieces` (the `*_pieces` generators' output), in order, a piece at a time."""
    for piece in pieces:
        yield from piece.items()


def to_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig, family: Family) -> dict[str, torch.Tensor]:
    """Our full state dict -> HF names and layouts (the per-expert layout every transformers version reads; each
    expert's tensors are transposed views of the stacked ones)."""
    return dict(items(to_hf_pieces(state, cfg, family)))


def to_hf_pieces(state: Mapping[str, torch.Tensor], cfg: ModelConfig,
                 family: Family) -> Iterator[dict[str, torch.Tensor]]:
    """`to_hf` a piece at a time (`pieces(cfg)` of them), reading `state` as it goes: with a `state` that reads each
    tensor when asked for (a checkpoint's, convert.py), host memory holds one layer, not the model."""
    check_family(cfg, family)
    if family != "deepseek_v3":  # checked before anything is yielded: an export fails before it writes
        for name in (n for n in state if n.endswith("mlp.router.expert_bias")):
            bias = state[name]
            if not bias.is_meta and bool(torch.any(bias != 0)):
                raise HFError(f"{name} is not zero (aux-loss-free balancing): {family} routes without a selection "
                              "bias, so the exported model would pick other experts")
    yield {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"],
           "lm_head.weight": state["output.weight"]}
    for i in range(cfg.num_layers):
        yield _block_to_hf(state, cfg, family, f"layers.{i}.", f"model.layers.{i}.", i)
    for k in range(cfg.mtp_num_layers):
        yield _mtp_to_hf(state, cfg, k)


def _block_to_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig, family: Family, ours: str, hf: str,
                 layer_id: int) -> dict[str, torch.Tensor]:
    out = {hf + "input_layernorm.weight": state[ours + "attn_norm.weight"],
           hf + "post_attention_layernorm.weight": state[ours + "mlp_norm.weight"]}
    if cfg.attention == "mla":
        out.update(mla_to_hf(state, cfg, ours, hf))
    for p in () if cfg.attention == "mla" else _ATTN + (_QK_NORM if cfg.qk_norm else ()):
        out[f"{hf}self_attn.{p}.weight"] = state[f"{ours}attn.{p}.weight"]
    for p in _QKV_BIAS if cfg.qkv_bias else ():
        out[f"{hf}self_attn.{p}"] = state[f"{ours}attn.{p}"]
    if layer_id < cfg.first_k_dense:
        out.update({f"{hf}mlp.{p}.weight": state[f"{ours}mlp.{p}.weight"] for p in _MLP})
    else:
        out.update(_moe_to_hf(state, cfg, family, ours, hf))
    return out


def _mtp_to_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig, k: int) -> dict[str, torch.Tensor]:
    """MTP depth k as DeepSeek-V3 stores it: `model.layers.{L + k}`, a decoder layer with enorm, hnorm, eh_proj,
    shared_head.norm, and copies of the embedding and output layer it shares (embed_tokens, shared_head.head)."""
    ours, hf, layer_id = f"mtp.{k}.", f"model.layers.{cfg.num_layers + k}.", cfg.num_layers + k
    out = _block_to_hf(state, cfg, "deepseek_v3", ours + "block.", hf, layer_id)
    out.update({f"{hf}{n}.weight": state[f"{ours}{n}.weight"] for n in _MTP})
    out.update({hf + "shared_head.norm.weight": state[ours + "norm.weight"],
                # copies, as published (safetensors stores no tensor twice under two names)
                hf + "shared_head.head.weight": state["output.weight"].clone(),
                hf + "embed_tokens.weight": state["embed.weight"].clone()})
    return out


def _moe_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, family: Family, ours: str,
               hf: str) -> dict[str, torch.Tensor]:
    block, gate_name, (w_gate, w_up, w_down) = _MOE[family]
    f, gate = cfg.moe_ffn_hidden_size, f"{hf}{block}.{gate_name}."
    out = {gate + "weight": state[ours + "mlp.router.weight"]}
    if family == "deepseek_v3":  # the same role: added to the scores for selection only (the others have none)
        out[gate + "e_score_correction_bias"] = state[ours + "mlp.router.expert_bias"]
    if family in _SHARED:
        out.update({f"{hf}mlp.{_SHARED[family]}.{p}.weight": state[f"{ours}mlp.shared_expert.{p}.weight"]
                    for p in _MLP})
    if cfg.shared_expert_gate:
        out[f"{hf}mlp.shared_expert_gate.weight"] = state[f"{ours}mlp.shared_expert_gate.weight"]
    # views of the stacked experts (transposed, not contiguous): a copy of each is made once, by whoever stores it
    # (export_hf's, in the export dtype), not here in the checkpoint's dtype first
    w13, w2 = state[ours + "mlp.experts.w13"], state[ours + "mlp.experts.w2"]
    for e in range(cfg.num_experts):
        prefix = f"{hf}{block}.experts.{e}."
        out[prefix + f"{w_gate}.weight"] = w13[e, :, :f].T
        out[prefix + f"{w_up}.weight"] = w13[e, :, f:].T
        out[prefix + f"{w_down}.weight"] = w2[e].T
    return out


class _Reader:
    """HF tensors read name by name; what was read is remembered, so import can refuse to drop the rest."""

    def __init__(self, hf: Mapping[str, torch.Tensor], cfg: ModelConfig, family: Family, rope_interleave: bool = True):
        self.hf, self.cfg, self.family, self.used = hf, cfg, family, set()
        self.rope_interleave = rope_interleave  # deepseek_v3: whether the rope rows are interleaved pairs

    def __call__(self, *names: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The first of `names` the checkpoint has (alternative spellings of one tensor), of `shape` where given."""
        for name in names:
            if name in self.hf:
                self.used.add(name)
                t = self.hf[name]
                if shape is not None and tuple(t.shape) != shape:
                    raise HFError(f"{name} is {list(t.shape)}, where a {self.family} model of this config has "
                                  f"{list(shape)}; config.json does not describe the tensors beside it")
                return t
        raise HFError(f"HF checkpoint has no {names[0]!r}; is it a {self.family} model with {self.cfg.num_layers} "
                      f"layers and {self.cfg.num_experts} experts?")

    def has(self, name: str) -> bool:
        return name in self.hf

    def refuse_unused(self) -> None:
        unused = sorted(k for k in self.hf if k not in self.used and not _IGNORED.search(k))
        if unused:
            raise HFError(f"HF checkpoint has {len(unused)} tensors a {self.family} model of this config does not "
                          f"use (e.g. {unused[:3]}); converting would drop them")


def from_hf(hf: Mapping[str, torch.Tensor], cfg: ModelConfig, family: Family,
            rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """HF names and layouts -> our full state dict (expert bias from deepseek_v3's e_score_correction_bias, zero for
    the families that have none).

    Reads the per-expert layout and transformers 5's fused one (`mlp.experts.gate_up_proj` / `down_proj`); every HF
    tensor must be used, so nothing the family computes with is dropped. `rope_interleave`: deepseek_v3's config
    field of that name (whether its rope rows are interleaved pairs).
    """
    return dict(items(from_hf_pieces(hf, cfg, family, rope_interleave)))


def from_hf_pieces(hf: Mapping[str, torch.Tensor], cfg: ModelConfig, family: Family,
                   rope_interleave: bool = True) -> Iterator[dict[str, torch.Tensor]]:
    """`from_hf` a piece at a time (`pieces(cfg)` of them), reading `hf` as it goes (an `HFTensors`: host memory holds
    one layer, not the model); the unused tensors are refused after the last piece."""
    check_family(cfg, family)
    take = _Reader(hf, cfg, family, rope_interleave)
    yield {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight"),
           "output.weight": take("lm_head.weight")}
    for i in range(cfg.num_layers):
        yield _block_from_hf(take, cfg, family, f"layers.{i}.", f"model.layers.{i}.", i)
    for k in range(cfg.mtp_num_layers):
        yield _mtp_from_hf(take, cfg, k)
    take.refuse_unused()


def _block_from_hf(take: _Reader, cfg: ModelConfig, family: Family, ours: str, pre: str,
                   layer_id: int) -> dict[str, torch.Tensor]:
    out = {ours + "attn_norm.weight": take(pre + "input_layernorm.weight"),
           ours + "mlp_norm.weight": take(pre + "post_attention_layernorm.weight")}
    if cfg.attention == "mla":
        out.update(mla_from_hf(take, cfg, ours, pre, take.rope_interleave))
    for p in () if cfg.attention == "mla" else _ATTN + (_QK_NORM if cfg.qk_norm else ()):
        out[f"{ours}attn.{p}.weight"] = take(f"{pre}self_attn.{p}.weight")
    for p in _QKV_BIAS if cfg.qkv_bias else ():
        out[f"{ours}attn.{p}"] = take(f"{pre}self_attn.{p}")
    if layer_id < cfg.first_k_dense:
        out.update({f"{ours}mlp.{p}.weight": take(f"{pre}mlp.{p}.weight") for p in _MLP})
    else:
        out.update(_moe_from_hf(take, cfg, family, ours, pre))
    return out


def _mtp_from_hf(take: _Reader, cfg: ModelConfig, k: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's `model.layers.{L + k}` -> our MTP depth k. Its copies of the embedding and output layer, where the
    checkpoint has them, must be the main model's: ours are shared."""
    ours, pre, layer_id = f"mtp.{k}.", f"model.layers.{cfg.num_layers + k}.", cfg.num_layers + k
    out = _block_from_hf(take, cfg, "deepseek_v3", ours + "block.", pre, layer_id)
    out.update({f"{ours}{n}.weight": take(f"{pre}{n}.weight") for n in _MTP})
    out[ours + "norm.weight"] = take(pre + "shared_head.norm.weight")
    for copy, main, shared in (("embed_tokens.weight", "model.embed_tokens.weight", "embed.weight"),
                               ("shared_head.head.weight", "lm_head.weight", "output.weight")):
        if take.has(pre + copy) and not take(pre + copy).is_meta and not torch.equal(take(pre + copy), take(main)):
            raise HFError(f"{pre}{copy} differs from the main model's {shared}: our multi-token prediction shares "
                          "the embedding and output layer, as DeepSeek-V3 does")
    return out


def _moe_from_hf(take: _Reader, cfg: ModelConfig, family: Family, ours: str, pre: str) -> dict[str, torch.Tensor]:
    block, gate_name, (w_gate, w_up, w_down) = _MOE[family]
    out = {ours + "mlp.router.weight": take(f"{pre}{block}.{gate_name}.weight", f"{pre}mlp.gate.weight")}
    if family == "deepseek_v3":
        out[ours + "mlp.router.expert_bias"] = take(f"{pre}mlp.gate.e_score_correction_bias").float()
    else:
        out[ours + "mlp.router.expert_bias"] = torch.zeros(cfg.num_experts, dtype=torch.float32)
    if family in _SHARED:
        out.update({f"{ours}mlp.shared_expert.{p}.weight": take(f"{pre}mlp.{_SHARED[family]}.{p}.weight")
                    for p in _MLP})
    if cfg.shared_expert_gate:
        out[ours + "mlp.shared_expert_gate.weight"] = take(f"{pre}mlp.shared_expert_gate.weight")
    fused = f"{pre}mlp.experts."
    if take.has(fused + "gate_up_proj"):  # [E, 2f, h] (gate rows first) and [E, h, f]
        out[ours + "mlp.experts.w13"] = take(fused + "gate_up_proj").transpose(1, 2).contiguous()
        out[ours + "mlp.experts.w2"] = take(fused + "down_proj").transpose(1, 2).contiguous()
        return out
    h, f = cfg.hidden_size, cfg.moe_ffn_hidden_size
    w13 = w2 = None  # filled expert by expert: the layer's experts are held once, not also as a list of them
    for e in range(cfg.num_experts):
        p = f"{pre}{block}.experts.{e}."
        gate, up = (take(p + f"{w}.weight", shape=(f, h)) for w in (w_gate, w_up))
        down = take(p + f"{w_down}.weight", shape=(h, f))
        if w13 is None:
            w13, w2 = gate.new_empty(cfg.num_experts, h, 2 * f), down.new_empty(cfg.num_experts, f, h)
        w13[e, :, :f], w13[e, :, f:], w2[e] = gate.T, up.T, down.T
    out[ours + "mlp.experts.w13"], out[ours + "mlp.experts.w2"] = w13, w2
    return out


# ---------------------------------------------------------------- files


def export_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig, family: Family, out_dir: str | Path,
              dtype: torch.dtype = torch.bfloat16, max_positions: int = 4096, shard_bytes: int = SHARD_BYTES,
              track: Callable[[Iterator[dict[str, torch.Tensor]]], Iterable[dict[str, torch.Tensor]]] = iter) -> Path:
    """Write `config.json` and the weights, loadable by transformers' <family>ForCausalLM:
    `model.safetensors`, or where they pass `shard_bytes`, `model-0000i-of-0000n.safetensors` files and the
    `model.safetensors.index.json` that maps names to them (as transformers shards). `state` is read a layer at a
    time and a shard is held at a time (with a `state` that reads on demand, convert.py's, host memory holds that, not
    the model). DeepSeek-V3's expert bias stays fp32, as transformers keeps it: a rounded bias would pick other
    experts. `track` wraps the pieces (convert.py's progress bar)."""
    config = hf_config(cfg, family, str(dtype).removeprefix("torch."), max_positions)
    out = Path(out_dir)
    written: list[tuple[Path, list[str]]] = []  # the files so far (under temporary names) and their tensors
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        if not written:  # the directory is made once something is to be written: a refusal leaves none
            out.mkdir(parents=True, exist_ok=True)
            for old in (*out.glob("model*.safetensors"), out / INDEX):  # an earlier export's files
                old.unlink(missing_ok=True)
        path = out / f".shard-{len(written)}.safetensors.tmp"
        save_file(shard, str(path), metadata={"format": "pt"})
        written.append((path, list(shard)))

    for name, t in items(track(to_hf_pieces(state, cfg, family))):
        # one contiguous copy in the export dtype (a view in that dtype already: `.to` keeps it, `.contiguous` copies)
        t = t.detach().to("cpu", torch.float32 if name.endswith("e_score_correction_bias") else dtype,
                          memory_format=torch.contiguous_format).contiguous()
        if shard and size + t.nbytes > shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name] = t
        size, total = size + t.nbytes, total + t.nbytes
    flush()
    names = ["model.safetensors"] if len(written) == 1 else [f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
                                                              for i in range(len(written))]
    for (path, _), name in zip(written, names):
        path.rename(out / name)
    if len(written) > 1:
        weight_map = {t: name for (_, tensors), name in zip(written, names) for t in tensors}
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


class HFTensors(Mapping[str, torch.Tensor]):
    """The tensors of an HF model directory's *.safetensors files, each read from its file when asked for (host memory
    holds what the caller keeps, not the checkpoint), in `dtype`: routers' selection biases in fp32 (the dtype our
    routers keep), FP8 block-quantised weights dequantised (their `weight_scale_inv` is not listed). With `meta`,
    shapes only, on the meta device: a pass over them reads nothing. A tied output layer (`tie_word_embeddings`
    without `lm_head.weight`) reads the embedding. What cannot be read or dequantised is refused when opened."""

    def __init__(self, src: Path, dtype: torch.dtype, block: tuple[int, int] | None, tied: bool):
        files = _weight_files(src)
        self.dtype, self.block, self.meta = dtype, block, False
        self._files: dict[str, tuple[Path, Any]] = {}  # name -> (its file, the open file)
        self._shapes: dict[str, tuple[int, ...]] = {}
        fp8 = []
        for file in files:
            with _reading(file):
                handle = safe_open(str(file), framework="pt")
                for key in handle.keys():
                    piece = handle.get_slice(key)
                    self._files[key], self._shapes[key] = (file, handle), tuple(piece.get_shape())
                    if piece.get_dtype().startswith("F8"):
                        fp8.append(key)
        scales = [k for k in self._shapes if k.endswith(".weight_scale_inv")]
        if scales and block is None:
            raise HFError(f"{scales[0]}: block scales but config.json has no quantization_config naming their block "
                          "size")
        for key in scales:
            name = key.removesuffix("_scale_inv")
            if name not in self._shapes:
                raise HFError(f"HF checkpoint has {key} but no {name} to scale")
            try:
                check_block_scales(self._shapes[name], self._shapes[key], block)
            except ValueError as e:
                raise HFError(f"{name}: {e}") from None
        raw = [k for k in fp8 if k + "_scale_inv" not in self._shapes]
        if raw:
            raise HFError(f"{raw[:3]} are FP8 without a weight_scale_inv: cannot recover their values")
        self._names = [k for k in self._shapes if k not in set(scales)]
        self._alias = {}
        if tied and "lm_head.weight" not in self._shapes and "model.embed_tokens.weight" in self._shapes:
            self._alias["lm_head.weight"] = "model.embed_tokens.weight"  # our output layer gets its own copy
        self._names += list(self._alias)

    def as_meta(self) -> HFTensors:
        shapes = copy.copy(self)
        shapes.meta = True
        return shapes

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._alias or (name in self._shapes and not str(name).endswith(".weight_scale_inv"))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise KeyError(name)
        key = self._alias.get(name, name)
        dtype = torch.float32 if key.endswith("e_score_correction_bias") else self.dtype
        if self.meta:
            return torch.empty(self._shapes[key], dtype=dtype, device="meta")
        if key + "_scale_inv" in self._shapes:
            return dequantize_blocks(self._read(key), self._read(key + "_scale_inv"), self.block, dtype)
        t = self._read(key).to(dtype)
        return t.clone() if key != name else t  # a tied output layer: its own copy

    def _read(self, key: str) -> torch.Tensor:
        file, handle = self._files[key]
        with _reading(file):
            return handle.get_tensor(key)


def _weight_files(src: Path) -> list[Path]:
    """The safetensors files of an HF model directory: those its index names, where it has one (a directory may also
    hold other weights, as Mistral's repositories hold consolidated.safetensors), else every *.safetensors."""
    index = src / INDEX
    if not index.is_file():
        files = sorted(src.glob("*.safetensors"))
        if not files:
            raise HFError(f"no *.safetensors files in {src}; point at an HF model directory")
        return files
    try:
        names = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise HFError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
    files = sorted(src / name for name in names)
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise HFError(f"{src} lacks {len(missing)} of the {len(files)} files its {INDEX} names (e.g. {missing[0]}): "
                      "an incomplete download?")
    return files


@contextmanager
def _reading(file: Path) -> Iterator[None]:
    try:
        yield
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types (SafetensorError, OSError)
        raise HFError(f"{file} cannot be read as safetensors ({e}); the file is corrupt or truncated") from None


@dataclass(frozen=True)
class HFModel:
    """An HF model directory opened for import: its config as ours, its tensors read as they are converted."""
    cfg: ModelConfig
    family: Family
    tensors: HFTensors
    rope_interleave: bool  # deepseek_v3's config field: whether its rope rows are interleaved pairs

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Our state's names and shapes, by a pass over the tensors' shapes alone (nothing is read); refuses what the
        conversion would refuse for want of a value or a tensor it would drop."""
        meta = from_hf_pieces(self.tensors.as_meta(), self.cfg, self.family, self.rope_interleave)
        return {k: tuple(t.shape) for k, t in items(meta)}

    def state(self) -> Iterator[dict[str, torch.Tensor]]:
        """Our state, a piece at a time (`pieces(cfg)` of them): host memory holds one layer's weights."""
        return from_hf_pieces(self.tensors, self.cfg, self.family, self.rope_interleave)


def open_hf(src: str | Path, dtype: torch.dtype = torch.float32) -> HFModel:
    """An HF model directory (config.json + one or more *.safetensors) as our config, with its tensors to be read in
    `dtype` as they are converted; FP8 block-quantised weights are dequantised to `dtype`; DeepSeek-V3's MTP layers
    become our MTP depths."""
    src = Path(src)
    if not (src / "config.json").is_file():
        raise HFError(f"{src / 'config.json'} is missing; point at an HF model directory")
    try:
        config = json.loads((src / "config.json").read_text())
        cfg, family = config_from_hf(config)
        block = _fp8_block(config)
    except json.JSONDecodeError as e:
        raise HFError(f"{src / 'config.json'} is not valid JSON ({e})") from None
    except KeyError as e:
        raise HFError(f"{src / 'config.json'} has no {e} field: not a complete HF model config") from None
    except (TypeError, AttributeError) as e:  # a field of the wrong kind
        raise HFError(f"{src / 'config.json'} is not an HF model config ({type(e).__name__}: {e})") from None
    tensors = HFTensors(src, dtype, block, tied=bool(config.get("tie_word_embeddings")))
    return HFModel(_mtp_depths_present(cfg, tensors, src), family, tensors,
                   # DeepSeek-V2's are always interleaved pairs (transformers rotates them as complex numbers)
                   rope_interleave=family == "deepseek_v2" or bool(config.get("rope_interleave", True)))


def import_hf(src: str | Path, dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """`open_hf`'s model, read whole into our state dict, and its config."""
    model = open_hf(src, dtype)
    return dict(items(model.state())), model.cfg


def _mtp_depths_present(cfg: ModelConfig, hf: Mapping[str, torch.Tensor], src: Path) -> ModelConfig:
    """`cfg` with as many MTP depths as the checkpoint holds layers for: transformers writes DeepSeek-V3's
    num_nextn_predict_layers (default 1) into every config.json, also where it saves no MTP weights."""
    depths = 0
    while depths < cfg.mtp_num_layers and any(k.startswith(f"model.layers.{cfg.num_layers + depths}.") for k in hf):
        depths += 1
    if depths < cfg.mtp_num_layers:
        log.info("%s: config.json declares %d multi-token-prediction layers, the checkpoint holds %d: imported with "
                 "model.mtp_num_layers=%d", src, cfg.mtp_num_layers, depths, depths)
    return dataclasses.replace(cfg, mtp_num_layers=depths)


def _fp8_block(config: dict) -> tuple[int, int] | None:
    """The weight block of an FP8 block-quantised checkpoint (quantization_config as DeepSeek-V3 publishes it)."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    if quant.get("quant_method") != "fp8" or len(quant.get("weight_block_size") or ()) != 2:
        raise HFError(f"quantization_config {quant}: only FP8 with per-block weight scales (quant_method 'fp8', "
                      "weight_block_size [rows, cols], as DeepSeek-V3 publishes) is dequantised on import")
    return tuple(quant["weight_block_size"])


def upcycle(dense: Mapping[str, torch.Tensor], dense_cfg: ModelConfig, moe_cfg: ModelConfig,
            seed: int = 0) -> dict[str, torch.Tensor]:
    """A dense model's state -> an MoE model's (sparse upcycling): every expert starts as a copy of the layer's MLP and
    the router is freshly initialised, so the MoE computes the dense function whenever top-k weights sum to 1."""
    return dict(items(upcycle_pieces(dense, dense_cfg, moe_cfg, seed)))


def upcycle_pieces(dense: Mapping[str, torch.Tensor], dense_cfg: ModelConfig, moe_cfg: ModelConfig,
                   seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """`upcycle` a piece at a time (1 + num_layers of them: what is outside the layers, then each layer), reading
    `dense` as it goes: host memory holds one MoE layer, not the model."""
    mismatched = [k for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size")
                  if getattr(dense_cfg, k) != getattr(moe_cfg, k)]
    if mismatched:
        raise HFError(f"upcycling keeps the trunk: dense and MoE configs differ in {mismatched}")
    if moe_cfg.moe_ffn_hidden_size != dense_cfg.ffn_hidden_size:
        raise HFError(f"experts copy the dense MLP: need `model.moe_ffn_hidden_size={dense_cfg.ffn_hidden_size}` "
                      f"(the dense ffn_hidden_size), got {moe_cfg.moe_ffn_hidden_size}")
    g = torch.Generator().manual_seed(seed)
    layers: dict[int, list[str]] = {}  # layer -> its names; -1: those outside the layers
    for name in dense:
        m = re.match(r"layers\.(\d+)\.", name)
        layers.setdefault(int(m.group(1)) if m else -1, []).append(name)
    yield {name: dense[name] for name in layers.get(-1, [])}
    for i in range(moe_cfg.num_layers):
        p, E = f"layers.{i}.mlp.", moe_cfg.num_experts
        moe = i >= moe_cfg.first_k_dense
        out = {name: dense[name] for name in layers.get(i, []) if not (moe and name.startswith(p))}
        if moe:
            gate, up, down = (dense[f"{p}{n}_proj.weight"] for n in ("gate", "up", "down"))
            out[p + "experts.w13"] = torch.cat([gate.T, up.T], dim=1).unsqueeze(0).repeat(E, 1, 1)
            out[p + "experts.w2"] = down.T.unsqueeze(0).repeat(E, 1, 1).contiguous()
            out[p + "router.weight"] = (torch.randn(E, moe_cfg.hidden_size, generator=g).to(gate.dtype)
                                        * moe_cfg.init_std).to(gate.device)
            out[p + "router.expert_bias"] = torch.zeros(E, dtype=torch.float32, device=gate.device)
        yield out
