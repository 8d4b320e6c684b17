"""A batch with one refused prompt leaves nothing queued: the valid prompts before it must not run, and
use cache blocks, during the next call."""

import pytest

from loraplex import LLM, SamplingParams
from loraplex.engine.errors import InvalidRequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=128)


@pytest.mark.parametrize("bad", ["", {"prompt_token_ids": [5] * 200}, {"prompt_token_ids": [1, 10**6]}])
def test_refused_prompt_aborts_the_ones_queued_before_it(llm, bad):
    with pytest.raises(InvalidRequestError):
        llm.generate(["a valid prompt", "another one", bad], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    alone = llm.generate(["next call"], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in alone] == [4]
    assert not llm.engine.has_unfinished_requests()
