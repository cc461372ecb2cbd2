"""The progress bar: redrawn on a terminal, a line per tenth in a log."""

from __future__ import annotations

import io

from torchtitan.observability.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_per_tenth_and_the_end():
    log = io.StringIO()
    bar = Progress("convert", 25, stream=log)
    for done in range(1, 26):
        bar.update(done)
    lines = log.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        f"convert: {d}/25" for d in (3, 5, 8, 10, 13, 15, 18, 20, 23, 25)
    ]


def test_a_terminal_gets_one_redrawn_line():
    term = _Terminal()
    bar = Progress("read checkpoint", 4, stream=term)
    for done in range(1, 5):
        bar(done, 4)
    frames = term.getvalue().split("\r")[1:]
    assert len(frames) == 4 and term.getvalue().count("\n") == 1
    assert frames[1].startswith("read checkpoint [############............]  50%  2/4")
    assert frames[-1].startswith("read checkpoint [########################] 100%  4/4")
