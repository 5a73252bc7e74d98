"""The rollout engine: the KV-cached, continuously batched generation computes exactly what the model's full forward pass
computes, and honours every sampling and stop setting."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import services.rl_rollout.engine as engine_module
from services.common.tokenizer import load_tokenizer
from services.rl_rollout.engine import Engine, EngineError, Request
from services.rl_rollout.kv_cache import CachedDecoder
from services.rl_rollout.sampling import SamplingParams, sample, truncation_of
from tests.rl_helpers import full_forward, tiny_model

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
TOK = load_tokenizer("byte")
PROMPTS = ["12+34=", "Hello, world", "a", "The quick brown fox jumps over", "x*y"]


def _greedy(max_tokens=12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_at_eos=False, **kw)


def _requests(params: SamplingParams, prompts=PROMPTS) -> list[Request]:
    return [Request(TOK.encode(p), params, tag=i) for i, p in enumerate(prompts)]


def _model(device, **overrides):
    # bf16 on CUDA is the rollout dtype there; fp32 on CPU lets the comparison be exact.
    return tiny_model(seed=3, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32, **overrides)


MLA = dict(attention="mla", kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=8)
ATTENTION = {"plain": {}, "qk_norm": {"qk_norm": True}, "mla": MLA,
             # YaRN scales the queries in `qkv`: cached decoding must score them as the packed forward does
             "mla_q_lora_yarn": {**MLA, "q_lora_rank": 32, "rope_scaling_factor": 4.0, "rope_original_max_position": 16,
                                 "rope_mscale_all_dim": 1.0}}


def _assert_greedy_full_forward(model, c, device) -> None:
    """Completion `c` (greedy) is what the model's full forward over prompt + completion computes: tokens, log-probs
    and, on CPU, the routing recorded for replay."""
    seq = c.prompt_tokens + c.tokens
    logits, routing = full_forward(model, seq[:-1])
    P = len(c.prompt_tokens)
    pred = logits[P - 1:]
    lp = torch.log_softmax(pred, dim=-1)
    chosen = torch.tensor(c.tokens)
    if device == "cpu":
        assert chosen.tolist() == pred.argmax(-1).tolist()
        torch.testing.assert_close(torch.tensor(c.logprobs), lp.gather(1, chosen[:, None]).squeeze(1),
                                   atol=1e-4, rtol=0)
        # The routing recorded for replay is the routing of the full forward, token by token and layer by layer.
        assert torch.equal(c.routing.sort(-1).values, routing.sort(-1).values)
    else:
        # bf16 kernels differ between the cached and the packed path: a greedy pick may only differ from the full
        # forward's argmax where the two best logits are within bf16 rounding of each other.
        margin = pred.max(-1).values - pred.gather(1, chosen[:, None]).squeeze(1)
        assert float(margin.max()) < 0.1
        torch.testing.assert_close(torch.tensor(c.logprobs), lp.gather(1, chosen[:, None]).squeeze(1),
                                   atol=0.1, rtol=0)
    assert c.routing.shape == (len(model.moe_layers()), len(seq) - 1, model.cfg.top_k)


@pytest.mark.parametrize("attention", list(ATTENTION))
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_cached_decoding_matches_full_forward_token_by_token(device, attention):
    """GQA and Multi-head Latent Attention alike: MLA caches the latent and decodes with kv_b_proj absorbed."""
    model = _model(device, **ATTENTION[attention])
    engine = Engine(model, TOK, max_batch=3, max_seq_len=64)
    for c in engine.generate(_requests(_greedy())):
        _assert_greedy_full_forward(model, c, device)


@pytest.mark.parametrize("attention", ["plain", "mla"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_prompt_a_running_slot_holds_is_copied_from_its_cache_not_prefilled_again(device, attention, monkeypatch):
    """A group's samples share their prompt: a joining prompt that a running slot holds (one joining with it, or one
    still decoding from an earlier join) is copied from that slot's cache, its last token fed by a decode step; every
    completion is still the full forward's, routing of the shared prompt tokens included."""
    prefilled, copied = [], []
    prefill, copy_prompts = CachedDecoder.prefill, CachedDecoder.copy_prompts
    monkeypatch.setattr(CachedDecoder, "prefill",
                        lambda self, prompts, slots, starts=None: prefilled.extend(TOK.decode(p) for p in prompts)
                        or prefill(self, prompts, slots, starts))
    monkeypatch.setattr(CachedDecoder, "copy_prompts",
                        lambda self, src, dst, length: copied.append((src, dst)) or copy_prompts(self, src, dst, length))
    model = _model(device, **ATTENTION[attention])
    # Together: the first join prefills "12+34=" once and copies it into two slots
    engine = Engine(model, TOK, max_batch=4, max_seq_len=64)
    together = engine.generate(_requests(_greedy(8), ["12+34=", "12+34=", "x*y", "12+34="]))
    assert prefilled == ["12+34=", "x*y"] and copied == [([0, 0], [1, 3])]
    # Later: "Hello, world" keeps decoding in slot 0 while the other requests take slot 1 in turn, copying from it
    prefilled.clear(), copied.clear()
    engine = Engine(model, TOK, max_batch=2, max_seq_len=64)
    params = [_greedy(14), _greedy(2), _greedy(3), _greedy(2), _greedy(4)]
    prompts = ["Hello, world", "x*y", "Hello, world", "a", "Hello, world"]
    later = engine.generate([Request(TOK.encode(p), q, tag=i) for i, (p, q) in enumerate(zip(prompts, params))])
    assert prefilled == ["Hello, world", "x*y", "a"] and copied == [([0], [1]), ([0], [1])]
    assert [len(c.tokens) for c in later] == [q.max_tokens for q in params]
    for c in together + later:
        _assert_greedy_full_forward(model, c, device)
    # a shared prompt's completions are the holder's, token for token (greedy)
    assert together[0].tokens == together[1].tokens == together[3].tokens
    assert later[2].tokens == later[0].tokens[:3] and later[4].tokens == later[0].tokens[:4]


