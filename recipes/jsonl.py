"""Reading a user's JSONL file: every mistake is one UserError naming the file, the line and what it must hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tinkerq.errors import UserError


def read_objects(path: Path, *, where: str, needs: str) -> list[tuple[int, dict[str, Any]]]:
    """The JSON objects of ``path``, one per non-blank line, with their line numbers.

    ``where`` names the file in errors (e.g. ``--train data.jsonl``); ``needs`` says what the file must hold.
    """
    if not Path(path).is_file():
        raise UserError(f"{where}: no such file; pass {needs}")
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{where}: cannot read it ({exc}); pass {needs}") from None
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}, line {lineno}: not JSON ({exc.msg}); pass {needs}") from None
        if not isinstance(row, dict):
            raise UserError(f"{where}, line {lineno}: a JSON {type(row).__name__}, not an object; pass {needs}")
        rows.append((lineno, row))
    if not rows:
        raise UserError(f"{where} holds no rows; pass {needs}")
    return rows
