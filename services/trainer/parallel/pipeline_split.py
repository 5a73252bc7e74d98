"""Where the pipeline cuts the layers when `parallel.pp_layers` does not say: the split whose costliest model chunk
is cheapest, by each block's FLOPs per token (metrics.py) and the output layer's on the last chunk.

Why not an even split: the output layer sits on the last stage, and against a MoE block's *active* weights it is
large (Qwen3-30B-A3B: 311M weights against ~57M per block, ~4 blocks' FLOPs with attention counted). With every stage
holding as many blocks, the last one sets the pace: on two H100s, the 4-layer Qwen3-30B-A3B shape ran 299.8 ms per
step split [2, 2] and 278.1 ms split [3, 1] (bench/RESULTS.md). The first stage's embedding lookup costs no FLOPs and
is not counted. The price: earlier stages hold more blocks, hence more parameters and, under 1F1B, more activations.
"""

from __future__ import annotations

from services.common.config import ModelConfig
from services.trainer.metrics import layer_flops, mtp_flops, output_flops


def even_counts(num_layers: int, chunks: int) -> list[int]:
    """As even as possible, earlier chunks taking the extra layers."""
    base, extra = divmod(num_layers, chunks)
    return [base + (c < extra) for c in range(chunks)]


def balanced_counts(layer_costs: list[float], chunks: int, tail: float = 0.0) -> list[int]:
    """Layers per chunk (in order, each at least one) minimising the costliest chunk, the last chunk also paying
    `tail`; among those, the most even (least sum of squared chunk costs), earlier chunks taking more on a tie."""
    n = len(layer_costs)
    if not 1 <= chunks <= n:
        raise ValueError(f"{chunks} model chunks cannot each hold one of {n} layers")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)
    inf = (float("inf"), float("inf"))
    # best[k][i]: (costliest, sum of squares) of the first i layers in k chunks, and the start of the k-th chunk
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    start = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, chunks + 1):
        for i in range(k, n - (chunks - k) + 1):
            extra = tail if k == chunks else 0.0
            for j in range(i - 1, k - 2, -1):  # descending: on a tie the earlier chunks keep the larger share
                if best[k - 1][j] == inf:
                    continue
                cost = prefix[i] - prefix[j] + extra
                score = (max(best[k - 1][j][0], cost), best[k - 1][j][1] + cost * cost)
                if score < best[k][i]:
                    best[k][i], start[k][i] = score, j
    counts, i = [], n
    for k in range(chunks, 0, -1):
        counts.append(i - start[k][i])
        i = start[k][i]
    return counts[::-1]


def cost_balanced_counts(cfg: ModelConfig, chunks: int, seq_len: int) -> list[int]:
    """`balanced_counts` of `cfg`'s blocks, the output layer and the MTP depths on the last chunk."""
    costs = [layer_flops(cfg, i, seq_len) for i in range(cfg.num_layers)]
    return balanced_counts(costs, chunks, tail=output_flops(cfg) + mtp_flops(cfg, seq_len))
