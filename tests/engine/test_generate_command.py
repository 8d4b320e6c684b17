"""`loraplex generate` refuses options that would be silently ignored; `loraplex bench` refuses what it cannot run."""

from click.testing import CliRunner

from loraplex.cli import main


def test_system_without_chat_is_a_usage_error(tiny_llama_dir):
    result = CliRunner().invoke(main, ["generate", "--model", str(tiny_llama_dir), "--system", "be brief", "hi"])
    assert result.exit_code == 2
    assert "--system applies only with --chat" in result.output


def test_system_with_chat_generates(tiny_llama_dir):
    args = ["generate", "--model", str(tiny_llama_dir), "--chat", "--system", "be brief", "--max-tokens", "3", "hi"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output


def test_bench_refuses_what_it_cannot_run_with_a_message(tiny_llama_dir, tmp_path):
    for args, words in [(["--num-requests", "0"], "not in the range"), (["--num-requests", "99999999999"], "not in the range"),
                        (["--max-tokens", "0"], "not in the range"), (["--model", str(tmp_path / "nope")], "not found")]:
        result = CliRunner().invoke(main, ["bench", *args])
        assert result.exit_code != 0 and words in result.output, (args, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    result = CliRunner().invoke(main, ["bench", "--model", str(tiny_llama_dir), "--num-requests", "2", "--max-tokens", "3"])
    assert result.exit_code == 0 and result.output.startswith("6 tokens in"), result.output


def test_max_tokens_beyond_the_context_is_refused_before_generating(tiny_llama_dir):
    # the tiny model's context is 512 tokens: the command says so instead of generating to its end
    for extra in ([], ["--chat"]):
        result = CliRunner().invoke(main, ["generate", "--model", str(tiny_llama_dir), *extra,
                                           "--max-tokens", "100000", "Hello world"])
        assert result.exit_code == 2, result.output
        assert "Invalid value for '--max-tokens': 100000 does not fit" in result.output
        assert "context is 512 tokens" in result.output, result.output


def test_max_tokens_that_fills_the_context_exactly_runs(tiny_llama_dir):
    result = CliRunner().invoke(main, ["generate", "--model", str(tiny_llama_dir), "--max-tokens", "600", "Hello"])
    room = int(result.output.split("at most ")[1].split()[0])
    assert 0 < room < 512
    for max_tokens, code in [(room, 0), (room + 1, 2)]:
        result = CliRunner().invoke(main, ["generate", "--model", str(tiny_llama_dir), "--max-tokens",
                                           str(max_tokens), "Hello"])
        assert result.exit_code == code, (max_tokens, result.output)


def test_sampling_flags_out_of_range_name_the_flag(tiny_llama_dir):
    for flag, value in [("--max-tokens", "0"), ("--max-tokens", "-3"), ("--temperature", "-1"), ("--top-p", "2")]:
        result = CliRunner().invoke(main, ["generate", "--model", str(tiny_llama_dir), flag, value, "hi"])
        assert result.exit_code == 2, (flag, result.output)
        assert f"Invalid value for '{flag}'" in result.output, (flag, result.output)


def test_the_default_max_tokens_shrinks_to_what_the_context_leaves(tiny_llama_dir):
    # only an explicit --max-tokens is refused: the default (128) takes what is left after a long prompt
    prompt = "hello world " * 70
    refused = CliRunner().invoke(main, ["generate", "--model", str(tiny_llama_dir), "--max-tokens", "128", prompt])
    assert refused.exit_code == 2 and "does not fit" in refused.output, refused.output
    room = int(refused.output.split("at most ")[1].split()[0])
    assert 0 < room < 128
    result = CliRunner().invoke(main, ["generate", "--model", str(tiny_llama_dir), prompt])
    assert result.exit_code == 0, result.output


def test_generate_takes_the_engine_settings_serve_takes(tiny_llama_dir):
    """LORAPLEX_MAX_MODEL_LEN (like every LORAPLEX_* engine setting) sets generate's engine, a flag overriding it."""
    args = ["generate", "--model", str(tiny_llama_dir), "--max-tokens", "100000", "Hello"]
    result = CliRunner().invoke(main, args, env={"LORAPLEX_MAX_MODEL_LEN": "64"})
    assert result.exit_code == 2 and "context is 64 tokens" in result.output, result.output
    result = CliRunner().invoke(main, [*args[:3], "--max-model-len", "128", *args[3:]],
                                env={"LORAPLEX_MAX_MODEL_LEN": "64"})
    assert result.exit_code == 2 and "context is 128 tokens" in result.output, result.output


def test_an_engine_setting_the_model_cannot_take_is_named(tiny_llama_dir):
    args = ["generate", "--model", str(tiny_llama_dir), "Hello"]
    result = CliRunner().invoke(main, args, env={"LORAPLEX_MAX_MODEL_LEN": "100000"})
    assert result.exit_code == 1 and "(LORAPLEX_MAX_MODEL_LEN)" in result.output, result.output
    result = CliRunner().invoke(main, [*args[:3], "--max-model-len", "100000", "Hello"])
    assert result.exit_code == 1 and "(--max-model-len)" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception


def test_every_engine_setting_reaches_the_engine():
    """Each setting named as an EngineConfig field is among those serve and generate pass on (engine_options)."""
    import dataclasses

    from loraplex.config import ENGINE_SETTINGS, Settings
    from loraplex.engine.config import EngineConfig

    shared = {f.name for f in dataclasses.fields(EngineConfig)} & set(Settings.model_fields) - {"model"}
    assert shared == set(ENGINE_SETTINGS)


def test_an_adapter_that_is_no_path_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """A name given without --tenant may be meant as an uploaded adapter's: the refusal says --tenant names
    those, and comes before the model is loaded (the model here does not even exist). An empty --adapter is
    a usage error, not 'the adapter path is empty (None means the base model)'."""
    monkeypatch.chdir(tmp_path)
    missing_model = ["generate", "--model", str(tmp_path / "no-model"), "hi"]
    result = CliRunner().invoke(main, [*missing_model, "--adapter", "support-bot"])
    assert result.exit_code == 1, result.output
    assert "'support-bot' does not exist" in result.output and "--tenant TENANT" in result.output, result.output
    for empty in ("", " "):
        result = CliRunner().invoke(main, [*missing_model, "--adapter", empty])
        assert result.exit_code == 2 and "leave it out to use the base model" in result.output, result.output


def test_an_adapter_under_the_home_folder_may_be_given_with_a_quoted_tilde(tiny_llama_dir, tmp_path, monkeypatch):
    from loraplex.testing import make_peft_adapter

    make_peft_adapter(tiny_llama_dir, tmp_path / "bot", r=4, target_modules=("q_proj",), seed=1)
    monkeypatch.setenv("HOME", str(tmp_path))
    args = ["generate", "--model", str(tiny_llama_dir), "--max-tokens", "3", "hi", "--adapter"]
    by_tilde, by_path = (CliRunner().invoke(main, [*args, a]) for a in ("~/bot", str(tmp_path / "bot")))
    assert by_tilde.exit_code == 0 and by_tilde.output == by_path.output, by_tilde.output
