"""Counting the aten ops a piece of code runs (a TorchDispatchMode): for op-count invariants such as "a render
tick runs as many ops for 16 streams as for 1"."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch: untyped __init_subclass__
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch: TorchDispatchMode.__init__ is untyped
        self.ops: Counter[str] = Counter()  # by op ("aten.mul")
        self.overloads: Counter[str] = Counter()  # by overload ("aten.mul.Tensor")

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        self.overloads[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@contextlib.contextmanager
def count_ops() -> Iterator[OpCounter]:
    counter = OpCounter()
    with counter:
        yield counter
