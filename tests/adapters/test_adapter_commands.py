"""`loraplex adapter validate` and `loraplex adapter list`."""

from __future__ import annotations

import json

from click.testing import CliRunner

from loraplex.cli import main


def test_validate_prints_version_and_stores(llama_adapter_dir, tiny_llama_dir, tmp_path):
    store = tmp_path / "store"
    result = CliRunner().invoke(main, ["adapter", "validate", str(llama_adapter_dir), "--model",
                                       str(tiny_llama_dir), "--store", str(store)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["rank"] == 8 and report["layers"] == 2 and len(report["target_modules"]) == 7
    assert report["stored_at"].endswith(report["content_hash"] + ".safetensors")
    listed = CliRunner().invoke(main, ["adapter", "list", "--store", str(store)])
    assert listed.output.split() == [report["content_hash"]]


def test_validate_refusal_names_the_problem(llama_adapter_dir, tiny_llama_dir):
    result = CliRunner().invoke(main, ["adapter", "validate", str(llama_adapter_dir), "--model",
                                       str(tiny_llama_dir), "--max-rank", "4"])
    assert result.exit_code == 1
    assert "refused (rank_too_large)" in result.output and "limit of 4" in result.output
    # the limit came from the flag: the refusal names the flag, not a setting the user never touched
    assert "limit of 4 (--max-rank)" in result.output and "max_lora_rank" not in result.output, result.output


def test_validate_refusal_names_the_setting_its_rank_limit_came_from(llama_adapter_dir, tiny_llama_dir,
                                                                   monkeypatch):
    monkeypatch.setenv("LORAPLEX_MAX_LORA_RANK", "4")
    result = CliRunner().invoke(main, ["adapter", "validate", str(llama_adapter_dir), "--model",
                                       str(tiny_llama_dir)])
    assert result.exit_code == 1 and "refused (rank_too_large)" in result.output, result.output
    assert "limit of 4 (the max_lora_rank setting, LORAPLEX_MAX_LORA_RANK)" in result.output, result.output


def test_validate_takes_the_model_as_generate_does_and_names_a_bad_one(llama_adapter_dir, tiny_llama_dir, tmp_path):
    def run(*args):
        return CliRunner().invoke(main, ["adapter", "validate", str(llama_adapter_dir), *args])

    missing = run("--model", "no-such-model")
    assert missing.exit_code == 1 and "model 'no-such-model' not found" in missing.output, missing.output
    assert "built-in model (smollm2-135m)" in missing.output  # the names --model also takes
    not_a_model = run("--model", str(tmp_path))
    assert not_a_model.exit_code == 1 and "config.json is missing" in not_a_model.output, not_a_model.output
    zero = run("--model", str(tiny_llama_dir), "--max-rank", "0")
    assert zero.exit_code == 2 and "--max-rank" in zero.output
    assert run("--model", str(tiny_llama_dir)).exit_code == 0


def test_list_defaults_to_the_settings_store(llama_adapter_dir, tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("LORAPLEX_ADAPTER_STORE_DIR", raising=False)
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "data"))
    stored = CliRunner().invoke(main, ["adapter", "validate", str(llama_adapter_dir), "--model",
                                       str(tiny_llama_dir), "--store", str(tmp_path / "data" / "adapters")])
    assert stored.exit_code == 0, stored.output
    listed = CliRunner().invoke(main, ["adapter", "list"])
    assert listed.exit_code == 0, listed.output
    assert listed.output.split() == [json.loads(stored.output)["content_hash"]]
    monkeypatch.setenv("LORAPLEX_ADAPTER_STORE_DIR", str(tmp_path / "elsewhere"))
    missing = CliRunner().invoke(main, ["adapter", "list"])
    assert missing.exit_code == 2 and "elsewhere" in missing.output, missing.output


def test_a_store_that_cannot_be_used_is_a_readable_error(llama_adapter_dir, tiny_llama_dir, tmp_path, monkeypatch):
    from loraplex.adapters.store import LocalAdapterStore

    a_file = tmp_path / "a-file"
    a_file.write_text("x")

    def validate(store):
        return CliRunner().invoke(main, ["adapter", "validate", str(llama_adapter_dir), "--model",
                                         str(tiny_llama_dir), "--store", str(store)])

    is_file = validate(a_file)
    assert is_file.exit_code == 2 and "is a file" in is_file.output, is_file.output
    under_file = validate(a_file / "store")
    assert under_file.exit_code == 1, under_file.output
    assert "cannot use" in under_file.output and "Not a directory" in under_file.output
    assert under_file.exception is None or isinstance(under_file.exception, SystemExit)

    def no_space(self, adapter):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(LocalAdapterStore, "put", no_space)
    full = validate(tmp_path / "store")
    assert full.exit_code == 1 and "valid but could not be written" in full.output, full.output
    assert "No space left on device" in full.output

    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(LocalAdapterStore, "list", denied)
    listed = CliRunner().invoke(main, ["adapter", "list", "--store", str(tmp_path / "store")])
    assert listed.exit_code == 1 and "cannot read the adapter store" in listed.output, listed.output
    assert "Permission denied" in listed.output
    not_dir = CliRunner().invoke(main, ["adapter", "list", "--store", str(a_file)])
    assert not_dir.exit_code == 2 and "is a file" in not_dir.output


def test_validate_a_path_that_is_no_adapter_names_it(tiny_llama_dir, tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for path, words in ((a_file, "refused (unsupported_format)"), (tmp_path / "missing", "refused (not_found)")):
        result = CliRunner().invoke(main, ["adapter", "validate", str(path), "--model", str(tiny_llama_dir)])
        assert result.exit_code == 1 and words in result.output, result.output


def test_validate_names_a_base_model_it_cannot_use(llama_adapter_dir, tiny_llama_dir, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    result = CliRunner().invoke(main, ["adapter", "validate", str(llama_adapter_dir), "--model", str(model)])
    assert result.exit_code == 1, result.output
    assert "base model" in result.output and "GPT2LMHeadModel" in result.output and "refused" not in result.output


def test_validate_defaults_to_what_the_server_checks_uploads_against(llama_adapter_dir, tiny_llama_dir, monkeypatch):
    """`--model` was required although `generate` (whose model it says it takes) defaults to LORAPLEX_MODEL; the
    defaults are the server's, so a check here says what an upload there would get."""
    monkeypatch.setenv("LORAPLEX_MODEL", str(tiny_llama_dir))
    monkeypatch.setenv("LORAPLEX_MAX_LORA_RANK", "4")
    refused = CliRunner().invoke(main, ["adapter", "validate", str(llama_adapter_dir)])
    assert refused.exit_code == 1 and "refused (rank_too_large)" in refused.output, refused.output
    ok = CliRunner().invoke(main, ["adapter", "validate", str(llama_adapter_dir), "--max-rank", "8"])
    assert ok.exit_code == 0 and json.loads(ok.output)["rank"] == 8, ok.output
    monkeypatch.setenv("LORAPLEX_MAX_LORA_RANK", "lots")
    bad = CliRunner().invoke(main, ["adapter", "validate", str(llama_adapter_dir)])
    assert bad.exit_code == 1 and "Error: cannot read the settings: LORAPLEX_MAX_LORA_RANK" in bad.output, bad.output
    assert bad.exception is None or isinstance(bad.exception, SystemExit)


def test_an_empty_store_says_so_on_stderr(tmp_path):
    result = CliRunner().invoke(main, ["adapter", "list", "--store", str(tmp_path)])
    assert result.exit_code == 0 and result.stdout == ""
    assert "holds no adapters yet" in result.stderr
