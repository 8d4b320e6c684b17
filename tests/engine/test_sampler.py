"""Sampling: filters, penalties, seeds, stops, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.engine.llm import LLM
from loraplex.engine.sampler import Sampler
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence


def _rows(params_list, prompt=(1, 2, 3)):
    return [Sequence("r", list(prompt), p) for p in params_list]


def _draws(logits_row, params, n=400):
    sampler = Sampler()
    seqs = _rows([params] * n)
    return sampler(logits_row.repeat(n, 1), seqs).token_ids


LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_greedy_takes_the_argmax():
    assert Sampler()(LOGITS.view(1, -1), _rows([SamplingParams(temperature=0)])).token_ids == [0]


def test_greedy_ties_take_the_first_index_over_a_vocabulary():
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(0))
    top = logits.max() + 1
    for row, (first, second) in enumerate([(3, 40000), (0, 1), (49150, 49151), (7, 7), (100, 20000), (5, 49000)]):
        logits[row, second] = top
        logits[row, first] = top
    got = Sampler()(logits, _rows([SamplingParams(temperature=0)] * 6)).token_ids
    assert got == [3, 0, 49150, 7, 100, 5] == logits.argmax(dim=-1).tolist()


def test_top_k_top_p_min_p_restrict_the_support():
    assert set(_draws(LOGITS, SamplingParams(top_k=2))) <= {0, 1}
    assert set(_draws(LOGITS, SamplingParams(top_p=0.7))) <= {0, 1}  # 0.5 + 0.3 reaches 0.7
    assert set(_draws(LOGITS, SamplingParams(min_p=0.5))) <= {0, 1}  # keeps p >= 0.25
    assert set(_draws(LOGITS, SamplingParams())) == {0, 1, 2, 3}


def test_a_top_k_beyond_the_vocabulary_means_no_limit():
    # values past a 64-bit integer used to fail the whole batch's step ("Overflow when unpacking long long")
    for k in (4, 5, 2**63, 10**20):
        assert set(_draws(LOGITS, SamplingParams(top_k=k))) == {0, 1, 2, 3}
    batch = _rows([SamplingParams(top_k=10**20), SamplingParams(temperature=0), SamplingParams(top_k=1)])
    assert Sampler()(LOGITS.repeat(3, 1), batch).token_ids[1:] == [0, 0]


def test_sampling_follows_the_distribution():
    draws = _draws(LOGITS, SamplingParams(), n=4000)
    freq = [draws.count(i) / len(draws) for i in range(4)]
    assert freq == pytest.approx([0.5, 0.3, 0.15, 0.05], abs=0.04)


def test_seeded_row_is_the_same_alone_and_in_a_batch():
    logits = torch.randn(1, 50)
    alone = Sampler()(logits, _rows([SamplingParams(seed=7)])).token_ids[0]
    other = torch.randn(4, 50)
    batch = torch.cat([other[:2], logits, other[2:]])
    params = [SamplingParams(), SamplingParams(seed=3), SamplingParams(seed=7), SamplingParams(), SamplingParams()]
    assert Sampler()(batch, _rows(params)).token_ids[2] == alone


def test_penalties_push_repeated_tokens_down():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    seq = _rows([SamplingParams(temperature=0, presence_penalty=0.5)])[0]
    seq.token_ids.append(0)  # token 0 already generated
    assert Sampler()(logits.clone(), [seq]).token_ids == [1]
    seq = _rows([SamplingParams(temperature=0, frequency_penalty=0.06)])[0]
    seq.token_ids += [0, 0]
    assert Sampler()(logits.clone(), [seq]).token_ids == [1]
    seq = _rows([SamplingParams(temperature=0, repetition_penalty=1.2)], prompt=(0,))[0]
    assert Sampler()(logits.clone(), [seq]).token_ids == [1]  # 2.0 / 1.2 < 1.9


def test_min_tokens_suppresses_eos():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    seq = _rows([SamplingParams(temperature=0, min_tokens=2, max_tokens=4)])[0]
    assert Sampler(eos_token_ids=(0,))(logits, [seq]).token_ids == [1]


def test_logprobs_with_alternatives():
    out = Sampler()(LOGITS.view(1, -1), _rows([SamplingParams(temperature=0, logprobs=2)]))
    chosen, top = out.logprobs[0]
    assert chosen == pytest.approx(math.log(0.5), abs=1e-5)
    assert [t for t, _ in top] == [0, 1]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=128)


def test_seed_reproducible_regardless_of_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate("The quick brown fox", p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 5
    outs = llm.generate(["Hello", "The quick brown fox", "A paged", "x", "y", "z"], [others[0], p, *others[1:]],
                        use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone


def test_stop_strings_and_stop_tokens(llm):
    base = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop_tok = base.token_ids[5]
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                     stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    first = base.token_ids.index(stop_tok)
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_stop_strings_wait_for_min_tokens(llm):
    """A stop string in the text of the first min_tokens tokens ends nothing and stays in the text, which
    always equals the tokens' text; one after that ends the request there."""
    prompt, greedy = "Hello world", dict(temperature=0, max_tokens=16, ignore_eos=True)
    base = llm.generate(prompt, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    early = base.text[1:3]  # a string the first few tokens' text holds
    assert early and early in llm.tokenizer.decode(base.token_ids[:4])
    out = llm.generate(prompt, SamplingParams(**greedy, stop=[early], min_tokens=16), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == base.token_ids and out.text == base.text
    # with min_tokens met earlier, the first occurrence after it (if any) stops the text there
    out = llm.generate(prompt, SamplingParams(**greedy, stop=[early], min_tokens=4), use_tqdm=False)[0].outputs[0]
    assert base.text.startswith(out.text) and out.token_ids == base.token_ids[:len(out.token_ids)]
    if out.finish_reason == "stop":
        assert base.text[len(out.text):].startswith(early)
        assert len(out.token_ids) >= 4


def test_eos_stops_unless_ignored(tiny_llama_dir):
    import dataclasses

    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    base = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    eos = base.token_ids[4]  # pretend this token is the model's EOS
    llm.engine.limits = dataclasses.replace(llm.engine.limits, eos_token_ids=(eos,))
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(eos) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == eos
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids


def test_logprobs_in_outputs(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.chosen.token_id == tok and len(lp.top) == 3
        assert lp.top[0].token_id == tok  # greedy picks the most likely
    assert out.cumulative_logprob == pytest.approx(sum(lp.chosen.logprob for lp in out.logprobs))


def test_n_samples_with_seed_differ_but_reproduce(llm):
    p = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=8, ignore_eos=True)
    a = llm.generate("The quick", p, use_tqdm=False)[0]
    b = llm.generate("The quick", p, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_rows_with_nonfinite_logits_are_reported():
    logits = LOGITS.repeat(3, 1)
    logits[1, 2] = float("nan")
    logits[2, 0] = float("inf")
    out = Sampler()(logits, _rows([SamplingParams(temperature=0)] * 3))
    assert out.nonfinite_rows == [1, 2]
    assert Sampler()(LOGITS.view(1, -1), _rows([SamplingParams()])).nonfinite_rows == []


def test_a_request_whose_logits_are_not_finite_fails_and_the_others_go_on(llm):
    """NaN logits (an adapter that makes the model overflow, say) end that request with an error instead of
    tokens drawn from noise; the batch's other requests are not touched."""
    engine = llm.engine
    real = engine.runner.sampler

    def poisoned(logits, seqs):
        for row, seq in enumerate(seqs):
            if seq.request_id == "bad" and seq.num_output_tokens >= 2:
                logits[row, 7] = float("nan")
        return real(logits, seqs)

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.runner.sampler = poisoned
    try:
        engine.add_request("bad", "The quick brown fox", params)
        engine.add_request("good", "The quick brown fox", params)
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
    finally:
        engine.runner.sampler = real
    assert final["bad"].error is not None and "not finite" in final["bad"].error
    assert final["bad"].outputs[0].finish_reason == "error"
    assert len(final["bad"].outputs[0].token_ids) == 2
    assert final["good"].error is None and len(final["good"].outputs[0].token_ids) == 8
    alone = llm.generate("The quick brown fox", params, use_tqdm=False)[0].outputs[0].token_ids
    assert final["good"].outputs[0].token_ids == alone


@pytest.mark.parametrize(("prompts", "params", "words"), [
    (5, None, "prompts must be"),
    (None, None, "prompts must be"),
    ({"prompt_token_ids": None}, None, "prompt_token_ids"),
    ({"prompt_token_ids": [True, False]}, None, "token ids must be integers"),
    ("Hi", {"temperature": 0}, "sampling_params must be"),
])
def test_malformed_generate_arguments_get_clear_errors(llm, prompts, params, words):
    from loraplex.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=words):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
