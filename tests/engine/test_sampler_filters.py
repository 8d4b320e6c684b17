"""min_p, repetition_penalty and top_p = 0 against a reference computed token by token, as vLLM defines them:
repetition_penalty divides the positive logits and multiplies the negative ones of every token in the prompt or
the output; min_p drops the tokens whose probability (after temperature) is below min_p times the largest."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.engine.sampler import Sampler, _apply_penalties, _mask_top_k_top_p_min_p
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence

VOCAB = 64


def _seq(params: SamplingParams, prompt: list[int], output: list[int] = ()) -> Sequence:
    seq = Sequence("r", list(prompt), params)
    seq.token_ids += list(output)
    return seq


def _reference_repetition(logits: list[float], seen: set[int], penalty: float) -> list[float]:
    return [(x / penalty if x > 0 else x * penalty) if t in seen else x for t, x in enumerate(logits)]


def _reference_min_p_support(logits: list[float], temperature: float, min_p: float) -> set[int]:
    exps = [math.exp(x / temperature) for x in logits]
    probs = [e / sum(exps) for e in exps]
    return {t for t, p in enumerate(probs) if p >= min_p * max(probs)}


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_the_reference(penalty):
    gen = torch.Generator().manual_seed(int(penalty * 10))
    logits = torch.randn(3, VOCAB, generator=gen) * 3
    prompts, outputs = [[1, 5, 9, 9], [2], [60, 3]], [[5, 7], [], [3, 3, 40]]
    seqs = [_seq(SamplingParams(repetition_penalty=penalty), p, o) for p, o in zip(prompts, outputs, strict=True)]
    got = logits.clone()
    _apply_penalties(got, [0, 1, 2], seqs)
    for row, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        want = _reference_repetition(logits[row].tolist(), set(prompt) | set(output), penalty)
        assert got[row].tolist() == pytest.approx(want, rel=1e-6)


def test_greedy_follows_the_penalized_logits():
    logits = torch.tensor([[3.0, 2.9, -1.0, -1.1]])
    # token 0 seen in the prompt: 3.0 / 1.2 = 2.5 falls below token 1; a negative seen logit sinks further
    params = SamplingParams(temperature=0, repetition_penalty=1.2)
    assert Sampler()(logits.clone(), [_seq(params, [0, 2])]).token_ids == [1]
    assert Sampler()(logits.clone(), [_seq(SamplingParams(temperature=0), [0, 2])]).token_ids == [0]
    # a penalty below 1 favours what was seen: -1.0 * 0.5 = -0.5 rises above -1.1 and 2.9 / 0.5 above 3.0
    logits = torch.tensor([[3.0, 2.9, -1.0, -1.1]])
    assert Sampler()(logits, [_seq(SamplingParams(temperature=0, repetition_penalty=0.5), [1])]).token_ids == [1]


@pytest.mark.parametrize(("temperature", "min_p"), [(1.0, 0.05), (0.7, 0.2), (1.5, 0.5), (1.0, 1.0)])
def test_min_p_keeps_the_reference_support(temperature, min_p):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, VOCAB, generator=gen) * 2
    seqs = [_seq(SamplingParams(temperature=temperature, min_p=min_p), [1])] * 4
    masked = _mask_top_k_top_p_min_p(logits / temperature, seqs)
    for row in range(4):
        kept = set(torch.isfinite(masked[row]).nonzero().flatten().tolist())
        assert kept == _reference_min_p_support(logits[row].tolist(), temperature, min_p)
    # min_p = 1 keeps the most likely token alone
    if min_p == 1.0:
        assert all(torch.isfinite(masked[row]).sum() == 1 for row in range(4))


def test_min_p_draws_from_the_renormalised_support():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 4000
    seqs = [_seq(SamplingParams(min_p=0.4), [1]) for _ in range(n)]
    draws = Sampler()(logits.repeat(n, 1), seqs).token_ids
    # p >= 0.4 * 0.5 keeps tokens 0 and 1, drawn as 0.5 : 0.3
    freq = [draws.count(t) / n for t in range(4)]
    assert freq == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=0.04)


def test_top_p_zero_keeps_only_the_most_likely_token():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, VOCAB, generator=gen)
    params = [SamplingParams(top_p=0.0), SamplingParams(top_p=0.0, seed=11), SamplingParams(top_p=0.0, top_k=5),
              SamplingParams(top_p=0.0, min_p=0.3), SamplingParams(top_p=0.0, temperature=2.0)]
    seqs = [_seq(p, [1]) for p in params]
    masked = _mask_top_k_top_p_min_p(logits.clone(), seqs)
    assert not masked.isnan().any()
    assert (torch.isfinite(masked).sum(dim=-1) == 1).all()
    for _ in range(5):
        out = Sampler()(logits.clone(), seqs)
        assert out.token_ids == logits.argmax(dim=-1).tolist() and out.nonfinite_rows == []


def test_the_ranges_are_vllms():
    SamplingParams(top_p=0.0, min_p=0.0, repetition_penalty=0.01)
    SamplingParams(top_p=1.0, min_p=1.0, repetition_penalty=2.0)
    for kwargs in ({"top_p": -0.01}, {"min_p": 1.01}, {"min_p": -0.1}, {"repetition_penalty": 0.0},
                   {"repetition_penalty": -1.0}, {"min_p": math.nan}, {"repetition_penalty": math.nan}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            SamplingParams(**kwargs)
