"""JSON Lines records, read one line at a time: the corpus reader and the RL prompt reader both take them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator


class JSONLError(ValueError):
    """A line that is not JSON; the message names the file and line."""


def jsonl_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for every non-blank line of `path`, streamed. Opening or decoding the file raises
    OSError / UnicodeDecodeError as `open` does; a line that is not JSON raises JSONLError naming `path:line`."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise JSONLError(f"{path}:{lineno} is not valid JSON ({e})") from None
