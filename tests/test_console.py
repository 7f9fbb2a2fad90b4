"""The one console commands print through: rich's wrapping on a terminal, whole lines anywhere else."""

import io

from rich.table import Table

from qlora_cli.core.console import OutputConsole

LONG_LINE = " ".join(f"word{i}" for i in range(40))  # 279 characters


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_lines_wrap_at_its_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    terminal = Terminal()
    OutputConsole(file=terminal, force_jupyter=False).print(LONG_LINE)
    lines = terminal.getvalue().splitlines()
    assert len(lines) >= len(LONG_LINE) / 60 and max(map(len, lines)) <= 60
    assert " ".join(lines).split() == LONG_LINE.split()


def test_into_a_file_lines_and_tables_keep_their_natural_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    file = io.StringIO()
    console = OutputConsole(file=file, force_jupyter=False)
    console.print(LONG_LINE)
    table = Table()
    for name in ("dataset", "rows"):
        table.add_column(name, overflow="fold")
    table.add_row(LONG_LINE, "9")
    console.print(table)
    lines = file.getvalue().splitlines()
    assert lines[0] == LONG_LINE
    assert lines[4] == f"│ {LONG_LINE} │ 9    │"
