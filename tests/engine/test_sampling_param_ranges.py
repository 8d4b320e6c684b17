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
