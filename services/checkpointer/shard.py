"""What a trainer rank hands the checkpointer: its local piece of a named global tensor, and where that piece sits.

The checkpointer knows nothing about models or parallel layouts: every saved thing is a global tensor cut into boxes.
A rank describes its box by `offsets` (first element's global index) and the piece's own shape; any later layout can
read any box back (see `load.Checkpoint.read`). A rank that holds several boxes of one tensor (a ZeRO-1 flat range of a
parameter cuts it into up to 2·ndim - 1 boxes) hands them under piece keys, `piece_key(name, i)`; the manifest lists
them under the tensor's name (`tensor_name`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Shard:
    tensor: torch.Tensor  # this rank's local piece
    global_shape: tuple[int, ...] | None = None  # None: the piece is the whole tensor
    offsets: tuple[int, ...] | None = None  # None: all zeros
    replicated: bool = False  # identical copies live on several ranks (e.g. DP replicas)
    writer: bool = True  # for a replicated shard: whether this rank's copy is the one written

    def __post_init__(self) -> None:
        shape = tuple(self.tensor.shape)
        self.global_shape = tuple(int(s) for s in (shape if self.global_shape is None else self.global_shape))
        self.offsets = tuple(int(o) for o in ((0,) * len(shape) if self.offsets is None else self.offsets))

    @property
    def written(self) -> bool:
        return self.writer or not self.replicated

    def check(self, name: str) -> None:
        """Reject a box that does not fit its global tensor, naming the tensor."""
        shape = tuple(self.tensor.shape)
        if not (len(shape) == len(self.global_shape) == len(self.offsets)):
            raise ValueError(f"shard {name!r}: piece shape {list(shape)}, global_shape {list(self.global_shape)} and "
                             f"offsets {list(self.offsets)} must have the same number of dimensions")
        for d, (s, g, o) in enumerate(zip(shape, self.global_shape, self.offsets)):
            if o < 0 or o + s > g:
                raise ValueError(f"shard {name!r}: dimension {d} covers [{o}, {o + s}) which is outside the global "
                                 f"size {g}; fix the offsets or global_shape the trainer passes")
        if not self.replicated and not self.writer:
            raise ValueError(f"shard {name!r} is held by this rank only (replicated=False) so it must be written "
                             "(writer=True)")


PIECE = "#"  # never in a parameter's name


def piece_key(name: str, index: int) -> str:
    """The key of a rank's `index`-th box of tensor `name`, when it hands several."""
    return f"{name}{PIECE}{index}"


def tensor_name(key: str) -> str:
    """The tensor a shard key names: the key itself, or the name a `piece_key` was made from."""
    return key.split(PIECE, 1)[0]


def as_shard(value: torch.Tensor | Shard) -> Shard:
    """A plain tensor is a full, unsharded tensor."""
    return value if isinstance(value, Shard) else Shard(value)
