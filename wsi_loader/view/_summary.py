"""`IndexSummary`: an index's slides as a table (tiles, MPP, read level, label, split, status,
error) with counts per label, for notebooks (HTML) and the terminal."""

from __future__ import annotations

import html
from typing import Any

from wsi_loader.index._table import SlideIndex


class IndexSummary:
    """Per-slide table (tiles, MPP, read level, label, status, error) and counts per label."""

    COLUMNS = (
        "slide_id",
        "path",
        "status",
        "tiles",
        "mpp",
        "read_level",
        "label",
        "split",
        "error",
        "warning",
    )

    def __init__(self, index: SlideIndex) -> None:
        self.index = index
        summary = index.summary()
        self.rows: list[dict[str, Any]] = [
            {k: s[k] for k in self.COLUMNS} for s in summary["slides"]
        ]
        self.label_counts: dict[str, dict[str, int]] = {}
        for s in summary["slides"]:
            entry = self.label_counts.setdefault(
                s["label"] or "(unlabelled)", {"slides": 0, "tiles": 0}
            )
            entry["slides"] += 1
            entry["tiles"] += s["tiles"] if s["status"] == "ok" else 0
        self.quarantined: dict[str, int] = summary["quarantine"]

    def __repr__(self) -> str:
        ok = sum(r["status"] == "ok" for r in self.rows)
        return (
            f"IndexSummary({len(self.rows)} slides, {ok} ok, {len(self.rows) - ok} failed, "
            f"{len(self.index)} tiles)"
        )

    def __str__(self) -> str:
        lines = [" ".join(f"{c:<10}" for c in self.COLUMNS)]
        for r in self.rows:
            lines.append(" ".join(f"{'' if r[c] is None else r[c]!s:<10}" for c in self.COLUMNS))
        lines.append(
            "per label: "
            + ", ".join(
                f"{k}: {v['slides']} slides / {v['tiles']} tiles"
                for k, v in self.label_counts.items()
            )
        )
        q = self.quarantined
        lines.append(f"quarantine: {q['tiles']} tile and {q['slides']} slide records")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.COLUMNS)
        body = "".join(
            "<tr>"
            + "".join(
                f"<td style='color:{'#b91c1c' if r['status'] == 'failed' else 'inherit'}'>"
                f"{html.escape('' if r[c] is None else str(r[c]))}</td>"
                for c in self.COLUMNS
            )
            + "</tr>"
            for r in self.rows
        )
        labels = "".join(
            f"<tr><td>{html.escape(k)}</td><td>{v['slides']}</td><td>{v['tiles']}</td></tr>"
            for k, v in self.label_counts.items()
        )
        return (
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
            f"<p><b>Per label</b></p><table><tr><th>label</th><th>slides</th><th>tiles</th>"
            f"</tr>{labels}</table><p>Quarantine: {self.quarantined['tiles']} tile and "
            f"{self.quarantined['slides']} slide records</p>"
        )