SYSTEM = "You are a careful calculator. "  # 30 tokens (bytes): a prefix prompts share, longer than PREFIX_BLOCK


@pytest.mark.parametrize("attention", ["plain", "mla"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_prefix_a_running_slot_holds_is_copied_and_only_the_rest_prefilled(device, attention, monkeypatch):
    """Different prompts sharing a prefix (a system prompt): a joining prompt copies the longest prefix a running
    slot's prompt shares with it, from a slot joining with it or one still decoding from an earlier join, and prefills
    only the rest; every completion is still the full forward's (routing of the copied positions included)."""
    assert engine_module.PREFIX_BLOCK <= 20 < len(TOK.encode(SYSTEM))
    pieces, copied = [], []
    prefill, copy_prompts = CachedDecoder.prefill, CachedDecoder.copy_prompts
    monkeypatch.setattr(CachedDecoder, "prefill", lambda self, prompts, slots, starts=None: pieces.append(
        list(zip(starts or [0] * len(prompts), map(len, prompts)))) or prefill(self, prompts, slots, starts))
    monkeypatch.setattr(CachedDecoder, "copy_prompts", lambda self, src, dst, length: copied.append(
        (src, dst, length)) or copy_prompts(self, src, dst, length))
    model = _model(device, **ATTENTION[attention])
    engine = Engine(model, TOK, max_batch=6, max_seq_len=64)
    prompts = [SYSTEM + "12+34=", SYSTEM + "x*y", SYSTEM + "x*y", "a", SYSTEM[:20] + "zzz", SYSTEM + "12+34="]
    together = engine.generate(_requests(_greedy(6), prompts))
    # Slots 0 and 3 prefilled. From slot 0: slot 1 copies the 30 system tokens, slot 4 the 20 it shares (both then
    # prefill their rest), slot 5 all but the last token of its prompt (a decode step feeds that one). Slot 2 holds
    # slot 1's prompt: it copies all but its last token from slot 1 once slot 1's rest is prefilled.
    assert pieces == [[(0, 36), (0, 1)], [(30, 3), (20, 3)]]
    assert copied == [([0, 0, 0], [1, 4, 5], 35), ([1], [2], 32)]
    assert engine.prompt_tokens_prefilled == 36 + 1 + 3 + 3 and engine.prompt_tokens_shared == 30 + 20 + 35 + 32
    # A later join: "a" finishes first and the last prompt takes its slot while slots 0 and 1 still decode; it copies
    # the 46 tokens it shares with slot 1's prompt (slot 0 holds only 30 of them) and prefills its last 2
    pieces.clear(), copied.clear()
    engine = Engine(model, TOK, max_batch=3, max_seq_len=64)
    params = [_greedy(14), _greedy(10), _greedy(2), _greedy(3)]
    prompts = [SYSTEM + "Hello", SYSTEM + "x*y=" + "7" * 12, "a", SYSTEM + "x*y=" + "7" * 12 + "89"]
    later = engine.generate([Request(TOK.encode(p), q, tag=i) for i, (p, q) in enumerate(zip(prompts, params))])
    assert pieces == [[(0, 35), (0, 1)], [(30, 16)], [(46, 2)]]
    assert copied == [([0], [1], 30), ([1], [2], 46)]
    for c in together + later:
        _assert_greedy_full_forward(model, c, device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefill_and_prompt_copies_are_queued_without_waiting_for_the_device():
    """The host runs ahead of the device: a prefill (whole, or continuing a copied prefix) and a copy take their
    inputs through pinned memory; a copy from pageable memory would wait for every step queued before it."""
    model = _model("cuda")
    cache = CachedDecoder(model, 4, 64, cuda_graphs=False)
    prompts = [TOK.encode(SYSTEM + "12+34="), TOK.encode("a")]
    cache.prefill(prompts, [0, 1])  # lazy initialisations first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cache.prefill(prompts, [0, 1])
        cache.copy_prompts([0], [2], 30)
        cache.prefill([TOK.encode("x*y")], [2], [30])
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_prefix_lookup_counts_matching_tokens_and_a_hash_only_names_a_candidate():
    held = engine_module._Running(0, Request(list(range(40))))
    prefixes = engine_module._Prefixes()
    prefixes.add(3, held)
    # 35 tokens in common: two blocks' keys match, the rest is counted token by token
    assert prefixes.longest(engine_module._Running(1, Request(list(range(35)) + [99, 98]))) == (3, 35)
    assert prefixes.longest(engine_module._Running(1, Request(list(range(60))))) == (3, 40)  # past the held prompt
    assert prefixes.longest(engine_module._Running(1, Request([5] + list(range(1, 40))))) == (None, 0)
    forged = engine_module._Running(2, Request([7] * 3 + list(range(3, 40))))
    forged.keys = held.keys  # equal hashes, unequal tokens: the count starts over
    assert prefixes.longest(forged) == (3, 0)
    prefixes.remove(3)
    assert prefixes.longest(held) == (None, 0)


@pytest.mark.parametrize("attention", ["plain", "mla"])
def test_prompts_are_prefilled_in_forwards_of_at_most_prefill_tokens_a_longer_one_in_chunks(attention, monkeypatch):
    """The prefill budget bounds each packed forward's tokens: forwards are filled up to it, and a prompt that does not
    fit the rest of one continues in the next, attending to its earlier chunks through the cache; generation is
    unchanged (the full forward's tokens, log-probs and routing)."""
    pieces = []
    prefill = CachedDecoder.prefill
    monkeypatch.setattr(CachedDecoder, "prefill", lambda self, prompts, slots, starts=None: pieces.append(
        list(zip(starts or [0] * len(prompts), map(len, prompts)))) or prefill(self, prompts, slots, starts))
    model = _model("cpu", **ATTENTION[attention])
    got = Engine(model, TOK, max_batch=5, max_seq_len=64, prefill_tokens=13).generate(_requests(_greedy(6)))
    # PROMPTS' lengths in order, 6, 12, 1, 30 and 3, as (start, length) pieces of 13-token forwards
    assert pieces == [[(0, 6), (0, 7)], [(7, 5), (0, 1), (0, 7)], [(7, 13)], [(20, 10), (0, 3)]]
    for c in got:
        _assert_greedy_full_forward(model, c, "cpu")
    with pytest.raises(EngineError, match="prefill_tokens must be at least 1"):
        Engine(model, TOK, prefill_tokens=0)


@pytest.mark.parametrize("attention", ["plain", "mla"])
def test_any_mix_of_requests_generates_what_each_request_generates_alone(attention):
    """Continuous batching, shared prompts and prefixes, chunked prefill, stop strings and EOS together, on random mixes
    (seeded):
    every completion (greedy) equals the one the request gets alone in a one-slot engine, tokens, finish reason,
    log-probs and routing."""
    import random

    model = _model("cpu", **ATTENTION[attention])
    prompts = PROMPTS + [SYSTEM + p for p in PROMPTS[:3]] + [SYSTEM[:20] + "q"]  # shared prefixes of 20 and 30 tokens
    rng = random.Random(0)
    for _ in range(6):
        requests = []
        for i in range(rng.randint(4, 14)):
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 9), stop_at_eos=rng.random() < 0.5,
                                    stop=(rng.choice(["1", "e", " "]),) if rng.random() < 0.3 else ())
            requests.append(Request(TOK.encode(rng.choice(prompts)), params, tag=i))
        engine = Engine(model, TOK, max_batch=rng.randint(1, 5), max_seq_len=64,
                        prefill_tokens=rng.choice([3, 8, 17, 100]))
        for request, c in zip(requests, engine.generate(requests)):
            alone = Engine(model, TOK, max_batch=1, max_seq_len=64).generate([request])[0]
            assert (c.tokens, c.finish_reason) == (alone.tokens, alone.finish_reason)
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(alone.logprobs), atol=1e-4, rtol=0)
            assert torch.equal(c.routing.sort(-1).values, alone.routing.sort(-1).values)


