"""A failure that is not the user's doing is a bug: its traceback, one line asking to report
it, exit 70. The user's own mistakes stay one line (tests/cli/test_user_errors.py)."""

import pytest

from kvtier.cli import EXIT_BUG, EXIT_FAILED, EXIT_USAGE, main
from kvtier.errors import IntegrityError, UnsupportedLayoutError, UsageError

HINT = "kvtier inspect: internal error (a bug): please report it with the traceback above"


def failing(monkeypatch, error: BaseException) -> None:
    def work(*args, **kwargs):
        raise error

    monkeypatch.setattr("kvtier.cli.inspect.layout_reports", work)


@pytest.mark.parametrize("error", [IntegrityError("free: pages starting at slots [0] are not allocated"),
                                   ValueError("a bare ValueError from deep inside"), KeyError("page")])
def test_a_bug_inside_a_command_shows_its_traceback_and_asks_for_a_report(capsys, monkeypatch, error):
    failing(monkeypatch, error)
    assert main(["inspect", "--spec", "llama3-8b"]) == EXIT_BUG
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and lines[0] == "Traceback (most recent call last):"
    assert f"{type(error).__name__}: " in err and "in work" in err  # where it was raised
    assert lines[-1] == HINT


@pytest.mark.parametrize("error, code", [(UsageError("--page-size 3: not a power of two"), EXIT_USAGE),
                                         (UnsupportedLayoutError("page_head cannot do that; use page_first"),
                                          EXIT_USAGE),
                                         (OSError("disk full"), EXIT_FAILED)])
def test_the_users_errors_stay_one_line(capsys, monkeypatch, error, code):
    failing(monkeypatch, error)
    assert main(["inspect", "--spec", "llama3-8b"]) == code
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [f"kvtier inspect: error: {error}"]


def test_exit_statuses_are_distinct():
    assert len({EXIT_FAILED, EXIT_USAGE, EXIT_BUG}) == 3 and 0 not in (EXIT_FAILED, EXIT_USAGE, EXIT_BUG)
