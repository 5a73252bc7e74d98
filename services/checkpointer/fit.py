"""Does a checkpoint's model state fit a model? One answer for every reader of whole weights: the trainer's
`checkpoint.init_from` and the HF conversion command line.

A fit is judged by names and element counts, not shapes: an ETP-saved `w13` is [E, h, 2, f] for [E, h, 2f], the same
bytes (see checkpointing._read_whole). The first mismatch is named, and the model-config fields in which the run that
wrote the checkpoint differed say why, so the user learns which setting to change.
"""

from __future__ import annotations

import math
from typing import Any


def state_mismatch(saved: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> str | None:
    """Why the state whose shapes are `saved` is not the model whose shapes are `expected`, or None when it is:
    a tensor of another size first (the most telling), then one the state lacks, then one the model lacks."""
    wrong = [k for k in expected if k in saved and math.prod(saved[k]) != math.prod(expected[k])]
    if wrong:
        return f"{wrong[0]!r} is {list(saved[wrong[0]])} there but {list(expected[wrong[0]])} in this model"
    missing = sorted(set(expected) - set(saved))
    if missing:
        return f"it has no {missing[0]!r}{f' (nor {len(missing) - 1} more)' if len(missing) > 1 else ''}"
    extra = sorted(set(saved) - set(expected))
    if extra:
        return f"it holds {extra[0]!r}{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}, which this model lacks"
    return None


def config_diff(recorded: dict[str, Any] | None, mine: dict[str, Any]) -> list[str]:
    """`model.<key>=<there> there, <here> here` for each model-config field the checkpoint's run recorded otherwise."""
    if not recorded:
        return []
    return [f"model.{k}={recorded[k]!r} there, {v!r} here" for k, v in mine.items() if k in recorded and recorded[k] != v]


def diff_hint(recorded: dict[str, Any] | None, mine: dict[str, Any]) -> str:
    """`config_diff` as the tail of an error message ("" when the runs agree or nothing was recorded)."""
    diff = config_diff(recorded, mine)
    return f"; the checkpoint's run had {', '.join(diff)}" if diff else ""
