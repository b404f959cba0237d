"""The block accounting of PyTorch's CUDA caching allocator, replayed on allocation sizes.

`torch.cuda.memory_allocated` counts allocated *blocks*, not requested bytes: a request is rounded
up to 512 bytes, and a cached block that is larger than the request is split only when the rest
is worth keeping (small pool: >= 512 bytes; large pool: > 1 MiB); otherwise the whole block is
handed out and counted. Which block a request gets depends on what was allocated and freed
before (best fit among the cached free blocks, else a new segment), so this class replays the
allocator's rules (c10/cuda/CUDACachingAllocator.cpp, default settings: no expandable segments,
no max_split_size, one stream) on the sequence of allocations and frees.
"""

from __future__ import annotations

from bisect import bisect_left, insort

MIN_BLOCK = 512  # kMinBlockSize: every block is a multiple of it
SMALL_SIZE = 1 << 20  # kSmallSize: requests up to 1 MiB use the small pool
SMALL_SEGMENT = 2 << 20  # kSmallBuffer
LARGE_SEGMENT = 20 << 20  # kLargeBuffer: segment for requests below MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger requests get a segment rounded to 2 MiB


def round_size(nbytes: int) -> int:
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def allocated_bytes(nbytes: int) -> int:
    """Bytes one request adds to `torch.cuda.memory_allocated` without block reuse (0 bytes
    allocate nothing)."""
    return round_size(nbytes) if nbytes > 0 else 0


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class CachingAllocator:
    """Blocks of the CUDA caching allocator; addresses are made up, sizes follow CUDA's rules."""

    def __init__(self):
        self.free_blocks = {True: [], False: []}  # small pool? -> sorted [(size, address)]
        self.blocks = {}  # address -> [size, is_free, small pool?]
        self.ending_at = {}  # end address -> address of the block that ends there
        self.segments = {}  # segment start -> segment end
        self.next_segment = 0

    def malloc(self, nbytes: int) -> tuple[int, int]:
        """Allocate `nbytes` (> 0); returns (address, block size counted as allocated)."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self.free_blocks[small]
        index = bisect_left(pool, (size, -1))
        if index < len(pool):
            block_size, address = pool.pop(index)
        else:
            block_size, address = segment_size(size), self.next_segment
            self.next_segment += block_size + ROUND_LARGE  # a gap: blocks of two segments never merge
            self.segments[address] = address + block_size
            self._place(address, block_size, small)
        remaining = block_size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            self._place(address, size, small)
            self._place(address + size, remaining, small)
            self.blocks[address + size][1] = True
            insort(pool, (remaining, address + size))
            block_size = size
        self.blocks[address][1] = False
        return address, block_size

    def free(self, address: int) -> int:
        """Free the block at `address` (merging it with free neighbours); returns its counted size."""
        size, _, small = self.blocks[address]
        merged_address, merged_size = address, size
        following = self.blocks.get(address + size)
        if following is not None and following[1]:
            self._unlist(address + size)
            merged_size += following[0]
            del self.blocks[address + size], self.ending_at[address + size]
        previous = self.ending_at.get(address)
        if previous is not None and self.blocks[previous][1]:
            self._unlist(previous)
            merged_address, merged_size = previous, merged_size + self.blocks[previous][0]
            del self.blocks[address], self.ending_at[address]
        self._place(merged_address, merged_size, small)
        self.blocks[merged_address][1] = True
        insort(self.free_blocks[small], (merged_size, merged_address))
        return size

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): give back every segment that is one free block."""
        for small, pool in self.free_blocks.items():
            keep = []
            for size, address in pool:
                if self.segments.get(address) == address + size:
                    del self.blocks[address], self.ending_at[address + size], self.segments[address]
                else:
                    keep.append((size, address))
            self.free_blocks[small] = keep

    def _place(self, address: int, size: int, small: bool) -> None:
        self.blocks[address] = [size, False, small]
        self.ending_at[address + size] = address

    def _unlist(self, address: int) -> None:
        size, _, small = self.blocks[address]
        pool = self.free_blocks[small]
        del pool[bisect_left(pool, (size, address))]
