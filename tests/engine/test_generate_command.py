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
