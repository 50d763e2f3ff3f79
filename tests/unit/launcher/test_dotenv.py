"""A .env file in the working directory fills in what the command line and the environment leave
unset, for the launcher's flags and the router's alike."""
import os
import re

import pytest

from launcher.config import parse_args
from launcher.dotenv import check_dotenv, load_dotenv


@pytest.fixture
def dotenv_file(tmp_path, monkeypatch):
    """Writes a .env and loads it; the variables it sets are undone after the test."""
    def load(text: str) -> dict[str, str]:
        path = tmp_path / ".env"
        path.write_text(text)
        before = dict(os.environ)
        added = load_dotenv(path)
        assert set(os.environ) - set(before) == set(added)
        for name in added:  # set again through monkeypatch, which then unsets it after the test
            monkeypatch.setenv(name, os.environ.pop(name))
        return {name: os.environ[name] for name in added}
    return load


def test_lines_comments_quotes_and_export(dotenv_file, monkeypatch):
    for name in ("DEFAULT_TEMPERATURE", "DEFAULT_TOP_K", "NAME", "Q", "MODEL_ID", "A", "B"):
        monkeypatch.delenv(name, raising=False)
    text = ("# defaults\nDEFAULT_TEMPERATURE=0.7\nexport DEFAULT_TOP_K = 20\n\nNAME='a b'\n"
            "Q=\"x\"\nMODEL_ID=\"foo\" # the model\nA=1 # one\nB='2 # two'\n")
    assert dotenv_file(text) == {"DEFAULT_TEMPERATURE": "0.7", "DEFAULT_TOP_K": "20",
                                 "NAME": "a b", "Q": "x", "MODEL_ID": "foo", "A": "1",
                                 "B": "2 # two"}


def test_multi_line_values_and_escapes(dotenv_file, monkeypatch):
    for name in ("API_KEY", "TEMPLATE", "RAW"):
        monkeypatch.delenv(name, raising=False)
    assert dotenv_file('API_KEY="one\ntwo"\nTEMPLATE="a\\tb\\n\\"c\\""\nRAW=\'a\\tb\'\n') == {
        "API_KEY": "one\ntwo", "TEMPLATE": 'a\tb\n"c"', "RAW": "a\\tb"}


def test_variables_come_from_the_environment_first_then_the_files_earlier_lines(dotenv_file,
                                                                               monkeypatch):
    for name in ("DATA", "HUGGINGFACE_HUB_CACHE", "NOTHING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DATA_ROOT", "/srv")
    values = dotenv_file("DATA_ROOT=/elsewhere\nDATA=${DATA_ROOT}/tgi\n"
                         "HUGGINGFACE_HUB_CACHE=${DATA}/hub\n"
                         "NOTHING=${NOTHING_SET_HERE}\n")
    assert values == {"DATA": "/srv/tgi", "HUGGINGFACE_HUB_CACHE": "/srv/tgi/hub",
                      "NOTHING": ""}
    assert os.environ["DATA_ROOT"] == "/srv", "the environment wins over the file"
    assert parse_args([]).huggingface_hub_cache == "/srv/tgi/hub"


def test_a_single_quoted_value_is_kept_as_written(dotenv_file, monkeypatch):
    """As shells and docker compose keep it: a password holding `${` stays as it is."""
    for name in ("SECRET", "SPACED", "EXPANDED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME_DIR", "/root")
    assert dotenv_file("SECRET='pa${HOME_DIR}ss'\nexport SPACED = 'x${HOME_DIR}'\n"
                       'EXPANDED="x${HOME_DIR}"\n') == {
        "SECRET": "pa${HOME_DIR}ss", "SPACED": "x${HOME_DIR}", "EXPANDED": "x/root"}


def test_a_line_that_is_not_a_setting_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"\.env:2: expected KEY=VALUE, got 'not a setting'"):
        check_dotenv("A=1\nnot a setting\n")
    with pytest.raises(ValueError, match=r"\.env:3: expected KEY=VALUE, got 'PORT'"):
        check_dotenv("A=1\n# a name alone is skipped by python-dotenv\nPORT\n")
    # python-dotenv folds the blank lines before a binding into it: the line named is the bad one
    with pytest.raises(ValueError, match=r"\.env:4: expected KEY=VALUE, got 'not a setting'"):
        check_dotenv("A=1\n\n\nnot a setting\n")
    path = tmp_path / ".env"
    path.write_text("SOMETHING_NEW_1=1\nnot a setting\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: expected KEY=VALUE")):
        load_dotenv(path)
    assert "SOMETHING_NEW_1" not in os.environ, "nothing is set from a file with an error"


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
