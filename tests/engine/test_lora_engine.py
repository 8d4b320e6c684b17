"""The adapter cache inside the engine: slots held while running, prefix caching per adapter and tenant,
the async front door's adapter calls and the CLI flag."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import AdapterLoadError
from loraplex.engine.llm import LLM
from loraplex.engine.llm_engine import resolve_lora_dtype
from loraplex.engine.sampling_params import SamplingParams
from loraplex.testing import make_peft_adapter

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG_PROMPT = [(7 * i + 3) % 300 + 5 for i in range(40)]  # two full 16-token blocks and a tail


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_adapters")
    mods = [("q_proj", "v_proj"), ("k_proj", "v_proj", "o_proj"), ("gate_proj", "down_proj"), ("up_proj",)]
    return [
        str(make_peft_adapter(tiny_llama_dir, root / f"e{i}", r=4 * (i + 1), target_modules=m, seed=20 + i))
        for i, m in enumerate(mods)
    ]


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_adapter_never_evicted_while_a_request_uses_it(tiny_llama_dir, adapters):
    llm = LLM(str(tiny_llama_dir), max_loras=2, max_cpu_loras=2, num_kv_blocks=256)
    engine, cache = llm.engine, llm.engine.adapter_slots
    cleared = []
    original_clear = cache._clear

    def clear(slot):
        running = [s for s in engine.scheduler.running if s.lora is not None and s.holds_adapter_slot]
        assert all(cache.slot_of(s.adapter_key) != slot for s in running), "evicted an adapter in use"
        cleared.append(slot)
        original_clear(slot)

    cache._clear = clear
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(12):
        engine.add_request(f"r{i}", LONG_PROMPT[: 10 + i], params, lora=llm.resolve_adapter(adapters[i % 4]))
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            if seq.holds_adapter_slot:
                assert cache._slot_key[cache.slot_of(seq.adapter_key)] == seq.adapter_key
                assert cache.refcount(seq.adapter_key) >= 1
    assert cleared, "the test should force evictions"
    assert all(cache.refcount(k) == 0 for k in (llm.resolve_adapter(a).key for a in adapters))


def test_prefix_cached_under_one_adapter_is_not_reused_under_another(tiny_llama_dir, adapters):
    llm = LLM(str(tiny_llama_dir), max_loras=4, num_kv_blocks=256)
    bm = llm.engine.block_manager
    prompt = {"prompt_token_ids": LONG_PROMPT}

    def hits_of(**kw):
        before = bm.prefix_hits
        out = _tokens(llm.generate([prompt], PARAMS, use_tqdm=False, **kw))[0]
        return bm.prefix_hits - before, out

    _, first_a = hits_of(adapter=adapters[0])
    hits, again_a = hits_of(adapter=adapters[0])
    assert hits >= 32 and again_a == first_a  # the same adapter reuses its cached prefix
    for kw in ({"adapter": adapters[1]}, {}, {"adapter": adapters[0], "tenant": "other-tenant"}):
        hits, out = hits_of(**kw)
        assert hits == 0, kw
        fresh = LLM(str(tiny_llama_dir), max_loras=4, num_kv_blocks=256, enable_prefix_caching=False)
        assert out == _tokens(fresh.generate([prompt], PARAMS, use_tqdm=False, **kw))[0]


def test_bad_adapter_is_refused_and_others_go_on(tiny_llama_dir, adapters, tmp_path):
    llm = LLM(str(tiny_llama_dir), max_loras=2, num_kv_blocks=128)
    (tmp_path / "adapter_model.bin").write_bytes(b"not a pickle we would open")
    with pytest.raises(AdapterLoadError, match="pickle"):
        llm.generate(["hi"], PARAMS, adapter=str(tmp_path), use_tqdm=False)
    with pytest.raises(AdapterLoadError, match="does not exist"):
        llm.generate(["hi"], PARAMS, adapter=str(tmp_path / "missing"), use_tqdm=False)
    assert len(llm.generate(["hi", "there"], PARAMS, adapter=[adapters[0], None], use_tqdm=False)) == 2


def test_an_adapter_whose_file_is_gone_ends_its_request_as_missing_and_a_damaged_one_as_a_load_error(
        tiny_llama_dir, tmp_path):
    """Gone (its version deleted after the request was accepted): the caller answers the client, not a server
    error; damaged: the server's fault."""
    from loraplex.engine.lora_request import LoRARequest

    llm = LLM(str(tiny_llama_dir), max_loras=2, num_kv_blocks=128)
    engine = llm.engine
    gone = LoRARequest(name="bot", content_hash="ab" * 32, path=str(tmp_path / "store" / "gone.safetensors"))
    (tmp_path / "damaged.safetensors").write_bytes(b"not safetensors")
    damaged = LoRARequest(name="bad", content_hash="cd" * 32, path=str(tmp_path / "damaged.safetensors"))
    engine.add_request("lost", [5, 6, 7], PARAMS, lora=gone)
    engine.add_request("broken", [5, 6, 7], PARAMS, lora=damaged)
    engine.add_request("base", [5, 6, 7], PARAMS)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["lost"].error_kind == "adapter_missing" and finals["lost"].outputs[0].finish_reason == "error"
    assert "bot" in finals["lost"].error
    assert finals["broken"].error_kind == "adapter_load" and "bad" in finals["broken"].error
    assert finals["base"].error is None and finals["base"].error_kind is None
    assert len(finals["base"].outputs[0].token_ids) == PARAMS.max_tokens