def test_mla_cache_holds_the_latent_and_rope_key_not_per_head_keys_and_values():
    model = _model("cpu", **MLA)
    cfg = model.cfg
    decoder = CachedDecoder(model, slots=3, max_len=64)
    per_token = cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4  # fp32
    assert decoder.cache_bytes == (3 + 1) * 64 * per_token  # and the padding rows' spare slot
    expanded = cfg.num_layers * cfg.num_heads * (cfg.qk_head_dim + cfg.value_head_dim) * 4
    assert per_token < expanded  # 24 + 8 against 4 heads x (24 + 8); DeepSeek-V3: 576 against 128 x (192 + 128)


def test_a_model_with_mtp_depths_generates_with_its_main_layers_only():
    plain, with_mtp = _model("cpu"), _model("cpu", mtp_num_layers=1)  # the same main weights
    got = Engine(with_mtp, TOK, max_batch=3, max_seq_len=64).generate(_requests(_greedy()))
    want = Engine(plain, TOK, max_batch=3, max_seq_len=64).generate(_requests(_greedy()))
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert all(torch.equal(a.routing, b.routing) for a, b in zip(got, want))


def test_continuous_batching_gives_the_same_completions_as_one_big_batch():
    model = _model("cpu")
    reqs = [Request(r.prompt_tokens, _greedy(max_tokens=4 + 3 * i), tag=i) for i, r in enumerate(_requests(_greedy()))]
    one_batch = Engine(model, TOK, max_batch=8, max_seq_len=64).generate(reqs)
    finished = []
    trickle = Engine(model, TOK, max_batch=2, max_seq_len=64).generate(reqs, on_complete=finished.append)
    assert [c.tokens for c in trickle] == [c.tokens for c in one_batch]
    assert [c.tag for c in trickle] == list(range(len(reqs)))
    assert [len(c.tokens) for c in trickle] == [4 + 3 * i for i in range(len(reqs))]
    # With two slots, the short early requests finish before the later ones have even started.
    assert [c.tag for c in finished][:2] == [0, 1]
    for a, b in zip(trickle, one_batch):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
        assert torch.equal(a.routing.sort(-1).values, b.routing.sort(-1).values)


