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


def test_the_tour_has_commands():
    assert len(tour_commands()) >= 2


@pytest.mark.parametrize(("page", "command"), tour_commands())
def test_tour_command_runs(page, command, tmp_path, monkeypatch, smollm2, capsys):
    argv = shlex.split(command)[1:]
    if "--plot" in argv:
        pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)  # out/ and the like land here
    assert main(argv) == 0, capsys.readouterr().err
    if "--plot" in argv:
        out = tmp_path / argv[argv.index("--plot") + 1]
        assert sorted(p.name for p in out.glob("*.png")) == [
            "pages.png",
            "timeline.png",
            "tokens.png",
        ]