def test_a_tenant_whose_adapter_must_load_is_not_starved_by_another_s_stream_of_adapter_loads(
        tiny_llama_dir, adapters):
    """One slot, so one adapter load at a time for waiting requests: a busy tenant's requests cycle through three
    adapters, each loaded in turn; a second tenant's adapter gets its load (and its turn) early, not after them."""
    engine = LLM(str(tiny_llama_dir), max_loras=1, max_cpu_loras=1, num_kv_blocks=256, max_num_seqs=4).engine
    slots = engine.adapter_slots
    loras = [slots.resolve(a) for a in adapters]
    for lora in loras:
        assert slots.remove(lora.key)  # in their folders only: every one must be loaded
    for i in range(60):
        params = SamplingParams(temperature=0.0, max_tokens=3 + (3 * i) % 7, ignore_eos=True)
        engine.add_request(f"busy{i}", [5, 6, 7, 8 + i], params, lora=loras[i % 3], tenant="busy")
    for _ in range(3):
        engine.step()
    engine.add_request("small", [5, 6, 9], PARAMS, lora=loras[3], tenant="small")
    finished = []
    while engine.has_unfinished_requests():
        finished += [out.request_id for out in engine.step() if out.finished]
    # a few of the busy tenant's adapter turns first; a first-come order of adapter loads put it last
    assert finished.index("small") <= 40, finished


def test_requests_waiting_for_an_adapter_that_fails_to_load_fail_on_one_load(tiny_llama_dir, adapters, tmp_path):
    """Each loading it again in turn would fail the same way, one load after another, while another adapter's
    request waits for its own load behind them."""
    from loraplex.engine.lora_request import LoRARequest

    engine = LLM(str(tiny_llama_dir), max_loras=1, num_kv_blocks=128).engine
    slots = engine.adapter_slots
    loads = []
    load = slots.load_fn
    slots.load_fn = lambda lora: (loads.append(lora.name), load(lora))[1]
    gone = LoRARequest(name="gone", content_hash="ab" * 32, path=str(tmp_path / "gone"))
    for i in range(6):
        engine.add_request(f"gone{i}", [5, 6, 7 + i], PARAMS, lora=gone)
    other = slots.resolve(adapters[1])
    assert slots.remove(other.key)
    engine.add_request("other", [5, 6, 7], PARAMS, lora=other)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    assert loads == ["gone", other.name]
    assert all(finals[f"gone{i}"].error_kind == "adapter_missing" for i in range(6))
    assert finals["other"].error is None and len(finals["other"].outputs[0].token_ids) == PARAMS.max_tokens


async def test_async_engine_prefetch_remove_and_stats(tiny_llama_dir, adapters):
    from loraplex.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), max_loras=2, num_kv_blocks=128))
    await engine.start()
    try:
        cache = engine.engine.adapter_slots
        lora = cache.resolve(adapters[2])
        await engine.prefetch_adapter(lora, pin=True)
        stats = engine.stats()
        assert lora.key in stats.lora_resident and stats.lora_slots_total == 2 and stats.lora_slots_used == 1
        assert engine.pinned_adapters() == {lora.key}
        await engine.unpin_adapter(lora.key)  # evictable again, still where it was
        assert engine.pinned_adapters() == set() and lora.key in engine.stats().lora_resident
        await engine.unpin_adapter("cd" * 32)  # one it never held: nothing to do, nothing loaded
        assert engine.stats().lora_slots_used == 1
        final = None
        async for out in engine.generate(LONG_PROMPT[:12], PARAMS, "req-1", adapter=lora):
            final = out
        assert final.finished and len(final.outputs[0].token_ids) == 6
        assert engine.stats().lora_hits_total >= 1
        await engine.remove_adapter(lora.key)
        stats = engine.stats()
        assert lora.key not in stats.lora_resident and lora.key not in stats.lora_host_cached
    finally:
        await engine.shutdown()


