"""The one typed config tree: model, parallel, data, optimizer, checkpoint, run.

Loaded from YAML, then `section.key=value` overrides from the command line. Unknown keys and impossible values fail at load
with a `ConfigError` naming the key, so a bad run dies before any process starts.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config file or override that cannot describe a valid run."""


# Credits a dataloader client may hold (its `data.prefetch`, at most this); the server builds and keeps every
# micro-batch they pay for, so a client that asks for more (a broken or hostile one: credits are uint32) is held to it.
MAX_PREFETCH = 1024


@dataclass
class ModelConfig:
    vocab_size: int = 264  # byte tokenizer: 256 bytes + EOS + PAD, rounded up to a multiple of 8 for vocab-parallel TP
    hidden_size: int = 128  # width of the residual stream (d_model)
    num_layers: int = 4  # decoder blocks
    num_heads: int = 4  # query heads per attention layer
    num_kv_heads: int = 2  # GQA: query heads share key/value heads in groups of num_heads // num_kv_heads
    #                        (ignored with attention=mla: every head has its own keys/values from the latent)
    head_dim: int = 0  # GQA's per-head q/k/v width, 0: hidden_size // num_heads (ignored with attention=mla)
    # "gqa": grouped-query attention (q/k/v/o projections); "mla": DeepSeek-V2/V3 Multi-head Latent Attention
    # (services/trainer/model/mla.py): keys and values expanded per head from a kv_lora_rank latent plus one
    # qk_rope_head_dim RoPE key shared by all heads; needs the five MLA dims below (the last four > 0)
    attention: Literal["gqa", "mla"] = "gqa"
    q_lora_rank: int = 0  # MLA: queries through a low-rank q_a_proj -> RMSNorm -> q_b_proj of this rank; 0: one q_proj
    kv_lora_rank: int = 0  # MLA: width of the compressed key/value latent (what a KV cache of MLA would hold)
    qk_nope_head_dim: int = 0  # MLA: per-head query/key dims without RoPE (from the latent)
    qk_rope_head_dim: int = 0  # MLA: per-head query/key dims with RoPE (the key's are one head shared by all), even
    v_head_dim: int = 0  # MLA: per-head value width (o_proj reads num_heads x v_head_dim)
    ffn_hidden_size: int = 512  # dense MLP width (dense first layers)
    first_k_dense: int = 0  # leading layers with a dense MLP instead of MoE (DeepSeek-V3: 3)
    num_experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # experts each token is sent to
    moe_ffn_hidden_size: int = 256  # per-expert SwiGLU width
    shared_expert_ffn_hidden_size: int = 0  # 0: no shared expert
    # the shared expert's output times sigmoid(x . w_gate), w_gate a learned [1, hidden] row per MoE layer read from the
    # layer's input (Qwen2-MoE's shared_expert_gate, Megatron's moe_shared_expert_gate); needs a shared expert
    shared_expert_gate: bool = False
    score_func: Literal["softmax", "sigmoid"] = "softmax"  # router scores: softmax over experts, or an independent
    #                                                        sigmoid per expert (DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1
    num_groups: int = 0  # group-limited routing: experts in num_groups groups, tokens pick topk_groups of them (0: off)
    topk_groups: int = 0  # group-limited routing: groups each token's experts may come from
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' combine weights (DeepSeek-V3: 2.5)
    # load-balancing loss over each micro-batch's tokens, over each packed document ("sequence": DeepSeek-V3's
    # sequence-wise loss), over the global batch ("global": the expert shares f counted over every token the step's
    # data-parallel replicas have routed so far, reset at each optimizer step; Qiu et al. 2025, Megatron's
    # global_aux_loss; not with dynamic CP, parallel.cp_sizes), or none (e.g. with bias_update_rate > 0)
    aux_loss_type: Literal["micro_batch", "sequence", "global", "none"] = "micro_batch"
    aux_loss_coeff: float = 1e-2  # weight of the load-balancing loss in the total loss (0: off)
    z_loss_coeff: float = 0.0  # router z-loss weight (ST-MoE): keeps the router logits small (0: off)
    bias_update_rate: float = 0.0  # aux-loss-free balancing: expert bias step per optimizer step (0: off)
    # 0: dropless; else each expert keeps at most ceil(cf * T * k / E) tokens (RL: of the replayed ids, by the trainer's
    # micro-batch; rollouts generate dropless and the log-prob mismatch metrics show the difference)
    capacity_factor: float = 0.0
    # with capacity_factor > 0: every expert's input is padded to exactly its capacity (zero rows, router weight 0),
    # so the grouped GEMM and expert-parallel all-to-all sizes are known on the host: no per-expert count exchange, no
    # wait for the device. Costs the padding rows' compute and traffic. Not with parallel.dispatcher=allgather or
    # dynamic CP (parallel.cp_sizes) under ep/etp > 1 (EP peers must route equally many tokens), nor in RL with EP
    # groups spanning data-parallel replicas (their micro-batches differ in length)
    pad_to_capacity: bool = False
    rope_theta: float = 10000.0  # RoPE base: larger stretches the rotary wavelengths for longer contexts
    # YaRN context extension (Peng et al. 2023), GQA and MLA alike, as transformers' "yarn" rope type: the rotary
    # frequencies blend interpolated (/ factor) and original ones between the beta_fast and beta_slow rotation counts
    # over rope_original_max_position tokens; the rotated q/k are scaled by m(rope_mscale) / m(rope_mscale_all_dim)
    # (m(1) when either is 0), where m(x) = 0.1 x ln(factor) + 1; and the softmax scale is multiplied by
    # m(rope_mscale_all_dim)^2 (DeepSeek-V2/V3). 1.0: off; > 1: YaRN (DeepSeek-V3: 40)
    rope_scaling_factor: float = 1.0
    rope_original_max_position: int = 4096  # YaRN: context length the model was pre-trained at
    rope_beta_fast: float = 32.0  # YaRN: frequencies rotating more than this often over that context are kept
    rope_beta_slow: float = 1.0  # YaRN: frequencies rotating less than this often are fully interpolated
    rope_mscale: float = 1.0  # YaRN: mscale of the rotated q/k's scale (numerator)
    rope_mscale_all_dim: float = 0.0  # YaRN: mscale of that scale's denominator and of the softmax scale; 0: unused
    # how rope_scaling_factor > 1 extends the context: "yarn" (above), or "llama3" (Llama 3.1's rope type: the
    # frequencies turning fewer than rope_low_freq_factor times over rope_original_max_position tokens are divided by
    # the factor, those turning more than rope_high_freq_factor times kept, a linear blend in turns between; q and k
    # and the softmax unscaled)
    rope_scaling: Literal["yarn", "llama3"] = "yarn"
    rope_low_freq_factor: float = 1.0  # llama3: below this many turns over the original context, interpolated
    rope_high_freq_factor: float = 4.0  # llama3: above this many, kept
    norm_eps: float = 1e-6  # added to the mean square in every RMSNorm
    # Multi-token prediction (DeepSeek-V3, services/trainer/model/mtp.py): decoder blocks after the main model, depth k
    # predicting the token k + 1 after the next, sharing the embedding and output layer; 0: off (DeepSeek-V3: 1).
    # Training only (RL and the rollout decode without it); under context parallelism the labels are shifted before
    # the micro-batch is sharded
    mtp_num_layers: int = 0
    mtp_loss_coeff: float = 0.3  # λ: the depths' mean cross-entropy joins the loss's gradient with this weight
    qk_norm: bool = False  # RMSNorm of each query/key head over head_dim before RoPE (Qwen3), eps = norm_eps
    # biases on the q/k/v projections (Qwen2, Qwen2-MoE; GQA only): zero at initialisation, not weight-decayed, split
    # with their heads under tensor parallelism. The output projection and the MLPs stay bias-free
    qkv_bias: bool = False
    init_std: float = 0.02  # std of the normal init of weight matrices; residual-branch outputs: / sqrt(2 * num_layers)
    # torch.compile the decoder's memory-bound glue into fused kernels, forward and backward: QK-norm + RoPE of the
    # projected heads, and each residual add with the RMSNorm that reads its sum. The GEMMs, attention core and MoE
    # kernels stay as they are. First steps pay the compile time.
    compile: bool = False
    # Triton kernels on CUDA (the CPU path is always the torch reference): "permutation" (permute + unpermute),
    # "activation" (SwiGLU with the router weight folded in), "router" (scores, top-k, weights and aux statistics in one
    # kernel, backward in one more: 2.28x torch forward + backward at Qwen3 shapes, device time; where it does not
    # apply, e.g. group-limited routing, capacity or the sequence aux loss, the router runs in torch), "cross_entropy" (output
    # layer + loss over chunks of tokens, no [T, vocab] logits: kernels/cross_entropy.py; on an H100 +9% step
    # throughput and -11 GiB at the Qwen3 shape; under tensor parallelism over each rank's vocabulary slice: the
    # TP2·EP2 step 1.22x as fast as with the vocab-parallel cross-entropy on logits, two H200s; bench/RESULTS.md).
    moe_kernels: list[str] = field(default_factory=lambda: ["permutation", "activation", "router", "cross_entropy"])
    # FP8 GEMMs on CUDA: "" (off), "tensorwise" or "blockwise" (DeepSeek-V3: 1x128 activation, 128x128 weight blocks).
    # Routed experts: our Triton grouped GEMM (kernels/fp8_grouped_mm.py; tensorwise = a scale per activation row and
    # per expert weight, the whole K accumulated in the tensor cores in forward and in fp32 every 128 products in
    # dgrad, as TE does; forward and dgrad in FP8, wgrad in bf16). Dense linears (attention q/k/v/o, dense and shared
    # SwiGLU MLPs): Transformer Engine, an optional dependency (services/trainer/model/fp8_linear.py; tensorwise = TE's
    # per-tensor current scaling; forward, dgrad and wgrad in FP8); on a machine with CUDA it must be installed or the
    # model build fails naming the fix. Master weights, router, norms, attention core and output layer keep their
    # precision. With several passes per optimizer step (data.grad_accum > 1, pipeline micro-batches, RL log-prob
    # passes) the expert weights are quantised once per step and held in both e4m3 layouts (2 B per expert parameter)
    # until the step ends; with one pass, at each call. On CPU it is accepted and everything runs the bf16/fp32 torch
    # path. Needs hidden_size, the q/k/v/o widths, ffn_hidden_size and shared_expert_ffn_hidden_size (per parallel.tp
    # rank), and moe_ffn_hidden_size (per parallel.etp rank) to be multiples of 16.
    fp8: Literal["", "tensorwise", "blockwise"] = ""
    # Activation memory (services/trainer/model/recompute.py). Recompute in backward instead of keeping: "norm",
    # "attn_core", "moe_act" (expert activation), "moe_fc1" (the experts' gate/up GEMM output, by a second GEMM),
    # "moe_dispatch" (the experts' dispatched rows, permuted again from the layer input; not with parallel.ep or
    # etp > 1), "moe" (whole MoE layer), "layer" (whole decoder block).
    recompute: list[str] = field(default_factory=list)
    # Keep these modules' saved activations in pinned host memory until backward: "attn", "moe", "layer".
    offload: list[str] = field(default_factory=list)
    recompute_layers: list[int] = field(default_factory=list)  # decoder layers (ids 0..num_layers-1) `recompute`
    #                                                            applies to; empty: every layer
    offload_layers: list[int] = field(default_factory=list)  # the same for `offload`

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of queries and keys: MLA's nope + rope dims, GQA's head dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.kv_channels

    @property
    def value_head_dim(self) -> int:
        """Per-head width of values (and of the attention output before o_proj)."""
        return self.v_head_dim if self.attention == "mla" else self.kv_channels