def test_stop_strings_end_the_completion_after_the_stop_text():
    model = _model("cpu")
    engine = Engine(model, TOK, max_batch=4, max_seq_len=64)
    free = engine.generate(_requests(_greedy(max_tokens=20)))
    # Stop on a character the free-running completion produces, and check the cut happens right after it.
    target = next(c for c in free if len(set(c.text)) > 2)
    stop_char = target.text[len(target.text) // 2]
    cut = target.text.index(stop_char) + 1
    stopped = engine.generate([Request(target.prompt_tokens, _greedy(max_tokens=20, stop=(stop_char,)))])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == target.text[:cut]
    assert stopped.routing.shape[1] == len(stopped.prompt_tokens) + len(stopped.tokens) - 1


def test_eos_ends_the_completion_and_is_kept_as_its_last_token():
    model = _model("cpu")
    free = Engine(model, TOK, max_batch=2, max_seq_len=64).generate(_requests(_greedy(), PROMPTS[:1]))[0]
    # Declare the third token the free-running completion produces to be EOS: generation must stop at its first use.
    eos = free.tokens[2]
    first = free.tokens.index(eos)
    tok = dataclasses.replace(TOK, eos_id=eos)
    c = Engine(model, tok, max_batch=2, max_seq_len=64).generate(
        [Request(free.prompt_tokens, SamplingParams(temperature=0.0, max_tokens=12))])[0]
    assert c.finish_reason == "eos" and c.tokens == free.tokens[:first + 1]
    assert c.routing.shape[1] == len(c.prompt_tokens) + first  # the EOS token is never fed back


def test_sequences_ending_on_eos_hand_their_slots_over_without_a_trace_in_the_next_ones():
    """The host runs a step behind the device: a sequence that samples EOS is fed once more before the host sees it,
    and a waiting prompt then takes its slot. That extra row must leave nothing behind: every completion (two slots,
    five prompts, most ending on EOS at different steps) is the full forward's greedy continuation cut at its first
    EOS, with the full forward's routing."""
    model = _model("cpu")
    free = Engine(model, TOK, max_batch=8, max_seq_len=64).generate(_requests(_greedy(max_tokens=10)))
    eos = collections.Counter(t for c in free for t in c.tokens[1:6]).most_common(1)[0][0]
    tok = dataclasses.replace(TOK, eos_id=eos)
    got = Engine(model, tok, max_batch=2, max_seq_len=64).generate(
        _requests(SamplingParams(temperature=0.0, max_tokens=10)))
    assert sum(c.finish_reason == "eos" for c in got) >= 2
    for c, f in zip(got, free):
        cut = f.tokens.index(eos) + 1 if eos in f.tokens else len(f.tokens)
        assert c.tokens == f.tokens[:cut]
        _, routing = full_forward(model, c.prompt_tokens + c.tokens[:-1])
        assert torch.equal(c.routing.sort(-1).values, routing.sort(-1).values)


def test_max_tokens_is_a_hard_limit():
    c = Engine(_model("cpu"), TOK, max_batch=2, max_seq_len=32).generate(
        [Request(TOK.encode("abc"), SamplingParams(temperature=1.0, max_tokens=5, stop_at_eos=False))])[0]
    assert c.finish_reason == "length" and len(c.tokens) == len(c.logprobs) == 5


def test_prompt_that_cannot_fit_the_cache_is_rejected_with_the_fix():
    engine = Engine(_model("cpu"), TOK, max_batch=2, max_seq_len=16)
    with pytest.raises(EngineError, match="rl.max_seq_len"):
        engine.generate([Request(TOK.encode("0123456789"), SamplingParams(max_tokens=8))])


def test_prompt_ids_outside_the_vocabulary_are_rejected_naming_the_tokenizer():
    model = _model("cpu")
    engine = Engine(model, TOK, max_batch=2, max_seq_len=16)
    for bad in ([1, model.cfg.vocab_size], [-1, 2]):
        with pytest.raises(EngineError, match="request 1's prompt holds token ids .* another tokenizer"):
            engine.generate([Request([1, 2], SamplingParams(max_tokens=2)), Request(bad, SamplingParams(max_tokens=2))])


def test_sampling_is_reproducible_from_the_seed_and_varies_across_seeds():
    model = _model("cpu")
    params = SamplingParams(temperature=1.0, max_tokens=10, stop_at_eos=False)
    runs = [[c.tokens for c in Engine(model, TOK, max_batch=4, max_seq_len=64, seed=s).generate(_requests(params))]
            for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_sampled_logprobs_are_under_the_temperature_scaled_distribution():
    model = _model("cpu")
    c = Engine(model, TOK, max_batch=2, max_seq_len=64, seed=5).generate(
        [Request(TOK.encode("Hello"), SamplingParams(temperature=0.7, max_tokens=6, stop_at_eos=False))])[0]
    logits, _ = full_forward(model, c.prompt_tokens + c.tokens[:-1])
    lp = torch.log_softmax(logits[len(c.prompt_tokens) - 1:] / 0.7, dim=-1)
    torch.testing.assert_close(torch.tensor(c.logprobs), lp.gather(1, torch.tensor(c.tokens)[:, None]).squeeze(1),
                               atol=1e-4, rtol=0)


def test_a_slot_samples_with_the_parameters_of_the_request_it_holds_now():
    """Requests with other temperatures take turns on two slots: each completion's log-probs are under its own
    temperature (greedy ones the argmax of the full forward), not those of the request its slot held before."""
    model = _model("cpu")
    temperatures = [0.0, 0.5, 0.0, 2.0, 0.0]
    reqs = [Request(TOK.encode(p), SamplingParams(temperature=t, max_tokens=5, stop_at_eos=False), tag=i)
            for i, (p, t) in enumerate(zip(PROMPTS, temperatures))]
    for c, t in zip(Engine(model, TOK, max_batch=2, max_seq_len=64, seed=1).generate(reqs), temperatures):
        logits, _ = full_forward(model, c.prompt_tokens + c.tokens[:-1])
        pred = logits[len(c.prompt_tokens) - 1:]
        if t == 0:
            assert c.tokens == pred.argmax(-1).tolist()
        lp = torch.log_softmax(pred / (t or 1.0), dim=-1).gather(1, torch.tensor(c.tokens)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(c.logprobs), lp, atol=1e-4, rtol=0)


def test_a_step_samples_through_truncation_exactly_when_one_of_its_own_rows_truncates(monkeypatch):
    """The truncation searches (top-k, top-p) run for a prefill or decode step only when a row of that step truncates
    that way: not for non-truncating prompts prefilled while a truncating sequence decodes, not for a decode step
    whose truncating sequences are joining or waiting for their last token to land, and no more once the truncating
    requests have finished. Truncating rows keep their truncation (top_k=1 and top_p=0.01 keep only the argmax)."""
    seen = []

    def spy(logits, params, truncation, generator=None):
        seen.append((truncation, (bool((params[1] > 0).any()), bool((params[2] < 1).any()))))
        return sample(logits, params, truncation, generator)

    monkeypatch.setattr(engine_module, "sample", spy)
    model = _model("cpu")
    plain = dict(temperature=1.0, stop_at_eos=False)
    params = [SamplingParams(top_k=1, max_tokens=6, **plain), SamplingParams(max_tokens=3, **plain),
              SamplingParams(max_tokens=14, **plain), SamplingParams(max_tokens=10, **plain),
              SamplingParams(top_p=0.01, max_tokens=2, **plain)]
    reqs = [Request(TOK.encode(p), q, tag=i) for i, (p, q) in enumerate(zip(PROMPTS, params))]
    got = Engine(model, TOK, max_batch=3, max_seq_len=64, seed=4).generate(reqs)
    assert [len(c.tokens) for c in got] == [q.max_tokens for q in params]
    assert [truncation for truncation, _ in seen] == [rows for _, rows in seen]
    assert any(k and not p for (k, p), _ in seen) and any(p and not k for (k, p), _ in seen)
    # The run holds untruncated steps while truncating sequences held slots, and after they finished
    last = max(i for i, (truncation, _) in enumerate(seen) if any(truncation))
    assert not all(any(truncation) for truncation, _ in seen[:last]) and last < len(seen) - 1
    for i in (0, 4):
        logits, _ = full_forward(model, got[i].prompt_tokens + got[i].tokens[:-1])
        assert got[i].tokens == logits[len(got[i].prompt_tokens) - 1:].argmax(-1).tolist()


def _sample(logits, params, gen):
    """`sample` over one row of parameters per logits row."""
    return sample(logits, torch.tensor([p.row for p in params]).T, truncation_of(params), gen)


def test_top_k_and_top_p_only_draw_from_the_kept_tokens():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[3.0, 2.9, 2.8, -5.0, -6.0]]).repeat(400, 1)
    k2, _ = _sample(logits, [SamplingParams(top_k=2)] * 400, gen)
    assert set(k2.tolist()) == {0, 1}
    # The three leading tokens hold ~99.9% of the mass: top_p=0.9 keeps exactly them (the third is needed to reach 0.9).
    p, _ = _sample(logits, [SamplingParams(top_p=0.9)] * 400, gen)
    assert set(p.tolist()) == {0, 1, 2}
    tiny_p, _ = _sample(logits[:50], [SamplingParams(top_p=0.01)] * 50, gen)
    assert set(tiny_p.tolist()) == {0}
    mixed, lps = _sample(logits[:2], [SamplingParams(temperature=0.0), SamplingParams(top_k=1)], gen)
    assert mixed.tolist() == [0, 0]
    torch.testing.assert_close(lps, torch.log_softmax(logits[:2], -1)[:, 0])


