"""Forward passes that can pause while a transfer is in flight, so that another micro-batch computes meanwhile.

A module called with `staged=True` returns a generator instead of its output: it runs its forward up to the point where
it has launched an asynchronous transfer it will need later (the expert-parallel all-to-all), yields, and finishes when
resumed; its return value is the module's output. `run_to_end` is the ordinary forward (every pause ignored);
`interleave` advances several such forwards in turn, so that one micro-batch's tokens travel while the other's layers
compute (`parallel.ep_overlap`, services/trainer/parallel/micro_batch_pairs.py).

Everything runs on the calling thread, in one deterministic order on every rank: the collectives of the interleaved
forwards are issued in the same sequence everywhere, and autograd numbers the nodes in the order they were created, so
backward (which runs them newest first) interleaves the micro-batches the same way, mirrored.
"""

from __future__ import annotations

from typing import Callable, Generator, TypeVar

T = TypeVar("T")
Stages = Generator[None, None, T]


def run_to_end(stages: Stages[T]) -> T:
    """The forward of `stages` without pausing: its return value."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value


def interleave(stages: list[Stages], before_resume: list[Callable[[], None]] | None = None) -> list:
    """Advance each generator in turn to its next pause until all have returned; their return values, in order.
    `before_resume[i]()` runs before every resumption of generator i (e.g. to bind its micro-batch's layout)."""
    results: list = [None] * len(stages)
    live = list(range(len(stages)))
    while live:
        for i in list(live):
            if before_resume is not None:
                before_resume[i]()
            try:
                next(stages[i])
            except StopIteration as done:
                results[i] = done.value
                live.remove(i)
    return results
