"""Bad input gives a clear error, and the engine goes on serving the others."""

from __future__ import annotations

import shutil

import pytest

from loraplex.engine.errors import InvalidRequestError, ModelLoadError
from loraplex.engine.llm import LLM
from loraplex.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=128)


@pytest.mark.parametrize("prompt", ["", [[]], {"prompt_token_ids": []}])
def test_empty_prompt(llm, prompt):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate(prompt, GREEDY, use_tqdm=False)


def test_prompt_longer_than_context(llm):
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate({"prompt_token_ids": [5] * 200}, GREEDY, use_tqdm=False)


def test_token_ids_outside_vocabulary(llm):
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate({"prompt_token_ids": [1, 10**6]}, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"max_tokens": -3}, {"top_p": -0.1}, {"top_p": 1.5},
                                    {"min_p": 1.5}, {"repetition_penalty": 0.0}])
def test_bad_sampling_params(kwargs):
    with pytest.raises(InvalidRequestError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_request_too_big_for_the_cache(tiny_llama_dir):
    small = LLM(str(tiny_llama_dir), num_kv_blocks=4, block_size=4)
    with pytest.raises(InvalidRequestError, match="KV cache blocks"):
        small.generate("Hello world", SamplingParams(max_tokens=100), use_tqdm=False)
    assert small.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)[0].finished


def test_engine_keeps_serving_after_bad_requests(llm):
    eng = llm.engine
    eng.add_request("good", "Hello world", GREEDY)
    for bad in ("", [10**6]):
        with pytest.raises(InvalidRequestError):
            eng.add_request("bad", bad, GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("good", "again", GREEDY)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs if o.finished] == ["good"]
    assert len(outs[-1].outputs[0].token_ids) == 6


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not found|not a model directory"):
        LLM(str(tmp_path / "no-such-model"))


def test_corrupt_safetensors(tiny_llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(broken))


def test_missing_weight_is_named(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    partial = tmp_path / "partial"
    shutil.copytree(tiny_llama_dir, partial)
    tensors = load_file(str(partial / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="down_proj"):
        LLM(str(partial))


@pytest.mark.parametrize("adapter", [5, 1.5, {"path": "x"}, ["ok-len", 7]])
def test_adapter_of_the_wrong_type_is_named(llm, adapter):
    prompts = ["hello", "world"] if isinstance(adapter, list) else ["hello"]
    if isinstance(adapter, list):
        adapter = [None, adapter[1]]
    with pytest.raises(InvalidRequestError, match="adapter must be a path, a registered adapter name"):
        llm.generate(prompts, GREEDY, adapter=adapter, use_tqdm=False)
    assert llm.generate(["hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serving



@pytest.mark.parametrize(("kwargs", "param"), [
    ({"max_loras": "2"}, "max_loras"), ({"max_loras": 1.5}, "max_loras"), ({"max_loras": -1}, "max_loras"),
    ({"max_cpu_loras": True}, "max_cpu_loras"), ({"max_lora_rank": 0}, "max_lora_rank"),
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"num_kv_blocks": 0}, "num_kv_blocks"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"), ({"seed": "1"}, "seed"),
])
def test_engine_arguments_of_the_wrong_kind_are_refused_by_name(kwargs, param):
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=param) as info:
        EngineConfig(model="smollm2-135m", **kwargs)
    assert info.value.param == param


def test_an_adapter_store_that_is_a_file_is_refused(tmp_path):
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.errors import InvalidRequestError

    (tmp_path / "store").write_text("not a folder")
    with pytest.raises(InvalidRequestError, match="is a file, not a directory"):
        EngineConfig(model="smollm2-135m", adapter_store=str(tmp_path / "store"))


def test_lists_of_the_wrong_length_say_which_and_how_long(llm):
    from loraplex.engine.sampling_params import SamplingParams

    with pytest.raises(InvalidRequestError, match="the adapter list has 2 entries for 3 prompts") as info:
        llm.generate(["a", "b", "c"], adapter=[None, None], use_tqdm=False)
    assert info.value.param == "adapter"
    with pytest.raises(InvalidRequestError, match="the sampling_params list has 1 entry for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2)], use_tqdm=False)