async def test_async_engine_remove_does_not_wait_for_the_requests_using_the_adapter(tiny_llama_dir, adapters):
    """remove_adapter polled until no running request used the adapter, so the DELETE that removed it waited
    for the longest of them; the cache drops it when the last one releases it."""
    from loraplex.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), max_loras=2, num_kv_blocks=128))
    await engine.start()
    try:
        cache = engine.engine.adapter_slots
        lora = cache.resolve(adapters[3])
        await engine.prefetch_adapter(lora)
        assert cache.try_acquire(lora) is not None  # as a running request holds it
        await engine.remove_adapter(lora.key)
        assert lora.key in engine.stats().lora_resident  # in use: still there
        cache.release(lora.key)  # that request stops
        stats = engine.stats()
        assert lora.key not in stats.lora_resident and lora.key not in stats.lora_host_cached
    finally:
        await engine.shutdown()


def test_requests_for_other_adapters_run_when_pins_hold_every_slot(tiny_llama_dir, adapters):
    engine = LLM(str(tiny_llama_dir), max_loras=2, num_kv_blocks=128).engine
    slots = engine.adapter_slots
    pinned = [slots.resolve(adapters[i]) for i in (0, 1)]
    for lora in pinned:
        slots.prefetch(lora, pin=True).result()
    other = slots.resolve(adapters[2])
    slots.prefetch(other).result()  # in host memory: no slot is free
    assert slots.stats()["lora_slots_used"] == 2 and not slots.is_resident(other.key)
    engine.add_request("other", [5, 6, 7], PARAMS, lora=other)
    finals = []
    for _ in range(4 * PARAMS.max_tokens):  # steps, not seconds: each step either admits it or decodes
        finals += [out for out in engine.step() if out.finished]
        if finals:
            break
    assert finals and finals[0].error is None and len(finals[0].outputs[0].token_ids) == PARAMS.max_tokens
    assert set(slots.stats()["lora_pinned"]) == {p.key for p in pinned}  # still pinned; one in host memory now


def test_a_request_aborted_while_its_adapter_loads_leaves_no_hold_on_the_next_load(tiny_llama_dir, adapters):
    """With one slot, one adapter at a time is loaded for waiting requests: a request aborted while its adapter
    loads must give that place up at once, not keep the next request's adapter from loading for seconds."""
    engine = LLM(str(tiny_llama_dir), max_loras=1, num_kv_blocks=128).engine
    slots = engine.adapter_slots
    first, second = slots.resolve(adapters[0]), slots.resolve(adapters[1])
    for lora in (first, second):
        assert slots.remove(lora.key)  # in the adapter's folder only: a request loads it
    engine.add_request("gone", [5, 6, 7], PARAMS, lora=first)
    engine.step()  # its adapter's load starts
    engine.abort_request("gone")
    engine.add_request("next", [5, 6, 7], PARAMS, lora=second)
    engine.step()
    assert second.key in slots._loading or second.key in slots._host, "the next adapter's load did not start"
    finals = []
    while engine.has_unfinished_requests():
        finals += [out for out in engine.step() if out.finished]
    assert [f.request_id for f in finals] == ["next"] and len(finals[0].outputs[0].token_ids) == PARAMS.max_tokens


