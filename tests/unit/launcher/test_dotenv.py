"""A .env file in the working directory fills in what the command line and the environment leave
unset, for the launcher's flags and the router's alike."""
import pytest

from launcher.config import parse_args
from launcher.dotenv import load_dotenv, parse_dotenv


def test_lines_comments_quotes_and_export():
    text = "# defaults\nDEFAULT_TEMPERATURE=0.7\nexport DEFAULT_TOP_K = 20\n\nNAME='a b'\nQ=\"x\"\n"
    assert parse_dotenv(text) == {"DEFAULT_TEMPERATURE": "0.7", "DEFAULT_TOP_K": "20",
                                  "NAME": "a b", "Q": "x"}
    assert parse_dotenv("A=1 # one\nB='2 # two'\n") == {"A": "1", "B": "2 # two"}
    with pytest.raises(ValueError, match=r"\.env:2: expected KEY=VALUE"):
        parse_dotenv("A=1\nnot a setting\n")


def test_the_environment_and_the_command_line_win_over_the_file(tmp_path, monkeypatch):
    (tmp_path / ".env").write_text("DEFAULT_MAX_NEW_TOKENS=33\nDEFAULT_TOP_K=7\n"
                                   "SESSION_TTL=60\nDEFAULT_DO_SAMPLE=true\n")
    for name in ("DEFAULT_MAX_NEW_TOKENS", "DEFAULT_TOP_K", "SESSION_TTL", "DEFAULT_DO_SAMPLE"):
        monkeypatch.setenv(name, "")  # recorded, so that what the file sets is undone after
        monkeypatch.delenv(name)
    monkeypatch.setenv("DEFAULT_TOP_K", "9")
    added = load_dotenv(tmp_path / ".env")
    assert sorted(added) == ["DEFAULT_DO_SAMPLE", "DEFAULT_MAX_NEW_TOKENS", "SESSION_TTL"]
    config = parse_args(["--session-ttl", "5"])
    assert config.router["default_max_new_tokens"] == 33
    assert config.router["default_top_k"] == 9
    assert config.router["session_ttl"] == 5.0
    argv = config.router_argv(tokenizer_path="/m", model_id="m")
    assert argv[argv.index("--default-do-sample") + 1] == "true"
    assert load_dotenv(tmp_path / "missing.env") == []