@dataclass
class ParallelConfig:
    """Two factorizations of one world of ranks: world = pp*tp*cp*dp = pp*etp*ep*edp (dp and edp are derived)."""

    tp: int = 1  # tensor parallel (attention/dense), with sequence parallel
    cp: int = 1  # context parallel (attention)
    pp: int = 1  # pipeline stages (shared by both foldings)
    ep: int = 1  # expert parallel
    etp: int = 1  # expert tensor parallel
    sequence_parallel: bool = True  # with tp > 1: activations outside the TP regions are split along the sequence
    # how tokens reach their experts' ranks (parallel/expert_parallel.py): an all-to-all of the routed rows (traffic
    # grows with routed tokens), or an all-gather of every rank's tokens (simpler; better with a small ep and many
    # active experts per token)
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    # how attention gets the other CP ranks' keys/values (parallel/context_parallel.py): all-gathered once (on CUDA,
    # flash attention over each document's key prefix), or passed around a ring, overlapped with compute (on CUDA,
    # flash over mask-free blocks; never holds all keys at once). On two H200s the all-gather is 1.36x the ring at
    # 4k-token sequences and 1.06x at 32k (bench/RESULTS.md)
    cp_comm: Literal["ring", "allgather"] = "allgather"
    cp_sizes: list[int] = field(default_factory=list)  # allowed dynamic CP sizes; empty: only `cp`
    distributed_optimizer: bool = True  # ZeRO-1: each data-parallel rank keeps master weights and Adam moments for
    #                                     its 1/dp of every gradient bucket (false: all-reduce, every rank updates all)
    pp_layers: list[int] = field(default_factory=list)  # layers per stage (pp entries), or with pp_virtual > 1 per
    #                                                     model chunk (pp*pp_virtual entries, in layer order); empty:
    #                                                     the split whose costliest chunk has the fewest FLOPs per
    #                                                     token, the output layer counted on the last
    #                                                     (parallel/pipeline_split.py)
    pp_virtual: int = 1  # model chunks per pipeline rank (interleaved 1F1B, parallel/pipeline_interleaved.py): the
    #                      layers are cut into pp*pp_virtual chunks and rank s holds chunks s, s+pp, s+2*pp, ...; the
    #                      pipeline bubble shrinks by this factor, for pp_virtual times the stage-to-stage transfers
    #                      (the last rank also sends to the first) and more activations held in warm-up: on the first
    #                      rank up to (pp-1)/pp_virtual stages' more than plain 1F1B's pp when a step's micro-batches
    #                      are a multiple of pp, up to pp-1 more otherwise; any number of micro-batches works; 1: off
    grad_bucket_mb: float = 25.0  # gradients are reduced in flat buckets of this size, each launched in backward
    #                               as soon as it is complete
    ep_overlap: bool = False  # micro-batches in pairs, interleaved layer by layer, so one's expert all-to-alls are in
    #                           flight while the other computes (parallel/micro_batch_pairs.py); two micro-batches'
    #                           activations alive at once (per pipeline stage: pairs are the 1F1B schedule's units);
    #                           RL pairs its policy-loss passes and its old/reference log-prob passes, forward only
    #                           (rl/pipelined.py); needs ep > 1 and (pre-training) data.grad_accum >= 2; not with
    #                           recompute/offload of 'norm'/'moe'/'layer'


