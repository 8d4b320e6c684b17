"""`loraplex generate` refuses options that would be silently ignored."""

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
