"""Every command in docs/tour/ runs, as written, so the tour never goes stale.

The fenced `bash` blocks of each page are read; each `pagedllm ...` command
(continuation lines joined) runs in-process through `pagedllm.cli.main` on the
default model, with `out/` pointed at a temporary directory. It must exit 0;
a page's pictures must then exist.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pagedllm.cli import main

TOUR = Path(__file__).resolve().parents[1] / "docs" / "tour"


def tour_commands() -> list[tuple[str, str]]:
    found = []
    for page in sorted(TOUR.glob("*.md")):
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            for command in block.replace("\\\n", " ").splitlines():
                command = command.split("  #")[0].strip()
                if command.startswith("pagedllm "):
                    found.append((page.name, command))
    return found


STEPS_ROW = re.compile(r"^engine steps \(all-decode\) +(\d+ \(\d+\))$", flags=re.M)


def quoted_step_rows(page: str) -> set[str]:
    """The `engine steps (all-decode)` values a page quotes from `--stats`."""
    return set(STEPS_ROW.findall((TOUR / page).read_text()))


def test_the_batching_chapter_quotes_the_steps_its_table_counts():
    """Chapter 11 once said `--stats` had no step counts (issue 33, item 16): it has
    them, and the chapter's table and its quoted `--stats` rows agree."""
    text = (TOUR / "11-batching.md").read_text()
    table = re.search(r"\| steps for all three \| (\d+) \| (\d+) \|", text)
    assert table is not None
    rows = STEPS_ROW.findall(text)  # continuous, then static
    assert [row.split()[0] for row in rows] == [table[1], table[2]]
    assert "does not print" not in text


def test_the_tour_has_commands():
    assert len(tour_commands()) >= 2


@pytest.mark.parametrize(("page", "command"), tour_commands())
def test_tour_command_runs(page, command, tmp_path, monkeypatch, smollm2, capsys):
    argv = shlex.split(command)[1:]
    if "--plot" in argv:
        pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)  # out/ and the like land here
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    quoted = quoted_step_rows(page)
    if "--stats" in argv and quoted and ("\n" + command[:40]) in (TOUR / page).read_text():
        # A page that quotes `--stats`' step rows quotes what its (unindented) commands print.
        printed = STEPS_ROW.findall(out)
        assert printed and printed[-1] in quoted, (printed, quoted)
    if "--plot" in argv:
        out = tmp_path / argv[argv.index("--plot") + 1]
        assert sorted(p.name for p in out.glob("*.png")) == [
            "pages.png",
            "timeline.png",
            "tokens.png",
        ]