@dataclass
class DataConfig:
    corpus: list[str] = field(default_factory=lambda: ["/usr/share/common-licenses"])  # files or directories of text
    tokenizer: str = "byte"  # "byte" or a path to a HF tokenizer.json
    # renders {"messages": [...]} records, whose assistant turns alone are trained on: a Jinja file or an HF
    # tokenizer_config.json holding "chat_template" (services/dataloader/chat.py); empty: no such records
    chat_template: str = ""
    dataset_dir: str = "runs/data"  # where the tokenized corpus is written
    seq_len: int = 256  # tokens per packed sequence
    micro_batch_size: int = 4  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step per data-parallel rank
    packing_window: int = 256  # documents looked at together by best-fit-decreasing, at least 1
    seed: int = 1234  # document order and packing (the same seed and corpus give the same stream)
    prefetch: int = 8  # micro-batches in flight per rank (credits), 1 to 1024
    blend_weights: list[float] = field(default_factory=list)  # one per corpus entry: each entry its own dataset,
    # sampled per packed sequence with these weights; empty: all entries form one dataset
    cp_max_tokens_per_rank: int = 0  # dynamic CP (parallel.cp_sizes): tokens of a micro-batch per CP rank; 0: no limit
    cp_max_attn_per_rank: float = 0.0  # dynamic CP: attention cost (sum of squared segment lengths) per CP rank; 0: no limit
    rollout_stream: str = ""  # RL run: Redis stream key; empty: the "stream" of a rollout worker's registry record
    replicas: int = 1  # dataloader services of the run; replica r serves the dp ranks with dp_rank % replicas == r
    #                    (each packs the same global stream, the corpus or an RL run's rollout stream, and sends only
    #                    its ranks' micro-batches)
    eval_fraction: float = 0.0  # documents of each corpus dataset held out of training for the evaluation loss
    #                             (`run.eval_interval`), drawn once by `seed`; 0: none held out
    eval_corpus: list[str] = field(default_factory=list)  # files or directories of text the evaluation reads instead
    #                             of held-out documents (a validation split of your own; tokenized into
    #                             <dataset_dir>/eval); empty: the held-out documents (eval_fraction)
    eval_micro_batches: int = 8  # held-out micro-batches (micro_batch_size sequences each) of every evaluation, over
    #                              all dp ranks: the same ones each time, a multiple of the data-parallel size


@dataclass
class OptimizerConfig:
    lr: float = 3e-3  # peak learning rate, reached after warmup_steps, then decayed to min_lr at run.steps (`decay`)
    min_lr: float = 3e-4  # learning rate at the last step
    decay: Literal["cosine", "linear", "wsd", "constant"] = "cosine"  # the shape after warmup: cosine or linear from
    #                              lr to min_lr over the rest of the run; wsd (warmup-stable-decay): lr until the last
    #                              `decay_steps`, then linear to min_lr; constant: lr throughout (min_lr unused)
    decay_steps: int = 0  # wsd: steps of the final decay; 0: the last 20% of the steps after warmup
    weight_decay: float = 0.1  # AdamW's decoupled decay, of matrices only (norm scales and other vectors: none)
    beta1: float = 0.9  # Adam's first-moment decay, in [0, 1)
    beta2: float = 0.95  # Adam's second-moment decay, in [0, 1)
    eps: float = 1e-8  # added to Adam's denominator, > 0
    warmup_steps: int = 20  # steps of linear warmup from lr / warmup_steps to lr
    clip_grad: float = 1.0  # gradients are scaled down to this global L2 norm when above it (0: no clipping)
    param_dtype: Literal["fp32", "bf16"] = "fp32"  # how the model holds its parameters; bf16: the optimizer keeps the
    #                                                fp32 master weights' low 16 bits beside them (exact; checkpoints
    #                                                hold both) and updates both in one pass; gradients stay bf16 in
    #                                                one process (fp32 buckets with dp)
    moment_dtype: Literal["fp32", "bf16"] = "fp32"  # how the optimizer stores Adam's moments (math is fp32 either
    #                                                 way); bf16 needs param_dtype=bf16: 4 B less per parameter


