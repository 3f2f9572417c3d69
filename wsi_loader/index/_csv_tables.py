"""Reading the CSV tables users give (manifests, labels files, annotation and mask tables):
the field separator found from the header, a UTF-8 BOM dropped, a misspelt column refused,
errors naming the file and line.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass

from wsi_loader.config import close_key
from wsi_loader.errors import InputError, SlideError
from wsi_loader.slides.storage._sources import is_url, read_range, remote_stat

# field separators of CSVs in the wild: ',' and, from spreadsheets in locales whose decimal
# mark is a comma, ';'; tabs from copied sheets and R's write.table
CSV_DELIMITERS = (",", ";", "\t")
# a column this close to one a table reads is a misspelling of it (difflib's ratio: 'lable'
# 0.8, 'splt' 0.89 of 'label', 'split'); 0.75 leaves a spreadsheet's own columns alone
# ('slide' is 0.6 of 'split', 'map' 0.67 of 'mpp')
MISSPELT_COLUMN = 0.75


def _csv_text(path: str) -> io.StringIO:
    """A CSV file's text (a local file or a URL), decoded as UTF-8 (a BOM is dropped)."""
    if is_url(path):
        data = read_range(path, 0, remote_stat(path).size)
    else:
        with open(path, "rb") as fh:
            data = fh.read()
    return io.StringIO(data.decode("utf-8-sig"), newline="")


@dataclass(frozen=True)
class CsvTable:
    """A CSV's rows (line number, stripped cells by stripped lower-case column name) and the
    field separator its header was found with."""

    rows: list[tuple[int, dict[str, str]]]
    delimiter: str


def _names(header: list[str]) -> list[str]:
    """Column names as matched: spreadsheet users write 'Slide' and 'Label' too."""
    return [name.lower() for name in header]


def _delimiter(text: str, required: Sequence[str]) -> tuple[str, list[str]]:
    """The first of `CSV_DELIMITERS` that splits the header into a required column, and that
    header; the comma's header when none does."""
    headers = []
    for delimiter in CSV_DELIMITERS:
        first = next(csv.reader(io.StringIO(text, newline=""), delimiter=delimiter), [])
        header = [h.strip() for h in first]
        if any(col in _names(header) for col in required):
            return delimiter, header
        headers.append(header)
    return ",", headers[0]


def _check_spelling(header: list[str], known: Sequence[str], path: str) -> None:
    """Refuse a column that is not one of ``known`` but close to one: read as it is, it
    would be ignored and its values lost without a word (every slide unlabelled)."""
    for name in _names(header):
        if name not in known:
            hint = close_key(name, known, cutoff=MISSPELT_COLUMN)
            if hint:
                raise InputError(
                    f"unknown column {name!r}{hint}; the columns read are {', '.join(known)}",
                    path=path,
                )


def read_csv_table(path: str, required: Sequence[str], known: Sequence[str] = ()) -> CsvTable:
    """A CSV with a header naming at least one of ``required``, separated by ',', ';' or
    tabs (found from the header); a UTF-8 BOM is dropped. Errors name the file and line.
    A column close to one of ``known`` (the columns the caller reads) but not one is an
    error; other columns are the user's own and are left alone."""
    try:
        with _csv_text(path) as fh:
            delimiter, header = _delimiter(fh.getvalue(), required)
            if not header:
                raise InputError("empty CSV (no header row)", path=path)
            _check_spelling(header, known, path)
            if not any(col in _names(header) for col in required):
                raise InputError(
                    f"header {header} has none of the required columns {list(required)} "
                    "(fields separated by ',', ';' or tabs)",
                    path=path,
                )
            first: dict[str, str] = {}
            for name in header:
                if name.lower() in first:
                    raise InputError(
                        f"columns {first[name.lower()]!r} and {name!r} are the same column "
                        "(names are matched whatever their case)",
                        path=path,
                    )
                first[name.lower()] = name
            reader = csv.DictReader(fh, delimiter=delimiter)
            rows = []
            for row in reader:
                if None in row:
                    raise InputError(
                        f"{len(header) + len(row[None])} fields where the header has {len(header)}",
                        path=path,
                        line=reader.line_num,
                    )
                rows.append(
                    (
                        reader.line_num,
                        {k.strip().lower(): (v or "").strip() for k, v in row.items()},
                    )
                )
            return CsvTable(rows, delimiter)
    except UnicodeDecodeError as exc:
        raise InputError(
            f"not UTF-8 text: {exc.reason} at byte {exc.start} (in Excel, save it as 'CSV UTF-8')",
            path=path,
        ) from exc
    except csv.Error as exc:
        raise InputError(f"malformed CSV: {exc}", path=path) from exc
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", path=path) from exc
    except SlideError as exc:  # a manifest URL that cannot be fetched
        raise InputError(f"cannot read: {exc}", path=path) from exc


def read_csv_rows(
    path: str, required: Sequence[str], known: Sequence[str] = ()
) -> list[tuple[int, dict[str, str]]]:
    """The rows of `read_csv_table`."""
    return read_csv_table(path, required, known).rows
