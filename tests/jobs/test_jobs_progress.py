"""The live progress bar on a terminal: Ctrl-C leaves one line, not the bar twice."""

from __future__ import annotations

import io
import re
import sys

import pytest

from asyncgraph.jobs._report import Reporter

ROW = {
    "train_loss": 1.0,
    "train_score": 0.0,
    "val_score": 0.25,
    "tokens": 6677,
    "cost_usd": 0.0,
    "cost_known": True,
}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


WIDTH = 100


def visible_lines(raw: str) -> list[str]:
    """What a WIDTH-column terminal shows: wrapping, carriage returns, cursor-up, erase-line."""
    lines: list[str] = [""]
    for token in re.split(r"(\x1b\[[0-9;?]*[A-Za-z]|\r|\n)", raw):
        if token == "\n":
            lines.append("")
        elif token == "\r":
            continue  # the next write erases the line (rich always erases with 2K)
        elif token.startswith("\x1b["):
            if token.endswith("A"):
                lines.pop()
            elif token == "\x1b[2K":
                lines[-1] = ""
        else:
            for char in token:
                if len(lines[-1]) == WIDTH:  # the cursor wraps to a new line
                    lines.append("")
                lines[-1] += char
    return [line for line in lines if line.strip()]


@pytest.mark.parametrize("interrupted", [False, True])
def test_the_bar_is_shown_once_when_it_stops(
    interrupted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    reporter = Reporter("demo-prompt-optimization", 6)
    reporter.start(0, [])
    reporter.update(1, ROW)
    if interrupted:
        terminal.write("^C")  # what the terminal echoes into the bar's line
    reporter.stop(interrupted=interrupted)
    shown = visible_lines(terminal.getvalue())
    bars = [line for line in shown if "demo-prompt-optimization" in line]
    assert len(bars) == 1, shown
    if interrupted:
        assert bars[0].startswith("demo-prompt-optimization: interrupted after step 1/6")
        assert "^C" not in "".join(shown)
    else:
        assert "1/6" in bars[0]