@dataclass
class CheckpointConfig:
    dir: str = "runs/ckpt"  # committed checkpoints are step_NNNNNNNN directories here, `latest` names the newest
    interval: int = 50  # steps between saves; 0: only at the end
    keep_last: int = 3  # newest committed checkpoints kept (the writer deletes older ones not marked keep); 0: all
    resume: bool = True  # start from the newest valid checkpoint in `dir` when there is one
    on_busy: Literal["wait", "skip"] = "wait"  # a save requested while the previous one is still being written
    host_buffers: int = 1  # pinned snapshot buffers per rank (each = the rank's state); 2: a save may start while
    #                        the previous one is still being written, at twice the host memory
    stage_on_device: bool = False  # snapshot into a spare device buffer first (needs one more copy of the rank's
    #                                state in device memory): the next optimizer step waits for an HBM copy, not PCIe
    init_from: str = ""  # a foldmoe checkpoint (a step_NNNNNNNN dir, or a checkpoint dir: its newest valid one) whose
    #                    model weights only start a run that has nothing to resume in `dir` (fresh optimizer, step 0)


@dataclass
class RunConfig:
    name: str = "tiny"  # the run's namespace in Redis: services and trainer ranks of one run find each other by it
    steps: int = 200  # optimizer steps of the whole run (a resumed run goes on to the same total)
    seed: int = 1234  # model init and torch's random state; rollout workers' prompts and samples
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when a GPU is visible, else CPU
    dtype: Literal["fp32", "bf16"] = "bf16"  # autocast dtype on GPU; CPU runs fp32 unless optimizer.param_dtype=bf16
    redis_url: str = ""  # empty: the launcher starts an embedded Redis
    dir: str = "runs"  # the launcher writes the resolved config.yaml and logs/<child>.log here
    nproc: int = 1  # trainer ranks the launcher starts (`foldmoe evaluate`: ranks evaluating in the folded layout)
    peak_tflops: float = 0.0  # per-device peak for MFU; 0: datasheet value for the detected device
    metrics_file: str = "runs/metrics.jsonl"  # rank 0 appends one JSON record per step (`foldmoe plot` reads it)
    max_restarts: int = 3  # times the launcher restarts each crashed service (not the trainer) before failing the run
    profile_steps: list[int] = field(default_factory=list)  # [first, last]: record those steps (1-based) with
    #                                                        torch.profiler into <dir>/profile/trace_rank<r>.json
    bind_host: str = "127.0.0.1"  # interface every gRPC, ZMQ and metrics endpoint listens on; "0.0.0.0": all of them.
    #                               Clients authenticate with the FOLDMOE_AUTH_TOKEN environment variable when it is set
    advertise_host: str = ""  # host registered in Redis for clients to dial; empty: bind_host, or this host's name
    #                           when bind_host is 0.0.0.0
    eval_interval: int = 0  # steps between evaluations of the held-out loss (`data.eval_fraction`), and one after the
    #                         last step; 0: none


@dataclass
class RLConfig:
    # rollout (services/rl_rollout)
    workers: int = 2  # rollout workers the local launcher starts in an RL run (compose scales its own)
    task: str = "arithmetic"  # prompt generator + reward, by name (services/rl_rollout/rewards.py)
    difficulty: int = 2  # task knob: digits per operand (arithmetic), numbers minus one (countdown)
    # prompts of your own instead of the task's generator: JSONL files of {"prompt": ..., and what the reward reads,
    # e.g. "answer"} per line, asked in epochs shared by the workers (services/rl_rollout/prompts.py)
    prompts: list[str] = field(default_factory=list)
    reward: str = ""  # a registered reward (number, exact, arithmetic, countdown) or module:function; empty: rl.task's
    group_size: int = 8  # samples per prompt; GRPO normalises rewards within a group
    # prompts a worker generates together (their groups published as each completes); fewer where less room is left
    prompts_per_batch: int = 4
    max_new_tokens: int = 16  # completion length limit in tokens
    temperature: float = 1.0  # sampling temperature (0: greedy); the trainer scales its logits by the same
    top_p: float = 1.0  # nucleus sampling: smallest token set reaching this probability (1: off)
    top_k: int = 0  # 0: off
    stop: list[str] = field(default_factory=lambda: ["\n"])  # stop strings (EOS always stops)
    max_batch: int = 64  # sequences decoding at once (KV cache slots)
    max_seq_len: int = 128  # prompt + completion tokens per sequence (KV cache length)
    # prompt tokens one prefill forward takes at most: forwards are filled up to this many, a prompt that does not fit
    # continuing in the next (chunked prefill); bounds prefill's activation memory (its MoE rows are top_k x these)
    prefill_tokens: int = 16384
    cuda_graphs: bool = True  # on GPU, decode steps replay CUDA graphs (one per batch and length bucket); false: eager
    max_staleness: int = 1  # trajectories may come from weights at most this many versions behind the trainer
    # a worker pauses while this many groups the next step could use wait unconsumed in the stream, or fewer: once the
    # steps that can still train on a group it makes now have their groups waiting or being generated by another
    # worker (worker.py `room`; more go stale)
    max_queued_groups: int = 64
    # policy versions between evaluations: one worker generates the fixed evaluation prompts greedily with the first
    # weights at or past each multiple (version 0 included) and the trainer's record takes the mean reward; 0: none
    eval_interval: int = 0
    eval_prompts: int = 32  # the evaluation's prompts, drawn once from run.seed apart from the training prompts
    weight_dtype: Literal["bf16", "fp32"] = "bf16"  # dtype of published weights
    weight_chunk_mb: float = 4.0  # published weights travel to the workers in ZMQ messages of about this size

    # training (services/trainer/rl)
    groups_per_step: int = 4  # trajectory groups per optimizer step
    # seconds the trainer waits for a step's groups before it fails; and an rl.prompts place whose group has not come
    # in this long (its worker died) is asked again
    rollout_timeout_s: float = 300.0
    # the dataloader packs a step's samples into micro-batches of at most this many tokens and deals them to the dp
    # ranks by work (services/dataloader/rollout_source.py)
    micro_batch_tokens: int = 4096
    clip_eps_low: float = 0.2  # PPO ratio clipped to [1 - low, 1 + high]
    clip_eps_high: float = 0.28  # above `low`: rarely likely tokens may still grow (clip-higher)
    tis_cap: float = 2.0  # truncated importance sampling: cap on pi_train_old / pi_rollout (0: no correction)
    kl_coef: float = 0.0  # k3 KL to the reference policy (0: no reference model)
    std_normalize: bool = True  # GRPO: divide group-centred rewards by the group std
    recompute_logprobs: bool = True  # trainer recomputes old log-probs before the update (decoupled PPO + TIS)
    enabled: bool = False  # `foldmoe train` runs RL: rollout workers, the dataloader packing their stream, train_rl


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"`{key}={value!r}` is not one of {list(typing.get_args(tp))}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            # "a, b": the spaces around separators are not part of the entries. Entries of a real list are kept as
            # they are: whitespace can be the point of one (the stop string "\n" in rl.stop).
            value = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"`{key}` must be a list, got {value!r}")
        return [_coerce(v, item_tp, key) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"`{key}` must be true or false, got {value!r}")
    if tp in (int, float, str):
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"`{key}` must be an integer, got {value!r}")
        try:
            return tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"`{key}` must be {tp.__name__}, got {value!r}") from None
    raise ConfigError(f"`{key}`: unsupported field type {tp}")


