"""Sampling parameters outside what the sampler can use are refused up front instead of failing, or
producing nonsense, inside the engine."""

import pytest

from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**23])
def test_seed_outside_64_bits_is_refused(seed):
    with pytest.raises(InvalidRequestError, match="seed") as info:
        SamplingParams(seed=seed)
    assert info.value.param == "seed"


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0])
def test_extreme_seeds_seed_every_choice(seed):
    params = SamplingParams(seed=seed, n=128)
    # The last choice is seeded with seed + 127: it must still fit torch's generator.
    seqs = [Sequence("r", [1, 2], params, index=i) for i in (0, params.n - 1)]
    assert all(s.generator is not None for s in seqs)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5])
def test_temperature_must_be_finite_and_non_negative(temperature):
    # NaN slipped past a plain `< 0` check and made the sampler return empty text
    with pytest.raises(InvalidRequestError, match="temperature") as info:
        SamplingParams(temperature=temperature)
    assert info.value.param == "temperature"


@pytest.mark.parametrize(("field", "value", "words"), [
    ("logprobs", True, "an integer"),
    ("logprobs", 1.5, "an integer"),
    ("seed", 1.5, "an integer"),
    ("max_tokens", True, "an integer"),
    ("n", 2.0, "an integer"),
    ("top_k", 2.5, "an integer"),
    ("min_tokens", 1.5, "an integer"),
    ("temperature", "0.5", "a number"),
    ("top_p", True, "a number"),
    ("ignore_eos", "no", "true or false"),
    ("skip_special_tokens", 0, "true or false"),
    ("stop", [1, 2], "a string or a list of strings"),
    ("stop", 5, "a string or a list of strings"),
    ("stop_token_ids", 5, "a list of integers"),
    ("stop_token_ids", [1.5], "a list of integers"),
    ("stop_token_ids", [True], "a list of integers"),
])
def test_values_of_the_wrong_type_are_refused_naming_the_field(field, value, words):
    """A bool is not a count and a string is not a flag: such values used to pass the range checks and fail
    (or change the output) inside a step, where they failed the whole batch."""
    with pytest.raises(InvalidRequestError, match=words) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_numbers_of_other_integer_and_real_types_are_taken():
    import numpy as np

    params = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.5), seed=np.int32(7),
                            stop_token_ids=(np.int64(3),), stop=("a", "b"))
    assert params.max_tokens == 5 and type(params.max_tokens) is int
    assert params.seed == 7 and params.stop_token_ids == [3] and params.stop_strings == ["a", "b"]
    assert type(params.temperature) is float
