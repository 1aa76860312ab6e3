import math

import pytest
import torch

from tokenloom.engine.sample.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    TokenLogprobs,
    apply_logits_processors,
)
from tokenloom.engine.sample.sampling_params import SamplingParams


def make_row(seq_id=0, prompt=(1, 2, 3), output=(), eos=(), **params):
    return SamplingRow(
        seq_id=seq_id,
        params=SamplingParams(**params),
        token_ids=list(prompt) + list(output),
        num_prompt_tokens=len(prompt),
        eos_token_ids=tuple(eos),
    )


def test_greedy_equals_argmax_for_every_float_dtype():
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    rows = [make_row(seq_id=i, temperature=0.0) for i in range(8)]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = logits.to(dtype)
        out = Sampler().sample(x, rows)
        assert isinstance(out, SamplerOutput)
        assert out.token_ids == x.float().argmax(dim=1).tolist()
        assert out.logprobs == [None] * 8


def test_greedy_takes_first_max_on_ties():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0]])
    assert Sampler().sample(logits, [make_row(temperature=0.0)]).token_ids == [1]


def test_sample_does_not_modify_caller_logits():
    logits = torch.randn(2, 20)
    before = logits.clone()
    rows = [
        make_row(
            0,
            output=(3, 3),
            temperature=0.7,
            top_k=5,
            top_p=0.8,
            min_p=0.1,
            repetition_penalty=1.5,
            frequency_penalty=1.0,
            min_tokens=5,
            stop_token_ids=[4],
        ),
        make_row(1, temperature=0.0, presence_penalty=1.0, output=(1,)),
    ]
    Sampler().sample(logits, rows)
    assert torch.equal(logits, before)


def test_top_k_1_with_temperature_1_equals_argmax():
    torch.manual_seed(1)
    sampler = Sampler(seed=3)
    for _ in range(10):
        logits = torch.randn(6, 50)
        rows = [make_row(i, temperature=1.0, top_k=1, seed=(i if i % 2 else None)) for i in range(6)]
        assert sampler.sample(logits, rows).token_ids == logits.argmax(dim=1).tolist()


def _run_steps(sampler, rows, steps, vocab, target_seq):
    """Feed per-step logits derived only from (seq_id, step) so batches are comparable."""
    got = []
    for step in range(steps):
        logits = torch.stack(
            [torch.randn(vocab, generator=torch.Generator().manual_seed(1000 * r.seq_id + step)) for r in rows]
        )
        out = sampler.sample(logits, rows)
        for row, tok in zip(rows, out.token_ids):
            row.token_ids.append(tok)
            if row.seq_id == target_seq:
                got.append(tok)
    return got


def test_seeded_row_gives_same_tokens_alone_or_in_a_batch():
    vocab = 64
    params = dict(temperature=0.9, top_p=0.95, top_k=40, seed=1234)

    alone = Sampler(seed=0)
    alone.add_sequence(7, SamplingParams(**params))
    solo = _run_steps(alone, [make_row(7, **params)], 20, vocab, target_seq=7)

    batched = Sampler(seed=99)
    batch_rows = [
        make_row(3, temperature=1.3, seed=42, frequency_penalty=0.5),
        make_row(7, **params),
        make_row(5, temperature=1.0),  # unseeded: uses the engine generator
        make_row(9, temperature=0.0, repetition_penalty=1.2),
    ]
    for r in batch_rows:
        batched.add_sequence(r.seq_id, r.params)
    together = _run_steps(batched, batch_rows, 20, vocab, target_seq=7)

    assert solo == together
    assert len(set(solo)) > 1  # really sampled, not stuck on one token


def test_different_seeds_give_different_tokens():
    vocab = 32
    logits = torch.zeros(2, vocab)  # uniform: any difference comes from the noise
    sampler = Sampler()
    rows = [make_row(0, temperature=1.0, seed=1), make_row(1, temperature=1.0, seed=2)]
    seqs = [[], []]
    for _ in range(20):
        for s, tok in zip(seqs, sampler.sample(logits, rows).token_ids):
            s.append(tok)
    assert seqs[0] != seqs[1]


def test_same_seed_restarts_the_same_stream_after_remove_and_add():
    logits = torch.zeros(1, 32)
    sampler = Sampler()
    params = SamplingParams(temperature=1.0, seed=5)
    row = SamplingRow(0, params, [1], 1, ())
    sampler.add_sequence(0, params)
    first = [sampler.sample(logits, [row]).token_ids[0] for _ in range(10)]
    sampler.remove_sequence(0)
    sampler.add_sequence(0, params)
    second = [sampler.sample(logits, [row]).token_ids[0] for _ in range(10)]
    assert first == second


def test_tiny_top_p_keeps_only_the_argmax():
    torch.manual_seed(2)
    logits = torch.randn(1, 30).repeat(2000, 1) * 0.3  # flat-ish distribution
    rows = [make_row(i, temperature=1.0, top_p=1e-6) for i in range(2000)]
    out = Sampler().sample(logits, rows)
    assert set(out.token_ids) == {int(logits[0].argmax())}


