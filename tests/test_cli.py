"""Every `igserve` subcommand imports and builds its parser (a benchmark no test runs otherwise
would break unseen when a module it imports moves)."""

from __future__ import annotations

import pytest

from server import cli


@pytest.mark.parametrize("words", [c[0] for c in cli.COMMANDS], ids=lambda w: " ".join(w))
def test_every_subcommand_answers_help(words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*words, "--help"])
    assert exit_info.value.code == 0
    assert "usage: igserve " + " ".join(words) in capsys.readouterr().out


def test_an_unknown_command_is_refused(capsys):
    assert cli.main(["nonsense"]) == 2
    assert "usage: igserve <command>" in capsys.readouterr().err