def test_a_tenant_waiting_for_a_slot_is_not_starved_by_another_s_stream_on_the_resident_adapter(
        tiny_llama_dir, adapters):
    """One slot, held by a busy tenant's adapter whose requests end at different steps (so some always run): a
    second tenant's request for another adapter gets the slot after a batch's worth more of them, not after the
    burst."""
    engine = LLM(str(tiny_llama_dir), max_loras=1, num_kv_blocks=256, max_num_seqs=3).engine
    busy, other = engine.adapter_slots.resolve(adapters[0]), engine.adapter_slots.resolve(adapters[1])
    for i in range(24):
        params = SamplingParams(temperature=0.0, max_tokens=3 + (5 * i) % 7, ignore_eos=True)
        engine.add_request(f"busy{i}", [5, 6, 7, 8 + i], params, lora=busy, tenant="busy")
    for _ in range(3):
        engine.step()
    engine.add_request("small", [5, 6, 9], PARAMS, lora=other, tenant="small")
    finished = []
    while engine.has_unfinished_requests():
        finished += [out.request_id for out in engine.step() if out.finished]
    # the three running then and a batch's worth admitted while it waited, at most; a first-come order of slots
    # put it after all 24
    assert finished.index("small") <= 8, finished
    assert engine.adapter_slots.refcount(busy.key) == engine.adapter_slots.refcount(other.key) == 0


async def test_an_engine_without_adapter_support_has_no_pins(tiny_llama_dir):
    from loraplex.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), max_loras=0, num_kv_blocks=32))
    await engine.start()
    try:
        assert engine.pinned_adapters() is None
    finally:
        await engine.shutdown()


def test_cli_generate_with_adapter(tiny_llama_dir, adapters):
    from click.testing import CliRunner

    from loraplex.cli import main

    args = ["generate", "--model", str(tiny_llama_dir), "--max-tokens", "5", "Hello world"]
    base = CliRunner().invoke(main, args)
    tuned = CliRunner().invoke(main, [*args, "--adapter", adapters[1]])
    assert base.exit_code == 0 and tuned.exit_code == 0, (base.output, tuned.output)
    llm = LLM(str(tiny_llama_dir), max_loras=1, num_kv_blocks=64)
    expected = llm.generate(["Hello world"], SamplingParams(temperature=0.0, max_tokens=5), adapter=adapters[1],
                            use_tqdm=False)[0].outputs[0].text
    assert tuned.output.strip() == expected.strip()
    missing = CliRunner().invoke(main, [*args, "--adapter", "/nonexistent/adapter"])
    assert missing.exit_code != 0 and "does not exist" in missing.output


def test_half_precision_adapter_slots_give_the_fp32_tokens(tiny_llama_dir, adapters):
    """`lora_dtype` float16 / bfloat16 on the CPU: the slots hold the adapters at half the bytes, the
    kernel widens them as it reads, and greedy tokens match fp32 slots for every adapter, mixed in one batch
    with base-model requests."""
    prompts = [LONG_PROMPT[: 12 + 3 * i] for i in range(6)]
    per_prompt = [adapters[0], None, adapters[1], adapters[2], None, adapters[3]]
    results, sizes = {}, {}
    for lora_dtype in ("auto", "float16", "bfloat16"):
        llm = LLM(str(tiny_llama_dir), device="cpu", max_loras=4, num_kv_blocks=256, lora_dtype=lora_dtype)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, adapter=per_prompt, use_tqdm=False)
        results[lora_dtype] = _tokens(outs)
        cache = llm.engine.adapter_slots
        host = cache._host[llm.resolve_adapter(adapters[1]).key]
        sizes[lora_dtype] = host.nbytes
        assert all(a.dtype == llm.engine.lora_dtype for a, _, _ in host.fused.values())
    assert results["float16"] == results["auto"]
    assert results["bfloat16"] == results["auto"]
    assert sizes["float16"] * 2 == sizes["auto"] == sizes["bfloat16"] * 2
    base = LLM(str(tiny_llama_dir), device="cpu", max_loras=0, num_kv_blocks=256)
    base_tokens = _tokens(base.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False))
    assert [t for t, a in zip(results["auto"], per_prompt, strict=True) if a is not None] != \
        [t for t, a in zip(base_tokens, per_prompt, strict=True) if a is not None], "the adapters should change the tokens"


def test_unknown_lora_dtype_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="lora_dtype must be one of"):
        LLM(str(tiny_llama_dir), max_loras=2, num_kv_blocks=64, lora_dtype="int8")


def test_half_precision_slots_are_refused_off_the_cpu():
    """The GPU kernels take the model's dtype: another lora_dtype there is refused before any weight loads."""
    cuda = torch.device("cuda")
    assert resolve_lora_dtype("auto", torch.bfloat16, cuda) is torch.bfloat16
    assert resolve_lora_dtype("bfloat16", torch.bfloat16, cuda) is torch.bfloat16
    with pytest.raises(ValueError, match="only the CPU supports"):
        resolve_lora_dtype("float16", torch.bfloat16, cuda)
    assert resolve_lora_dtype("float16", torch.float32, torch.device("cpu")) is torch.float16


