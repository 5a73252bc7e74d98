"""Triton kernels for the MoE data path and the loss, each with a torch reference of the same signature.

The public function of each module dispatches: Triton on CUDA tensors, the torch reference on CPU tensors, and
Triton's CPU interpreter on CPU tensors when `TRITON_INTERPRET=1` is set at call time (how the tests exercise the
kernels on machines without a GPU).

    router        logits -> top-k experts, combine weights, load statistics
    permute       token order -> rows grouped by expert (+ device-side counts and offsets)
    swiglu_prob   expert activation with the routing probability folded in
    unpermute     expert order -> token order, weighted sum of each token's k copies
    cross_entropy output layer + cross-entropy over chunks of tokens, without [T, V] logits
    sample        the rollout's sampler: one token per row of logits by Gumbel-max, with its log-prob

Import from the modules (`from kernels.permute import permute`): the package re-exports nothing, so a module and
its function of the same name never shadow each other.
"""
