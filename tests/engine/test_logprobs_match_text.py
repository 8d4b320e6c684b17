"""A completion's logprobs cover the tokens its text is made of: not the stop token that ended it unseen, nor
the tokens of a stop string cut from the text (a token straddling the cut stays: part of it is text). The
same entries are streamed, never ahead of the text they belong to."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from loraplex.engine.detokenizer import incomplete_utf8_suffix
from loraplex.engine.llm import LLM
from loraplex.engine.sampling_params import SamplingParams

PROMPT = "The quick brown fox"
GREEDY = dict(temperature=0, max_tokens=24, logprobs=2)
_ids = itertools.count()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), num_kv_blocks=128)


@pytest.fixture(scope="module")
def base(llm):
    """The greedy completion without stops, whose pieces the tests make stops of."""
    out, _, _ = _run(llm, SamplingParams(**GREEDY, ignore_eos=True))
    return out


def _run(llm: LLM, params: SamplingParams):
    """The final output, and the logprobs entries and text its stream carried."""
    request_id = f"lp-{next(_ids)}"
    llm.engine.add_request(request_id, PROMPT, params)
    streamed, text = [], ""
    while True:
        for out in llm.engine.step():
            if out.request_id != request_id:
                continue
            o = out.outputs[0]
            streamed += o.delta_logprobs
            text += o.delta_text
            if out.finished:
                return o, streamed, text


def _before(llm: LLM, base, k: int) -> str | None:
    """The text of the first k tokens, where it ends on a character boundary of the completion's text (and
    not inside a character, which a completion cut there would drop)."""
    tokenizer = llm.engine.tokenizer
    if incomplete_utf8_suffix(b"".join(tokenizer.token_bytes(t) for t in base.token_ids[:k])):
        return None
    text = tokenizer.decode(base.token_ids[:k])
    return text if base.text.startswith(text) else None


def _token(llm: LLM, token_id: int) -> str:
    """A token's text, or "" where it holds part of a character."""
    text = llm.engine.tokenizer.decode([token_id])
    return "" if "\ufffd" in text else text


def _check_stream(out, streamed, text):
    assert [e.chosen.token_id for e in streamed] == [e.chosen.token_id for e in out.logprobs]
    assert text == out.text


def test_the_stop_token_that_ended_a_completion_has_no_entry(llm, base):
    ids = base.token_ids
    k = next(k for k in range(3, len(ids)) if ids[k] not in ids[:k] and _before(llm, base, k))
    limits = llm.engine.limits
    llm.engine.limits = dataclasses.replace(limits, eos_token_ids=(ids[k],))  # this token is now EOS
    try:
        out, streamed, text = _run(llm, SamplingParams(**GREEDY))
    finally:
        llm.engine.limits = limits
    assert out.finish_reason == "stop" and out.token_ids == ids[: k + 1]
    assert [e.chosen.token_id for e in out.logprobs] == ids[:k] and out.text == _before(llm, base, k)
    _check_stream(out, streamed, text)
    # a stop token id given with the request is left out the same way
    out, streamed, text = _run(llm, SamplingParams(**GREEDY, ignore_eos=True, stop_token_ids=[ids[k]]))
    assert [e.chosen.token_id for e in out.logprobs] == ids[:k] and out.token_ids == ids[: k + 1]
    _check_stream(out, streamed, text)


def test_tokens_of_a_stop_string_have_no_entries(llm, base):
    ids = base.token_ids
    # a stop string of two whole tokens, found first where they begin
    k, stop = next((k, stop) for k in range(2, len(ids) - 2)
                   if (before := _before(llm, base, k)) is not None and _token(llm, ids[k])
                   and _token(llm, ids[k + 1]) and base.text.find(stop := _token(llm, ids[k]) + _token(llm, ids[k + 1]))
                   == len(before))
    out, streamed, text = _run(llm, SamplingParams(**GREEDY, ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop" and out.text == _before(llm, base, k)
    assert [e.chosen.token_id for e in out.logprobs] == ids[:k]
    _check_stream(out, streamed, text)


def test_a_token_straddling_the_cut_keeps_its_entry(llm, base):
    ids = base.token_ids
    # a stop string of a token's last character and the next one's first: the cut falls inside the token
    k, stop = next((k, stop) for k in range(2, len(ids) - 2)
                   if (through := _before(llm, base, k + 1)) is not None and len(_token(llm, ids[k])) >= 2
                   and _token(llm, ids[k + 1])
                   and base.text.find(stop := _token(llm, ids[k])[-1] + _token(llm, ids[k + 1])[0])
                   == len(through) - 1)
    out, streamed, text = _run(llm, SamplingParams(**GREEDY, ignore_eos=True, stop=stop))
    assert out.finish_reason == "stop" and out.text == _before(llm, base, k + 1)[:-1]
    assert [e.chosen.token_id for e in out.logprobs] == ids[: k + 1]
    _check_stream(out, streamed, text)


def test_a_completion_that_runs_out_keeps_every_entry(llm, base):
    assert [e.chosen.token_id for e in base.logprobs] == base.token_ids
    out, streamed, text = _run(llm, SamplingParams(**GREEDY, ignore_eos=True, stop=["\x00never"]))
    assert out.finish_reason == "length" and out.token_ids == base.token_ids
    assert [e.chosen.token_id for e in out.logprobs] == base.token_ids
    _check_stream(out, streamed, text)