def test_registered_names_empty_paths_and_adapters_replaced_in_a_sub_folder(tiny_llama_dir, adapters, tmp_path,
                                                                              monkeypatch):
    import shutil

    llm = LLM(str(tiny_llama_dir), max_loras=2, num_kv_blocks=128)

    def tokens(adapter):
        return _tokens(llm.generate([{"prompt_token_ids": LONG_PROMPT[:12]}], PARAMS, adapter=adapter,
                                    use_tqdm=False))[0]

    expected = [tokens(a) for a in adapters[:2]]
    assert expected[0] != expected[1]
    # a registered name stands for its adapter, and can be pointed at another one
    lora = llm.register_adapter("support-bot", adapters[0])
    assert lora.name == "support-bot" and tokens("support-bot") == expected[0]
    llm.register_adapter("support-bot", adapters[1])
    assert tokens("support-bot") == expected[1]
    with pytest.raises(AdapterLoadError, match="does not exist"):
        tokens("other-bot")
    # "" is not the working directory (which may well hold an adapter)
    with pytest.raises(AdapterLoadError, match="empty"):
        tokens("")
    # a name is never a path: one string must not mean a folder in one call and other weights in the next
    for bad in (str(adapters[0]), "./bot", "a/b", "~bot"):
        with pytest.raises(AdapterLoadError, match="looks like a path"):
            llm.register_adapter(bad, adapters[1])
    with pytest.raises(AdapterLoadError, match="PEFT folder or archive path"):
        llm.register_adapter("nothing", None)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(adapters[0], tmp_path / "support-bot")  # a folder named like the registered name
    with pytest.raises(AdapterLoadError, match="both a registered adapter name and a path"):
        tokens("support-bot")
    assert tokens("./support-bot") == expected[0]
    # an adapter one folder down, replaced by another: the new one is validated and served
    outer = tmp_path / "outer"
    shutil.copytree(adapters[0], outer / "inner")
    assert tokens(str(outer)) == expected[0]
    shutil.rmtree(outer / "inner")
    shutil.copytree(adapters[1], outer / "inner")
    assert tokens(str(outer)) == expected[1]


