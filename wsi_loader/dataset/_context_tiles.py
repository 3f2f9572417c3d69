"""Context tiles: per row and context scale, the window co-centred with the row's main
window, read beside it with the same retries and failure policy (the geometry is in
`wsi_loader.dataset._context`)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
import numpy.typing as npt

from wsi_loader.dataset._context import (
    Box,
    ContextPlan,
    Scale,
    fill_outside,
    main_centre,
    manifest_mpp,
    plan_context,
)
from wsi_loader.dataset._failures import ReadResult
from wsi_loader.dataset._retry import RetryPolicy
from wsi_loader.errors import ResolutionError, SlideError, TileReadError
from wsi_loader.slides._base import SlideMeta, level_to_l0


class ContextTiles(RetryPolicy):
    """Reads the context tiles of rows, for `TileReader` (its base class; the state is set by
    `TileReader.__init__`)."""

    context: list[Scale]
    _context_plans: dict[int, tuple[SlideMeta, list[ContextPlan]]]

    def _context_buffers(
        self, n: int, given: Sequence[npt.NDArray[np.uint8]] | None
    ) -> list[npt.NDArray[np.uint8]]:
        shapes = [(n, size, size, 3) for _, size in self.context]
        if given is None:
            return [np.empty(shape, dtype=np.uint8) for shape in shapes]
        found = [(tuple(a.shape), a.dtype) for a in given]
        if found != [(shape, np.dtype(np.uint8)) for shape in shapes]:
            raise ValueError(f"context_out must be uint8 buffers of shapes {shapes}, got {found}")
        return list(given)

    def _plans(self, slide_id: int) -> tuple[SlideMeta, list[ContextPlan]]:
        """The slide's meta (as this process's reader sees it) and its context plans. A slide
        that cannot serve a scale raises `ResolutionError`, a slide fault."""
        planned = self._context_plans.get(slide_id)
        if planned is None:
            meta = self.get_reader(slide_id).meta
            record = self.index.slides[slide_id]
            tolerance = float(self.index.params.get("mpp_tolerance", 0.1))
            try:
                plans = plan_context(meta, self.context, tolerance, manifest_mpp(record))
            except ResolutionError as exc:
                raise ResolutionError(str(exc), path=self._paths[slide_id]) from exc
            planned = self._context_plans[slide_id] = (meta, plans)
        return planned

    def context_windows(self, row: int) -> list[tuple[tuple[int, int, int, int, int], Box]]:
        """Per context scale, the window of index row ``row`` (slide id, level-0 x, y, level,
        window edge in level pixels) and its box on the slide (see `wsi_loader.dataset._context`).
        Opens the slide; raises `SlideError` when it cannot be read."""
        cols = self.index.columns
        slide_id = int(cols["slide_id"][row])
        meta, plans = self._plans(slide_id)
        x, y = int(cols["l0_x"][row]), int(cols["l0_y"][row])
        centre_x, centre_y = main_centre(
            meta, x, y, int(cols["level"][row]), int(cols["read_size"][row])
        )
        found = []
        for plan in plans:
            l_x, l_y = plan.place(centre_x, centre_y)
            l0_x, l0_y = level_to_l0(l_x, plan.downsample), level_to_l0(l_y, plan.downsample)
            found.append(
                ((slide_id, l0_x, l0_y, plan.level, plan.read_size), plan.inside(l_x, l_y))
            )
        return found

    def _context_windows(
        self, row: int, quiet: bool = False
    ) -> list[tuple[tuple[int, int, int, int, int], Box]]:
        """`context_windows`; with ``quiet``, none for a slide that cannot be read (the serial
        path reads it again and reports)."""
        try:
            return self.context_windows(row)
        except SlideError:
            if quiet:
                return []
            raise

    def _read_context_of(
        self, row: int, i: int, result: ReadResult, done: frozenset[int] = frozenset()
    ) -> None:
        """Read the context tiles of ``row`` into slot ``i`` (scales in ``done`` were read by
        the threads), fill what is off the slide, and note the boxes on it. A failed window
        raises `TileReadError` naming the scale."""
        assert result.context_inside is not None
        for k, (window, box) in enumerate(self.context_windows(row)):
            tile = result.context[k][i]
            if k not in done:
                try:
                    self._read_window(window, tile)
                except TileReadError as exc:
                    mpp, size = self.context[k]
                    raise TileReadError(
                        f"context tile {k + 1} ({size} px at {mpp:g} um/px): {exc}",
                        path=exc.path,
                        l0_x=exc.l0_x,
                        l0_y=exc.l0_y,
                        level=exc.level,
                        cause=f"context {mpp:g} um/px: {exc.cause or exc}",
                    ) from exc
            fill_outside(tile, box, self.fill_value)
            result.context_inside[i, k] = box

    def _read_contexts(
        self,
        rows: npt.NDArray[np.int64],
        order: list[int],
        result: ReadResult,
        faulted: dict[int, SlideError],
        done: set[tuple[int, int]],
    ) -> None:
        """Read the context tiles of every row whose main window was read (failed rows are
        filled; substituted ones were read with their substitute), with the failure policy."""
        threaded: dict[int, set[int]] = {}
        for i, k in done:
            threaded.setdefault(i, set()).add(k)
        slides = self.index.columns["slide_id"]
        for i in order:
            if not result.ok[i] or result.substituted[i]:
                continue
            row = int(rows[i])
            skip = frozenset(threaded.get(i, ()))
            self._read_into(
                row,
                (int(slides[row]), 0, 0, 0, 0),
                i,
                result,
                faulted,
                read=partial(self._read_context_of, row, i, result, skip),
            )