def test_top_p_keeps_smallest_set_reaching_the_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    rows = [make_row(i, temperature=1.0, top_p=0.8) for i in range(4000)]
    toks = Sampler().sample(logits, rows).token_ids
    assert set(toks) == {0, 1}  # 0.5 + 0.3 >= 0.8


def test_min_p_drops_tokens_below_fraction_of_max_prob():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    rows = [make_row(i, temperature=1.0, min_p=0.2) for i in range(4000)]  # threshold 0.1
    toks = Sampler().sample(logits, rows).token_ids
    assert set(toks) == {0, 1, 2}


def test_min_tokens_blocks_eos_and_stop_token_ids_until_reached():
    vocab = 8
    logits = torch.zeros(1, vocab)
    logits[0, 5] = 10.0  # eos
    logits[0, 4] = 9.0  # stop token
    logits[0, 2] = 1.0
    sampler = Sampler()
    for temperature in (0.0, 1.0):
        params = dict(temperature=temperature, min_tokens=3, stop_token_ids=[4])
        for n_out in range(3):
            row = make_row(output=[2] * n_out, eos=(5,), **params)
            assert sampler.sample(logits, [row]).token_ids[0] not in (4, 5)
        row = make_row(output=[2] * 3, eos=(5,), **params)
        if temperature == 0.0:
            assert sampler.sample(logits, [row]).token_ids == [5]
        else:
            assert {sampler.sample(logits, [row]).token_ids[0] for _ in range(50)} & {4, 5}
    # once the eos is blocked the stop token is too: the argmax falls to token 2
    row = make_row(output=[], eos=(5,), temperature=0.0, min_tokens=1, stop_token_ids=[4])
    assert sampler.sample(logits, [row]).token_ids == [2]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]])
    row = make_row(prompt=(0, 1), output=(0,), repetition_penalty=2.0)
    out = apply_logits_processors(logits, [row])
    assert torch.allclose(out, torch.tensor([[1.0, -2.0, 0.5, 3.0, -0.5]]))
    # and it changes the greedy choice when it should
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    row = make_row(prompt=(0,), temperature=0.0, repetition_penalty=2.0)
    assert Sampler().sample(logits, [row]).token_ids == [1]


def test_presence_and_frequency_penalty_count_output_tokens_only():
    logits = torch.zeros(2, 5)
    rows = [
        make_row(0, prompt=(1, 1, 1, 2), output=(2, 2, 3), frequency_penalty=0.5, presence_penalty=1.0),
        make_row(1, prompt=(1, 2), output=()),  # no penalties: untouched
    ]
    out = apply_logits_processors(logits, rows)
    # token 2: 2 output occurrences -> 0.5*2 + 1; token 3: 0.5*1 + 1; token 1 is prompt-only
    assert torch.allclose(out[0], torch.tensor([0.0, 0.0, -2.0, -1.5, 0.0]))
    assert torch.equal(out[1], torch.zeros(5))


def test_no_processors_is_the_identity_fast_path():
    logits = torch.randn(3, 10)
    rows = [make_row(i, output=(1, 2)) for i in range(3)]
    assert apply_logits_processors(logits, rows) is logits


def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    torch.manual_seed(4)
    logits = torch.randn(3, 40)
    rows = [
        make_row(0, temperature=0.0, logprobs=5, repetition_penalty=3.0, output=(0, 1)),
        make_row(1, temperature=0.7, logprobs=0),
        make_row(2, temperature=1.0),
    ]
    out = Sampler().sample(logits, rows)
    ref = logits.log_softmax(dim=1)
    lp0 = out.logprobs[0]
    assert isinstance(lp0, TokenLogprobs)
    assert lp0.token_id == out.token_ids[0]
    assert lp0.logprob == pytest.approx(ref[0, lp0.token_id].item(), abs=1e-6)
    assert len(lp0.top) == 5
    vals = [v for _, v in lp0.top]
    assert vals == sorted(vals, reverse=True)
    top_ref_v, top_ref_i = ref[0].topk(5)
    assert [t for t, _ in lp0.top] == top_ref_i.tolist()
    assert vals == pytest.approx(top_ref_v.tolist(), abs=1e-6)
    # sum-consistent: the whole distribution normalises and the top-N mass is below 1
    assert math.fsum(math.exp(v) for v in ref[0].tolist()) == pytest.approx(1.0, abs=1e-5)
    assert sum(math.exp(v) for v in vals) <= 1.0 + 1e-6
    lp1 = out.logprobs[1]
    assert lp1.top == [] and lp1.token_id == out.token_ids[1]
    assert lp1.logprob == pytest.approx(ref[1, lp1.token_id].item(), abs=1e-6)
    assert out.logprobs[2] is None


def test_unseeded_sampling_at_temperature_1_matches_softmax():
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3])
    n = 20000
    rows = [make_row(i, temperature=1.0) for i in range(n)]
    toks = torch.tensor(Sampler(seed=11).sample(logits.repeat(n, 1), rows).token_ids)
    freq = torch.bincount(toks, minlength=5).float() / n
    assert torch.allclose(freq, logits.softmax(dim=0), atol=0.015)


def test_empty_batch_returns_empty_output():
    out = Sampler().sample(torch.empty(0, 10), [])
    assert out.token_ids == [] and out.logprobs == []
