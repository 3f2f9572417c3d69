"""Write docs/changelog.md from the git history: one section per round (a day of work), newest
first, each change the subject of a commit on the main line (merges name what a branch
brought). A round may open with a hand-written summary of what landed, for users:
``docs/_gen/rounds/<day>.md``, placed under its heading (merges of unnamed branches say
little). Run by `make changelog` when a round is merged; the page is committed, so the
site builds without the history (a shallow clone)."""

from __future__ import annotations

import html
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIMIT = 240  # characters of a subject shown
SUMMARIES = REPO / "docs" / "_gen" / "rounds"  # <day>.md: a round's summary, above its commits


def main() -> int:
    log = subprocess.run(
        ["git", "log", "--first-parent", "--format=%ad%x09%h%x09%s", "--date=short"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rounds: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for line in log.splitlines():
        day, commit, subject = line.split("\t", 2)
        rounds[day].append((commit, subject))
    days = sorted(rounds)
    out = [
        "# Changelog",
        "",
        "The changes of each round of work (a day), newest first: the subjects of the commits "
        "on the main line, merges first. Generated from the git history by "
        "`make changelog` (`docs/_gen/changelog.py`).",
        "",
    ]
    for number, day in reversed(list(enumerate(days, start=1))):
        commits = rounds[day]
        merges = [c for c in commits if c[1].startswith("Merge ")]
        others = [c for c in commits if not c[1].startswith("Merge ")]
        out += [f"## Round {number} ({day})", ""]
        summary = SUMMARIES / f"{day}.md"
        if summary.exists():
            out += [summary.read_text(encoding="utf-8").strip(), "", "The commits:", ""]
        for commit, subject in merges + others:
            text = subject if len(subject) <= LIMIT else subject[: LIMIT - 3].rstrip() + "..."
            text = (
                html.escape(text, quote=False)
                .replace("*", "\\*")
                .replace("_", "\\_")
                .replace("`", "\\`")
            )
            out.append(f"- {text} (`{commit}`)")
        out.append("")
    (REPO / "docs" / "changelog.md").write_text("\n".join(out), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
