"""CSV text of a table (per-client results, comparison tables), numbers to 6 significant digits
or, ``exact``, unrounded (the shortest text that reads back as the same float)."""

from __future__ import annotations

import csv
import io


def table_csv(header: list, rows: list[list], exact: bool = False) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(header)
    for row in rows:
        writer.writerow([(repr(v) if exact else f"{v:.6g}") if isinstance(v, float) else v for v in row])
    return out.getvalue()