def _apply(obj: Any, values: dict[str, Any], prefix: str) -> None:
    hints = typing.get_type_hints(type(obj))
    for name, value in values.items():
        key = f"{prefix}{name}"
        if name not in hints:
            known = ", ".join(f.name for f in dataclasses.fields(obj))
            raise ConfigError(f"unknown config key `{key}` (known: {known})")
        if dataclasses.is_dataclass(getattr(obj, name)):
            if not isinstance(value, dict):
                raise ConfigError(f"`{key}` is a section; give a mapping, not {value!r}")
            _apply(getattr(obj, name), value, f"{key}.")
        else:
            setattr(obj, name, _coerce(value, hints[name], key))


def _parse_override(item: str) -> dict[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override `{item}` must look like section.key=value")
    dotted, raw = item.split("=", 1)
    value = yaml.safe_load(raw) if raw else ""
    out: dict[str, Any] = {}
    node = out
    parts = dotted.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def _merge(a: dict, b: dict) -> dict:
    for k, v in b.items():
        a[k] = _merge(a.get(k, {}), v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
    return a


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a validated Config from an optional YAML file and `a.b=c` overrides (later wins)."""
    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections")
        values = loaded
    for item in overrides:
        values = _merge(values, _parse_override(item))
    cfg = Config()
    _apply(cfg, values, "")
    validate(cfg)
    return cfg


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _check_choices(key: str, values: list[str], allowed: tuple[str, ...]) -> None:
    unknown = [v for v in values if v not in allowed]
    _check(not unknown, f"`{key}` has unknown entries {unknown}; choose among {list(allowed)}")
    _check(len(set(values)) == len(values), f"`{key}` lists an entry twice: {values}")


_MLA_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_YARN = ("rope_original_max_position", "rope_beta_fast", "rope_beta_slow")


def _check_attention(m: ModelConfig) -> None:
    """GQA's head grouping, or MLA's dims (services/trainer/model/mla.py); YaRN's settings for either."""
    if m.attention == "gqa":
        _check(m.hidden_size % m.num_heads == 0 or m.head_dim > 0,
               f"`model.hidden_size={m.hidden_size}` is not divisible by `model.num_heads={m.num_heads}` (or set "
               "model.head_dim)")
        _check(m.num_heads % m.num_kv_heads == 0,
               f"`model.num_heads={m.num_heads}` is not divisible by `model.num_kv_heads={m.num_kv_heads}`")
        _check(m.kv_channels % 2 == 0, f"head dim {m.kv_channels} must be even for RoPE (`model.head_dim`)")
        # Refused rather than ignored: MLA dims on a GQA model are most likely a forgotten `model.attention=mla`.
        set_ = ", ".join(f"`model.{k}`" for k in ("q_lora_rank", *_MLA_DIMS) if getattr(m, k))
        _check(not set_, f"{set_}: Multi-head Latent Attention dims, but `model.attention=gqa`; set "
                         "model.attention=mla or set them to 0")
    else:
        missing = ", ".join(f"`model.{k}`" for k in _MLA_DIMS if getattr(m, k) <= 0)
        _check(not missing, f"`model.attention=mla` needs {missing} > 0")
        _check(m.q_lora_rank >= 0, f"`model.q_lora_rank={m.q_lora_rank}` must be >= 0 (0: one q_proj)")
        _check(m.qk_rope_head_dim % 2 == 0, f"`model.qk_rope_head_dim={m.qk_rope_head_dim}` must be even for RoPE")
        _check(not m.qk_norm, "`model.qk_norm` (Qwen3's per-head RMSNorm) is not part of `model.attention=mla`, "
                              "which normalises its latents instead (q_a_layernorm, kv_a_layernorm); drop qk_norm")
        _check(not m.qkv_bias, "`model.qkv_bias` (Qwen2's q/k/v biases) is not part of `model.attention=mla`, whose "
                               "projections are bias-free; drop qkv_bias")
    _check(m.rope_scaling_factor >= 1, f"`model.rope_scaling_factor={m.rope_scaling_factor}` must be >= 1 "
                                       "(1: no YaRN)")
    for name in _YARN:
        _check(getattr(m, name) > 0, f"`model.{name}={getattr(m, name)}` must be positive")
    for name in ("rope_mscale", "rope_mscale_all_dim"):
        _check(getattr(m, name) >= 0, f"`model.{name}={getattr(m, name)}` must be >= 0")
    _check(m.rope_scaling in ("yarn", "llama3"), f"`model.rope_scaling={m.rope_scaling}` must be yarn or llama3")
    _check(0 < m.rope_low_freq_factor < m.rope_high_freq_factor,
           f"`model.rope_low_freq_factor={m.rope_low_freq_factor}` and `model.rope_high_freq_factor="
           f"{m.rope_high_freq_factor}` must satisfy 0 < low < high")


def _check_fp8_dense_widths(m: ModelConfig, tp: int) -> None:
    """Transformer Engine's FP8 GEMMs need every dense projection's in and out features, as one TP rank holds them,
    to be multiples of 16 (services/trainer/model/fp8_linear.py)."""
    split, whole = _attention_widths(m)
    if m.first_k_dense:
        split["`model.ffn_hidden_size`"] = m.ffn_hidden_size
    if m.shared_expert_ffn_hidden_size:
        split["`model.shared_expert_ffn_hidden_size`"] = m.shared_expert_ffn_hidden_size
    fix = "change the sizes or set model.fp8=''"
    for name, width in split.items():
        _check(width % (16 * tp) == 0,
               f"`model.fp8={m.fp8}` runs the dense linears in FP8 (Transformer Engine), which needs {name} = {width} "
               f"/ `parallel.tp={tp}` to be a multiple of 16; {fix}")
    for name, width in whole.items():
        _check(width % 16 == 0, f"`model.fp8={m.fp8}` runs the dense linears in FP8 (Transformer Engine), which "
                                f"needs {name} = {width} (whole on every TP rank) to be a multiple of 16; {fix}")


def _attention_widths(m: ModelConfig) -> tuple[dict[str, int], dict[str, int]]:
    """The attention projections' widths: (those split over TP, those whole on every TP rank: MLA's latents)."""
    if m.attention == "gqa":
        return {"`model.num_heads` x head dim (the q/o projections)": m.num_heads * m.kv_channels,
                "`model.num_kv_heads` x head dim (the k/v projections)": m.num_kv_heads * m.kv_channels}, {}
    heads = "`model.num_heads` x "
    split = {f"{heads}(qk_nope_head_dim + qk_rope_head_dim) (q_proj / q_b_proj)": m.num_heads * m.qk_head_dim,
             f"{heads}(qk_nope_head_dim + v_head_dim) (kv_b_proj)": m.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
             f"{heads}v_head_dim (o_proj)": m.num_heads * m.v_head_dim}
    whole = {"`model.kv_lora_rank` (kv_b_proj's input)": m.kv_lora_rank,
             "`model.kv_lora_rank` + `model.qk_rope_head_dim` (kv_a_proj_with_mqa)": m.kv_lora_rank + m.qk_rope_head_dim}
    if m.q_lora_rank:
        whole["`model.q_lora_rank` (q_a_proj, q_b_proj)"] = m.q_lora_rank
    return split, whole


def _check_balancing(m: ModelConfig, p: ParallelConfig) -> None:
    """The global aux loss and pad-to-capacity: what they cannot run with (router.py, dispatcher.py)."""
    dynamic_cp = len(set(p.cp_sizes) | {p.cp}) > 1
    if m.aux_loss_type == "global" and m.aux_loss_coeff > 0:
        _check(not dynamic_cp, f"`model.aux_loss_type=global` sums each micro-batch's expert counts over the "
                               f"data-parallel replicas pass by pass, which dynamic CP (`parallel.cp_sizes="
                               f"{p.cp_sizes}`) does not keep in step; use aux_loss_type=micro_batch or drop cp_sizes")
    if not m.pad_to_capacity:
        return
    _check(m.capacity_factor > 0, "`model.pad_to_capacity=true` pads every expert to its capacity, which needs "
                                  f"`model.capacity_factor` > 0 (got {m.capacity_factor}); set one or drop "
                                  "pad_to_capacity")
    if p.ep * p.etp > 1:
        _check(p.dispatcher == "alltoall", f"`model.pad_to_capacity` is implemented by the all-to-all dispatcher, "
                                           f"not `parallel.dispatcher={p.dispatcher}`; use parallel.dispatcher="
                                           "alltoall or drop pad_to_capacity")
        _check(not dynamic_cp, f"`model.pad_to_capacity` under `parallel.ep={p.ep}`/`etp={p.etp}` sizes the "
                               "all-to-all from this rank's capacity, assuming every EP peer routes as many tokens, "
                               f"which dynamic CP (`parallel.cp_sizes={p.cp_sizes}`) breaks; drop cp_sizes or "
                               "pad_to_capacity")


def _check_mtp(cfg: Config) -> None:
    """Multi-token prediction (services/trainer/model/mtp.py) and what it does not run with."""
    m = cfg.model
    _check(m.mtp_num_layers >= 0, f"`model.mtp_num_layers={m.mtp_num_layers}` must be >= 0 (0: off)")
    _check(m.mtp_loss_coeff >= 0, f"`model.mtp_loss_coeff={m.mtp_loss_coeff}` must be >= 0")
    if not m.mtp_num_layers:
        return
    _check(not cfg.rl.enabled, f"`model.mtp_num_layers={m.mtp_num_layers}` trains extra prediction depths that RL "
                               f"neither samples from nor scores: set model.mtp_num_layers=0 for `rl.enabled`")


def _check_rollout(rl: RLConfig) -> None:
    """The rollout workers' sampling parameters (services/rl_rollout/sampling.py) and engine sizes, refused here rather
    than when a worker starts: `foldmoe train` then fails before any process does."""
    _check(rl.temperature >= 0, f"`rl.temperature={rl.temperature}` must be >= 0 (0: greedy)")
    _check(rl.eval_interval >= 0, f"`rl.eval_interval={rl.eval_interval}` must be >= 0 (0: no evaluation)")
    _check(rl.eval_prompts >= 1, f"`rl.eval_prompts={rl.eval_prompts}` must be at least 1")
    _check(0 < rl.top_p <= 1, f"`rl.top_p={rl.top_p}` must be in (0, 1] (1: off)")
    _check(rl.top_k >= 0, f"`rl.top_k={rl.top_k}` must be >= 0 (0: off)")
    _check(rl.max_new_tokens >= 1, f"`rl.max_new_tokens={rl.max_new_tokens}` must be at least 1")
    _check(all(rl.stop), f"`rl.stop={rl.stop}` has an empty string, which would end every completion at its first "
                         "token: remove it")
    for name in ("max_batch", "prefill_tokens", "prompts_per_batch", "max_queued_groups"):
        _check(getattr(rl, name) >= 1, f"`rl.{name}={getattr(rl, name)}` must be at least 1")
    _check(rl.max_seq_len > rl.max_new_tokens, f"`rl.max_seq_len={rl.max_seq_len}` (cache positions per sequence) "
                                               f"leaves no room for a prompt before `rl.max_new_tokens="
                                               f"{rl.max_new_tokens}` completion tokens: raise it")


def _check_eval(cfg: Config) -> None:
    """The held-out evaluation: documents held out only when some evaluation reads them, and not in an RL run (whose
    dataloader packs trajectories, not a corpus)."""
    d, interval = cfg.data, cfg.run.eval_interval
    _check(interval >= 0, f"`run.eval_interval` must be >= 0 (0: no evaluation), got {interval}")
    _check(0 <= d.eval_fraction < 1, f"`data.eval_fraction={d.eval_fraction}` must be in [0, 1) (the share of each "
                                     "dataset's documents held out for evaluation)")
    _check(d.eval_micro_batches >= 1, f"`data.eval_micro_batches` must be at least 1, got {d.eval_micro_batches}")
    _check(not (interval and cfg.rl.enabled), f"`run.eval_interval={interval}` evaluates held-out corpus documents, "
                                              "but an RL run (`rl.enabled`) trains on rollouts: set "
                                              "run.eval_interval=0")
    _check(not interval or d.eval_fraction > 0 or d.eval_corpus,
           f"`run.eval_interval={interval}` evaluates documents held out of training: set `data.eval_fraction` "
           "(e.g. 0.01) or `data.eval_corpus` (a validation split)")
    _check(not (d.eval_fraction and d.eval_corpus), f"`data.eval_fraction={d.eval_fraction}` holds documents out for "
                                                    f"an evaluation that reads `data.eval_corpus` instead: set one")
    _check(interval or not d.eval_fraction, f"`data.eval_fraction={d.eval_fraction}` holds documents out of training "
                                            "that no evaluation reads: set `run.eval_interval` or data.eval_fraction=0")
    _check(interval or not d.eval_corpus, f"`data.eval_corpus` is read by the evaluation only: set "
                                          "`run.eval_interval` or leave it empty")


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Reject impossible values; with `world_size`, also the parallel layout."""
    m, p, d, o = cfg.model, cfg.parallel, cfg.data, cfg.optimizer
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "num_experts", "top_k"):
        _check(getattr(m, name) > 0, f"`model.{name}` must be positive, got {getattr(m, name)}")
    _check_attention(m)
    _check(m.top_k <= m.num_experts, f"`model.top_k={m.top_k}` exceeds `model.num_experts={m.num_experts}`")
    _check(0 <= m.first_k_dense <= m.num_layers,
           f"`model.first_k_dense={m.first_k_dense}` must be within [0, model.num_layers={m.num_layers}]")
    if m.num_groups:
        _check(m.num_experts % m.num_groups == 0,
               f"`model.num_experts={m.num_experts}` is not divisible by `model.num_groups={m.num_groups}`")
        _check(0 < m.topk_groups <= m.num_groups,
               f"`model.topk_groups={m.topk_groups}` must be in [1, model.num_groups={m.num_groups}]")
        per_group = m.num_experts // m.num_groups
        _check(m.topk_groups * per_group >= m.top_k,
               f"`model.topk_groups={m.topk_groups}` groups of {per_group} experts cannot hold `model.top_k={m.top_k}`")
    _check(m.capacity_factor >= 0, f"`model.capacity_factor` must be >= 0, got {m.capacity_factor}")
    _check(not m.shared_expert_gate or m.shared_expert_ffn_hidden_size > 0,
           "`model.shared_expert_gate` gates the shared expert, but `model.shared_expert_ffn_hidden_size=0` (none): "
           "set its width or drop the gate")
    _check_balancing(m, p)
    _check_mtp(cfg)
    for name in ("norm_eps", "rope_theta"):
        _check(getattr(m, name) > 0, f"`model.{name}={getattr(m, name)}` must be positive")
    _check_choices("model.moe_kernels", m.moe_kernels,
                   ("permutation", "activation", "router", "cross_entropy"))
    _check_choices("model.recompute", m.recompute,
                   ("norm", "attn_core", "moe_act", "moe_fc1", "moe_dispatch", "moe", "layer"))
    _check("moe_dispatch" not in m.recompute or p.ep * p.etp == 1,
           f"`model.recompute` has 'moe_dispatch', which rebuilds the dispatched rows locally, but "
           f"`parallel.ep={p.ep}`, `parallel.etp={p.etp}` move them between ranks (it would repeat the all-to-all in "
           "backward); use 'moe' or drop it")
    if m.fp8:
        _check(m.hidden_size % 16 == 0 and m.moe_ffn_hidden_size % (16 * p.etp) == 0,
               f"`model.fp8={m.fp8}` needs `model.hidden_size={m.hidden_size}` and `model.moe_ffn_hidden_size="
               f"{m.moe_ffn_hidden_size}` / `parallel.etp={p.etp}` to be multiples of 16 (16-byte e4m3 rows); "
               "change the sizes or set model.fp8=''")
        _check_fp8_dense_widths(m, p.tp)
    _check_choices("model.offload", m.offload, ("attn", "moe", "layer"))
    for outer, inner in (("layer", ("norm", "attn_core", "moe_act", "moe_fc1", "moe_dispatch", "moe")),
                         ("moe", ("moe_act", "moe_fc1", "moe_dispatch"))):
        redundant = [name for name in inner if outer in m.recompute and name in m.recompute]
        _check(not redundant, f"`model.recompute` has {outer!r}, which already recomputes {redundant}: drop them")
    for key, ids, policy in (("recompute", m.recompute_layers, m.recompute), ("offload", m.offload_layers, m.offload)):
        bad = sorted({i for i in ids if not 0 <= i < m.num_layers})
        _check(not bad, f"`model.{key}_layers` names layers {bad}, outside 0..{m.num_layers - 1} (`model.num_layers="
                        f"{m.num_layers}`)")
        _check(len(set(ids)) == len(ids), f"`model.{key}_layers={ids}` lists a layer twice")
        _check(not ids or policy, f"`model.{key}_layers={ids}` selects layers for `model.{key}`, which is empty: "
                                  f"set `model.{key}` (e.g. {'[moe]' if key == 'recompute' else '[attn]'}) or drop it")
    _check(d.seq_len > 1 and d.micro_batch_size > 0 and d.grad_accum > 0,
           "`data.seq_len` must be > 1 and `data.micro_batch_size`, `data.grad_accum` positive")
    _check(d.packing_window >= 1, f"`data.packing_window={d.packing_window}` must be at least 1 (documents packed "
                                  "together)")
    _check(o.decay_steps >= 0, f"`optimizer.decay_steps` must be >= 0, got {o.decay_steps}")
    _check(not o.decay_steps or o.decay == "wsd", f"`optimizer.decay_steps={o.decay_steps}` sets the final decay of "
                                                  f"`optimizer.decay=wsd`, not of {o.decay!r}: set decay=wsd or drop it")
    _check(o.decay_steps <= max(cfg.run.steps - o.warmup_steps, 0),
           f"`optimizer.decay_steps={o.decay_steps}` exceeds the {max(cfg.run.steps - o.warmup_steps, 0)} steps after "
           f"warmup (run.steps={cfg.run.steps}, optimizer.warmup_steps={o.warmup_steps})")
    _check(o.lr > 0 and 0 <= o.min_lr <= o.lr,
           f"need `optimizer.lr` > 0 and 0 <= `optimizer.min_lr` <= `optimizer.lr` (got lr={o.lr}, min_lr={o.min_lr})")
    for name in ("beta1", "beta2"):
        _check(0 <= getattr(o, name) < 1, f"`optimizer.{name}={getattr(o, name)}` must be in [0, 1)")
    _check(o.eps > 0, f"`optimizer.eps={o.eps}` must be positive (it keeps Adam's denominator off zero)")
    _check(o.weight_decay >= 0, f"`optimizer.weight_decay={o.weight_decay}` must be >= 0")
    _check(o.clip_grad >= 0, f"`optimizer.clip_grad={o.clip_grad}` must be >= 0 (0: no clipping)")
    _check(o.param_dtype == "fp32" or cfg.run.dtype == "bf16",
           "`optimizer.param_dtype=bf16` computes under bf16 autocast: it needs `run.dtype=bf16`")
    _check(o.moment_dtype == "fp32" or o.param_dtype == "bf16",
           f"`optimizer.moment_dtype={o.moment_dtype}` needs `optimizer.param_dtype=bf16` (the fp32-parameter "
           "optimizer is torch's AdamW, which keeps its moments in the parameters' dtype)")
    _check(cfg.run.steps > 0, f"`run.steps` must be positive, got {cfg.run.steps}")
    _check(cfg.run.nproc >= 1, f"`run.nproc` must be at least 1 trainer rank, got {cfg.run.nproc}")
    _check(cfg.run.max_restarts >= 0, f"`run.max_restarts` must be >= 0, got {cfg.run.max_restarts}")
    ps = cfg.run.profile_steps
    _check(not ps or len(ps) == 2 and 1 <= ps[0] <= ps[1] <= cfg.run.steps,
           f"`run.profile_steps={ps}` must be [first, last] with 1 <= first <= last <= run.steps={cfg.run.steps}, or []")
    _check(d.replicas >= 1, f"`data.replicas` must be at least 1, got {d.replicas}")
    _check(1 <= d.prefetch <= MAX_PREFETCH, f"`data.prefetch` must be in [1, {MAX_PREFETCH}] (micro-batches in flight "
           f"per rank; the dataloader holds a client to {MAX_PREFETCH}), got {d.prefetch}")
    _check_eval(cfg)
    c = cfg.checkpoint
    _check(c.interval >= 0, f"`checkpoint.interval` must be >= 0 (0: save only at the end), got {c.interval}")
    _check(c.keep_last >= 0, f"`checkpoint.keep_last` must be >= 0 (0: keep every checkpoint), got {c.keep_last}")
    _check(c.host_buffers >= 1, f"`checkpoint.host_buffers` must be at least 1, got {c.host_buffers}")
    _check_rollout(cfg.rl)
    for name in ("tp", "cp", "pp", "ep", "etp"):
        _check(getattr(p, name) > 0, f"`parallel.{name}` must be positive, got {getattr(p, name)}")
    _check(m.num_experts % p.ep == 0, f"`parallel.ep={p.ep}` does not divide `model.num_experts={m.num_experts}`")
    _check(m.num_heads % p.tp == 0, f"`parallel.tp={p.tp}` does not divide `model.num_heads={m.num_heads}`")
    _check(m.attention == "mla" or m.num_kv_heads % p.tp == 0,
           f"`parallel.tp={p.tp}` does not divide `model.num_kv_heads={m.num_kv_heads}`")
    _check(m.vocab_size % p.tp == 0, f"`parallel.tp={p.tp}` does not divide `model.vocab_size={m.vocab_size}`")
    _check(m.ffn_hidden_size % p.tp == 0, f"`parallel.tp={p.tp}` does not divide `model.ffn_hidden_size`")
    _check(m.moe_ffn_hidden_size % p.etp == 0,
           f"`parallel.etp={p.etp}` does not divide `model.moe_ffn_hidden_size={m.moe_ffn_hidden_size}`")
    _check(p.pp <= m.num_layers, f"`parallel.pp={p.pp}` exceeds `model.num_layers={m.num_layers}`")
    _check(p.pp_virtual >= 1, f"`parallel.pp_virtual={p.pp_virtual}` must be at least 1 model chunk per pipeline "
                              "rank (1: plain 1F1B)")
    _check(p.pp_virtual == 1 or p.pp > 1, f"`parallel.pp_virtual={p.pp_virtual}` interleaves model chunks over "
                                          "pipeline ranks: it needs `parallel.pp` > 1; set parallel.pp or "
                                          "parallel.pp_virtual=1")
    chunks = p.pp * p.pp_virtual
    _check(chunks <= m.num_layers, f"`parallel.pp={p.pp}` x `parallel.pp_virtual={p.pp_virtual}` = {chunks} model "
                                   f"chunks exceed `model.num_layers={m.num_layers}` (each chunk needs a layer); "
                                   "lower parallel.pp_virtual")
    if p.ep_overlap:
        _check(p.ep > 1, f"`parallel.ep_overlap` pairs micro-batches to hide the expert all-to-all: it needs "
                         f"`parallel.ep` > 1 (got {p.ep}); set parallel.ep or parallel.ep_overlap=false")
        # (RL steps have as many micro-batches as the dataloader packs, whatever data.grad_accum says)
        _check(d.grad_accum >= 2 or cfg.rl.enabled,
               f"`parallel.ep_overlap` pairs micro-batches: it needs `data.grad_accum` >= 2 micro-batches per step "
               f"(got {d.grad_accum})")
        # These wrap a MoE layer's or block's whole forward, which the interleaved (paused and resumed) forward bypasses.
        wrapped = [f"recompute {n!r}" for n in m.recompute if n in ("norm", "moe", "layer")] + [
            f"offload {n!r}" for n in m.offload if n in ("moe", "layer")]
        _check(not wrapped, f"`parallel.ep_overlap` cannot be combined with {', '.join(wrapped)}: they wrap the whole "
                            "MoE layer or block forward, which the interleaved forward pauses inside; use recompute "
                            "'attn_core'/'moe_act' and offload 'attn', or set parallel.ep_overlap=false")
    if p.pp_layers:
        per = "stage" if p.pp_virtual == 1 else f"model chunk (pp*pp_virtual = {p.pp}*{p.pp_virtual})"
        _check(len(p.pp_layers) == chunks and sum(p.pp_layers) == m.num_layers and min(p.pp_layers) >= 1,
               f"`parallel.pp_layers={p.pp_layers}` must have one positive entry per {per}, {chunks} in all, summing "
               f"to num_layers={m.num_layers}")
    if world_size is not None:
        attn = p.pp * p.tp * p.cp
        moe = p.pp * p.etp * p.ep
        _check(world_size % attn == 0,
               f"world size {world_size} is not divisible by pp*tp*cp = {p.pp}*{p.tp}*{p.cp} = {attn}")
        _check(world_size % moe == 0,
               f"world size {world_size} is not divisible by pp*etp*ep = {p.pp}*{p.etp}*{p.ep} = {moe}")
        dp = world_size // attn
        _check(not cfg.run.eval_interval or d.eval_micro_batches % dp == 0,
               f"`data.eval_micro_batches={d.eval_micro_batches}` must be a multiple of the data-parallel size {dp} "
               f"(world size {world_size} / pp*tp*cp {attn}): every dp rank evaluates as many micro-batches")