def test_a_model_without_moe_layers_generates_with_empty_routing():
    model = tiny_model(seed=8, first_k_dense=3)
    c = Engine(model, TOK, max_batch=2, max_seq_len=32).generate(_requests(_greedy(max_tokens=5), PROMPTS[:1]))[0]
    logits, _ = full_forward(model, c.prompt_tokens + c.tokens[:-1])
    assert c.tokens == logits[len(c.prompt_tokens) - 1:].argmax(-1).tolist()
    assert c.routing.shape == (0, len(c.prompt_tokens) + len(c.tokens) - 1, 0)


def test_a_decode_step_pads_to_its_bucket_without_touching_another_slot_or_changing_a_row():
    """Decode runs at fixed shapes (batch and span rounded up to powers of two): the padding rows write only the spare
    slot past the real ones, and each real row's logits and routing are what that row decodes alone."""
    model = _model("cpu")
    decoder = CachedDecoder(model, slots=8, max_len=64, cuda_graphs=False)
    prompts = [TOK.encode(p) for p in PROMPTS[:3]]
    decoder.prefill(prompts, [0, 3, 5])
    cache = [t.clone() for t in decoder.cache.tensors]
    tokens, slots, positions = [7, 8, 9], [0, 3, 5], [len(p) for p in prompts]
    by_slot = torch.zeros(9, dtype=torch.int64)
    by_slot[slots] = torch.tensor(tokens)
    logits, routing = decoder.decode(by_slot, slots, positions)  # batch 3 -> 4, span 13 -> 16
    assert set(decoder._steps) == {(4, 16)}
    for before, after in zip(cache, decoder.cache.tensors):
        changed = (before != after).flatten(2).any(-1).any(0).nonzero().flatten().tolist()  # slots written
        assert changed == [0, 3, 5, 8], changed  # the three rows' slots and the spare one (8)
    for i in range(3):  # each row alone: batch 1, its own span bucket; same cache contents
        for t, c in zip(decoder.cache.tensors, cache):
            t.copy_(c)
        alone, alone_routing = decoder.decode(by_slot, slots[i:i + 1], positions[i:i + 1])
        torch.testing.assert_close(alone[0], logits[i], atol=1e-5, rtol=0)
        assert torch.equal(alone_routing[:, 0].sort(-1).values, routing[:, i].sort(-1).values)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["plain", "mla"])
