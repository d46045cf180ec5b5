"""What `import kerasmulti` does, and how it tells the `kerasmulti` command apart (no TensorFlow here)."""

import sys

import pytest

from kerasmulti._src import startup


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["python", "-m", "kerasmulti", "demo"], True),
        (["python", "-mkerasmulti", "demo"], True),
        (["python", "-X", "importtime", "-m", "kerasmulti", "--help"], True),
        (["python", "-u", "-m", "kerasmulti._src.commands.cli", "devices"], True),
        (["python", "train.py", "-m", "kerasmulti"], False),  # the script's own arguments
        (["python", "-c", "import kerasmulti", "-m", "kerasmulti"], False),
        (["python", "-m", "pytest", "-m", "kerasmulti"], False),
        (["python"], False),
    ],
)
def test_the_command_is_told_apart_by_the_interpreters_options_only(monkeypatch, argv, expected):
    monkeypatch.setattr(sys, "orig_argv", argv, raising=False)
    monkeypatch.setattr(sys, "argv", argv[1:] or [""])
    assert startup.started_by_command_line() is expected


def test_the_console_script_is_the_command(monkeypatch):
    monkeypatch.setattr(sys, "orig_argv", ["python", "/venv/bin/kerasmulti", "demo"], raising=False)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/kerasmulti", "demo"])
    assert startup.started_by_command_line() is True


def test_without_its_variables_the_import_does_nothing(monkeypatch):
    monkeypatch.delenv(startup.ENV_SIMULATE, raising=False)
    monkeypatch.delenv(startup.ENV_JOIN, raising=False)
    monkeypatch.setattr(sys, "orig_argv", ["python", "script.py"], raising=False)
    monkeypatch.setattr(sys, "argv", ["script.py"])
    before = set(sys.modules)
    startup.from_environment()
    assert set(sys.modules) == before
