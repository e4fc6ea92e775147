"""Reference counts over a pool's blocks and the LRU queue of its unreferenced ones, which
the device block pool and the host block pool share. What a block holds (a cached prefix,
a published host copy) is the pool's to track; the queue only orders the free blocks:

    free queue: [empty ... | holding data (least recently freed) ... (newest)]
                 ^ allocate from here
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator


class FreeQueue:
    def __init__(self, num_blocks: int, first: int, what: str) -> None:
        """Blocks ``first`` to ``num_blocks - 1`` start free, ``what`` names them in errors."""
        self.what = what
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(first, num_blocks))
        self.num_active = 0

    def __len__(self) -> int:
        return len(self._free)

    def __contains__(self, block: int) -> bool:
        return block in self._free

    def __iter__(self) -> Iterator[int]:
        """The free blocks, front first (a copy: the caller may change the queue)."""
        return iter(list(self._free))

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def referenced(self) -> list[int]:
        return [block for block, ref in enumerate(self._ref) if ref]

    def allocate(self, n: int) -> list[int]:
        """n blocks off the front, referenced once each; the caller drops what they held."""
        if n > len(self._free):
            raise RuntimeError(f"allocate({n}) with only {len(self._free)} free {self.what}s")
        blocks = [self._free.popitem(last=False)[0] for _ in range(n)]
        for block in blocks:
            self._ref[block] = 1
        self.num_active += n
        return blocks

    def ref(self, blocks: Iterable[int]) -> None:
        """Take a reference on each block, out of the queue if it was free."""
        for block in blocks:
            if self._ref[block] == 0:
                del self._free[block]
                self.num_active += 1
            self._ref[block] += 1

    def unref(self, block: int) -> bool:
        """Drop one reference; True when it was the last: the caller queues the block."""
        ref = self._ref[block] - 1
        if ref < 0:
            raise RuntimeError(f"double free of {self.what} {block}")
        self._ref[block] = ref
        if ref:
            return False
        self.num_active -= 1
        return True

    def push_empty(self, block: int) -> None:
        """Queue a block that holds nothing at the front: handed out first."""
        self._free[block] = None
        self._free.move_to_end(block, last=False)

    def push_recent(self, block: int) -> None:
        """Queue a block that holds data at the back: the most recently freed."""
        self._free[block] = None