def test_weights_beyond_half_precision_are_refused_in_half_precision_slots(tiny_llama_dir, tmp_path):
    """fp16 slots hold up to 65504: larger weights would be inf there and every token garbage; the adapter
    is refused with the reason instead, and the same adapter serves in fp32 slots."""
    from safetensors.torch import load_file, save_file

    path = make_peft_adapter(tiny_llama_dir, tmp_path / "big", r=4, target_modules=("q_proj",), seed=5)
    weights = path / "adapter_model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(str(weights)).items()}
    key = next(k for k in tensors if k.endswith("lora_B.weight"))
    tensors[key][0, 0] = 1e6
    save_file(tensors, str(weights))
    half = LLM(str(tiny_llama_dir), device="cpu", max_loras=1, num_kv_blocks=64, lora_dtype="float16")
    with pytest.raises(AdapterLoadError, match="beyond the range"):
        half.generate(["hi"], PARAMS, adapter=str(path), use_tqdm=False)
    full = LLM(str(tiny_llama_dir), device="cpu", max_loras=1, num_kv_blocks=64)
    assert len(full.generate(["hi"], PARAMS, adapter=str(path), use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_cli_generate_takes_the_rank_limit_from_its_option_or_the_setting(tiny_llama_dir, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from loraplex.cli import main

    big = make_peft_adapter(tiny_llama_dir, tmp_path / "big", r=96, target_modules=("q_proj",), seed=3)
    args = ["generate", "--model", str(tiny_llama_dir), "--max-tokens", "3", "--adapter", str(big), "Hello"]
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code != 0 and "rank limit of 64" in refused.output, refused.output
    assert CliRunner().invoke(main, [*args, "--max-rank", "128"]).exit_code == 0
    monkeypatch.setenv("LORAPLEX_MAX_LORA_RANK", "128")
    assert CliRunner().invoke(main, args).exit_code == 0
    absurd = CliRunner().invoke(main, [*args, "--max-rank", str(10**12)])  # would allocate terabytes
    assert absurd.exit_code == 2 and "--max-rank" in absurd.output, absurd.output
    monkeypatch.setenv("LORAPLEX_MAX_LORA_RANK", "many")
    bad = CliRunner().invoke(main, args)
    assert bad.exit_code != 0 and "LORAPLEX_MAX_LORA_RANK" in bad.output and "Traceback" not in bad.output, bad.output


def test_an_adapter_given_by_a_relative_path_reloads_after_the_working_directory_changes(
        tiny_llama_dir, adapters, tmp_path, monkeypatch):
    """A relative path is read where it was given: once evicted, the adapter is loaded again from that same
    folder, whatever the working directory is by then."""
    from pathlib import Path

    llm = LLM(str(tiny_llama_dir), max_loras=1, max_cpu_loras=1, num_kv_blocks=128)

    def tokens(adapter):
        out = llm.generate([{"prompt_token_ids": LONG_PROMPT[:12]}], PARAMS, adapter=adapter, use_tqdm=False)[0]
        assert out.error is None, out.error
        return list(out.outputs[0].token_ids)

    folder = Path(adapters[0])
    monkeypatch.chdir(folder.parent)
    expected = tokens(folder.name)
    llm.register_adapter("bot", folder.name)
    monkeypatch.chdir(tmp_path)
    assert tokens(adapters[1]) != expected  # the only slot and host entry go to another adapter
    assert tokens("bot") == expected


def test_a_lora_request_written_the_vllm_way_is_refused_saying_so(tiny_llama_dir, adapters):
    """vLLM's LoRARequest is (lora_name, lora_int_id, lora_path); the same call here puts an int where the
    content hash goes. It is refused before anything runs, naming the difference, not left to fail at load
    time with a message about an int."""
    from loraplex.engine.errors import InvalidRequestError
    from loraplex.engine.lora_request import LoRARequest

    llm = LLM(str(tiny_llama_dir), max_loras=2, num_kv_blocks=64)
    vllm_style = LoRARequest("sql", 1, adapters[0])
    with pytest.raises(InvalidRequestError, match=r"content_hash is 1\. It is not vLLM's LoRARequest"):
        llm.generate(["Hello", "Hi"], PARAMS, adapter=[None, vllm_style], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="path is None"):
        llm.engine.add_request("r", "Hello", PARAMS, lora=LoRARequest("sql", "ab" * 32, None))
    assert not llm.engine.requests  # nothing was queued
    good = llm.resolve_adapter(adapters[0])
    assert len(llm.generate(["Hello"], PARAMS, adapter=good, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_a_mistyped_adapter_name_lists_the_registered_names(tiny_llama_dir, adapters):
    llm = LLM(str(tiny_llama_dir), max_loras=1, num_kv_blocks=64)
    with pytest.raises(AdapterLoadError, match=r"does not exist$"):  # nothing registered: nothing to list
        llm.generate(["Hello"], PARAMS, adapter="support-bot", use_tqdm=False)
    llm.register_adapter("support-bot", adapters[0])
    llm.register_adapter("sales-bot", adapters[1])
    with pytest.raises(AdapterLoadError, match=r"does not exist, and it is not a registered adapter name either "
                                               r"\(registered: 'sales-bot', 'support-bot'\)"):
        llm.generate(["Hello"], PARAMS, adapter="suport-bot", use_tqdm=False)
    with pytest.raises(AdapterLoadError, match=r"/nowhere/bot does not exist$"):  # a path is no name
        llm.generate(["Hello"], PARAMS, adapter="/nowhere/bot", use_tqdm=False)


def test_an_adapter_path_under_the_home_folder_may_start_with_a_tilde(tiny_llama_dir, adapters, monkeypatch):
    from pathlib import Path

    folder = Path(adapters[0])
    monkeypatch.setenv("HOME", str(folder.parent))
    llm = LLM(str(tiny_llama_dir), max_loras=1, num_kv_blocks=64)
    by_tilde, by_path = (llm.generate([{"prompt_token_ids": LONG_PROMPT[:12]}], PARAMS, adapter=a, use_tqdm=False)[0]
                         for a in (f"~/{folder.name}", folder))
    assert by_tilde.error is None and by_tilde.outputs[0].token_ids == by_path.outputs[0].token_ids
    assert llm.resolve_adapter(f"~/{folder.name}").path == str(folder)