def test_decode_replayed_from_cuda_graphs_generates_what_eager_decode_generates(attention):
    """Greedy completions, log-probs and routing of graphed decoding against eager decoding of the same model, through
    continuous batching (batch buckets come and go), and again after new weights are loaded in place (the graphs read
    the parameters' storage)."""
    model = _model("cuda", **ATTENTION[attention])
    reqs = [Request(r.prompt_tokens, _greedy(max_tokens=4 + 5 * i), tag=i) for i, r in enumerate(_requests(_greedy()))]
    graphed = Engine(model, TOK, max_batch=4, max_seq_len=64)
    eager = Engine(model, TOK, max_batch=4, max_seq_len=64, cuda_graphs=False)
    assert graphed.cache.cuda_graphs and not eager.cache.cuda_graphs

    def same(a, b):
        assert [c.tokens for c in a] == [c.tokens for c in b]
        for x, y in zip(a, b):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=2e-2, rtol=0)
            assert torch.equal(x.routing.sort(-1).values, y.routing.sort(-1).values)

    same(graphed.generate(reqs), eager.generate(reqs))
    assert len(graphed.cache._steps) >= 3  # several (batch, span) shapes were captured
    new = _model("cuda", **ATTENTION[attention])
    new.load_state_dict({k: v * 1.5 if v.is_floating_point() else v for k, v in new.state_dict().items()})
    model.load_state_dict(new.state_dict())
    same(graphed.generate(reqs), eager.generate(reqs))
