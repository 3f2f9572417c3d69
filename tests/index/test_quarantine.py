"""The quarantine file: records appended under a lock, validated when read, matched by tile."""

from __future__ import annotations

import threading
from pathlib import Path

from wsi_loader.index.quarantine import Quarantine


def _tile(x: int) -> dict[str, object]:
    return {"slide_id": 0, "path": "a.svs", "x": x, "y": 0, "level": 0, "error": "bad"}


def test_an_append_during_a_rewrite_is_not_lost(tmp_path: Path) -> None:
    """`rewrite` (quarantine --clear / --retry) replaces the file under the writers' lock; a
    worker appending meanwhile waits for it, so its record lands in the new file. Without the
    lock it went to the replaced file and was lost (a mutant the other tests let live)."""
    q = Quarantine(tmp_path / "quarantine.jsonl")
    q.append(_tile(1))
    writer = threading.Thread(target=lambda: Quarantine(q.path).append(_tile(2)))

    def keep(record: dict[str, object]) -> bool:
        if writer.ident is None:  # the file is read, not yet replaced
            writer.start()
            writer.join(timeout=1.0)  # it waits for the lock (or, without one, appends now)
        return False

    assert q.rewrite(keep) == (0, 1)
    writer.join(timeout=30)
    assert [r["x"] for r in q.read()] == [2]
