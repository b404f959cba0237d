"""The block accounting of PyTorch's CUDA caching allocator, replayed on allocation sizes.

`torch.cuda.memory_allocated` counts allocated *blocks*, not requested bytes: a request is rounded
up to 512 bytes, and a cached block that is larger than the request is split only when the rest
is worth keeping (small pool: >= 512 bytes; large pool: > 1 MiB); otherwise the whole block is
handed out and counted. Which block a request gets depends on what was allocated and freed
before (best fit among the cached free blocks, else a new segment), so this class replays the
allocator's rules (c10/cuda/CUDACachingAllocator.cpp, default settings: no expandable segments,
no max_split_size) on the sequence of allocations and frees. Each stream has pools of its own: a segment
belongs to the stream whose request made it, and only that stream's requests reuse its blocks (FSDP2
all-gathers and reduce-scatters on streams of its own; `stream` names one, 0 the default stream).

`torch.cuda.memory_reserved` is the sum of the segments (cudaMalloc'd memory). Within a training step
nothing gives a segment back but `torch.cuda.empty_cache()` and a failed cudaMalloc, which frees the
cached segments and retries: at the edge of out-of-memory. With a `capacity` (what the process may
reserve on its device) the replay does the same: a segment that would not fit first gives the free
cached segments back; if it still does not fit, `out_of_memory` is set (the replay goes on, so the
reserved peak says by how much). `ExpandableSegments` replays
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` instead: one segment per pool, grown at its end
in pages of 2 MiB (small pool) or 20 MiB (large pool) as the source's `SegmentRange` maps them, the pages
of free blocks unmapped at the capacity's retry and by `empty_cache`.
"""

from __future__ import annotations

import copy
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

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self.out_of_memory = False
        self.peak = 0  # the largest `reserved`
        self.free_blocks = {}  # (stream, small pool?) -> sorted [(size, address)]
        self.blocks = {}  # address -> [size, is_free, (stream, small pool?)]
        self.ending_at = {}  # end address -> address of the block that ends there
        self.segments = {}  # segment start -> segment end
        self.next_segment = 0
        self.reserved = 0  # sum of the segments
        self.trace = None  # a list: the malloc/free events are recorded there (see `replay`)
        self.whole_free = set()  # addresses of free blocks that are a whole segment (what empty_cache gives back)

    def malloc(self, nbytes: int, stream=0) -> tuple[int, int]:
        """Allocate `nbytes` (> 0) on `stream`; returns (address, block size counted as allocated)."""
        size = MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK  # round_size
        small = size <= SMALL_SIZE
        key = (stream, small)
        pool = self.free_blocks.get(key)
        if pool is None:
            pool = self.free_blocks[key] = []
        index = bisect_left(pool, (size, -1))
        if index < len(pool):
            block_size, address = pool.pop(index)
            if self.whole_free:
                self.whole_free.discard(address)
        else:
            address, block_size = self._grow(size, key)
        if self.trace is not None:
            self.trace.append((address, nbytes))
        remaining = block_size - size
        blocks = self.blocks
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = address + size
            blocks[address] = [size, False, key]
            self.ending_at[rest] = address
            blocks[rest] = [remaining, True, key]
            self.ending_at[rest + remaining] = rest
            insort(pool, (remaining, rest))
            return address, size
        blocks[address][1] = False
        return address, block_size

    def _grow(self, size: int, key: tuple) -> tuple[int, int]:
        """A new segment of pool `key` for a request that no cached block fits: (address, block size)."""
        block_size, address = segment_size(size), self.next_segment
        if self.capacity is not None and self.reserved + block_size > self.capacity:
            self.empty_cache()  # the allocator's retry after a failed cudaMalloc
            self.out_of_memory |= self.reserved + block_size > self.capacity
        self.next_segment += block_size + ROUND_LARGE  # a gap: blocks of two segments never merge
        self.segments[address] = address + block_size
        self.reserved += block_size
        self.peak = max(self.peak, self.reserved)
        self._place(address, block_size, key)
        return address, block_size

    def free(self, address: int) -> int:
        """Free the block at `address` (merging it with free neighbours); returns its counted size."""
        if self.trace is not None:
            self.trace.append((address, None))
        blocks, ending_at = self.blocks, self.ending_at
        block = blocks[address]
        size, key = block[0], block[2]
        merged_address, merged_size = address, size
        end = address + size
        following = blocks.get(end)
        if following is not None and following[1]:
            self._unlist(end)
            merged_size += following[0]
            del blocks[end], ending_at[end]
        previous = ending_at.get(address)
        if previous is not None and blocks[previous][1]:
            self._unlist(previous)
            merged_address, merged_size = previous, merged_size + blocks[previous][0]
            del blocks[address], ending_at[address]
        blocks[merged_address] = [merged_size, True, key]
        ending_at[merged_address + merged_size] = merged_address
        insort(self.free_blocks[key], (merged_size, merged_address))
        if self.segments.get(merged_address) == merged_address + merged_size:
            self.whole_free.add(merged_address)
        return size

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): give back every segment that is one free block."""
        for address in self.whole_free:
            size = self.blocks[address][0]
            self._unlist(address)  # in place: a malloc in progress holds the pool's list
            del self.blocks[address], self.ending_at[address + size], self.segments[address]
            self.reserved -= size
        self.whole_free.clear()

    def copy(self) -> CachingAllocator:
        """An independent copy of the allocator's state (the trace left out)."""
        twin = copy.copy(self)
        twin.free_blocks = {key: list(pool) for key, pool in self.free_blocks.items()}
        twin.blocks = {address: list(block) for address, block in self.blocks.items()}
        twin.ending_at, twin.segments, twin.whole_free = dict(self.ending_at), dict(self.segments), set(self.whole_free)
        twin.trace = None
        return twin

    def replay(self, trace: list, addresses: dict | None = None) -> dict:
        """Run recorded events again from the current state: `(address, nbytes)` allocates,
        `(address, None)` frees what the event that allocated `address` got here (frees of blocks
        allocated before the trace are skipped). Returns the address map, to go on with a next
        trace in the same step."""
        addresses = {} if addresses is None else addresses
        for address, nbytes in trace:
            if nbytes is not None:
                addresses[address] = self.malloc(nbytes)[0]
            elif address in addresses:
                self.free(addresses.pop(address))
        return addresses

    def _place(self, address: int, size: int, key: tuple) -> None:
        self.blocks[address] = [size, False, key]
        self.ending_at[address + size] = address

    def _unlist(self, address: int) -> None:
        size, _, key = self.blocks[address]
        pool = self.free_blocks[key]
        del pool[bisect_left(pool, (size, address))]


PAGE = {True: SMALL_SEGMENT, False: LARGE_SEGMENT}  # expandable segments map 2 / 20 MiB pages


class ExpandableSegments(CachingAllocator):
    """The caching allocator with `expandable_segments:True`: per pool (and stream) one segment of virtual
    addresses that grows at its end; a block's pages (2 MiB in the small pool, 20 MiB in the large) are mapped
    when a block needs them, and stay mapped when it is freed. reserved = the mapped pages. At the `capacity`
    (a page that would not fit) the allocator unmaps every page that lies wholly inside a free block and tries
    again (`release_cached_blocks`: `unmap_block` of each free block), as `empty_cache()` does."""

    def __init__(self, capacity: int | None = None):
        super().__init__(capacity)
        self.end, self.start = {}, {}  # (stream, small pool?) -> its segment's end and start
        self.mapped = {}  # (stream, small pool?) -> indices of its mapped pages

    def malloc(self, nbytes: int, stream=0) -> tuple[int, int]:
        address, size = super().malloc(nbytes, stream)
        key = self.blocks[address][2]
        pages = self.mapped.setdefault(key, set())
        first, last = self._pages(key, address, address + size)
        needed = [page for page in range(first, last) if page not in pages]
        if needed:
            grown = len(needed) * PAGE[key[1]]
            if self.capacity is not None and self.reserved + grown > self.capacity:
                self.empty_cache()  # the allocator's retry: unmap the free blocks' pages
                self.out_of_memory |= self.reserved + grown > self.capacity
            pages.update(needed)
            self.reserved += grown
            self.peak = max(self.peak, self.reserved)
        return address, size

    def _pages(self, key: tuple, begin: int, end: int) -> tuple[int, int]:
        """[first, last) pages of the pool `key` that cover the addresses [begin, end)."""
        page, start = PAGE[key[1]], self.start[key]
        return (begin - start) // page, -(-(end - start) // page)

    def _grow(self, size: int, key: tuple) -> tuple[int, int]:
        if key not in self.end:  # each pool's segment in an address range of its own
            self.start[key] = self.end[key] = len(self.end) << 56
        address = self.ending_at.get(self.end[key])
        if address is not None and self.blocks[address][1]:
            self._unlist(address)
            del self.blocks[address], self.ending_at[self.end[key]]
        else:
            address = self.end[key]
        self.end[key] = address + size
        self._place(address, size, key)
        return address, size

    def empty_cache(self) -> None:
        """Unmap the pages that lie wholly inside free blocks (the segments' addresses stay)."""
        for address, (size, free, key) in self.blocks.items():
            if not free:
                continue
            page, start = PAGE[key[1]], self.start[key]
            first, last = -(-(address - start) // page), (address + size - start) // page
            pages = self.mapped.get(key, set())
            unmapped = [p for p in range(first, last) if p in pages]
            pages.difference_update(unmapped)
            self.reserved -= len(unmapped) * page
        self.whole_free.clear()

    def copy(self) -> ExpandableSegments:
        twin = super().copy()
        twin.end, twin.start = dict(self.end), dict(self.start)
        twin.mapped = {key: set(pages) for key, pages in self.mapped.items()}
        return twin


class Fanout:
    """Several allocators fed the same requests (the tracker's reserved replays): an address is the
    tuple of their addresses."""

    def __init__(self, allocators):
        self.allocators = list(allocators)

    def malloc(self, nbytes: int, stream=0) -> tuple[tuple, None]:
        return tuple([a.malloc(nbytes, stream)[0] for a in self.allocators]), None

    def free(self, addresses: tuple) -> None:
        for allocator, address in zip(self.allocators, addresses):
            allocator.free(address)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache() in each allocator (the expandable segments unmap their free pages)."""
        for allocator in self.allocators:
            allocator.empty_cache()

    def record(self) -> None:
        for allocator in self.allocators:
            allocator.trace = []

    def stop(self) -> list:
        traces = [a.trace for a in self.allocators]
        for allocator in self.allocators:
            allocator.trace = None
        return traces


def later_steps_reserved(allocator: CachingAllocator, forward: list, backward: list, optimizer: list,
                         ids: int | None, loss: int | None, steps: int = 2) -> int:
    """Reserved bytes after `steps` more training steps, from `allocator`'s state after the first.

    Later steps make the first step's requests again (the recorded traces), but into segments laid
    out by the first step and with the optimizer state now in some of them, so they may need more.
    `ids` and `loss` are the addresses of the step's token ids and loss (alive at the end of a step,
    allocated in `forward`): the previous step's ids are freed once the new ones exist (the first
    request of the forward), its loss once the new forward is done. Works on a copy."""
    allocator = allocator.copy()
    ids_event, loss_event = ids, loss
    for _ in range(steps):
        addresses = allocator.replay(forward[:1])
        if ids is not None:
            allocator.free(ids)
        allocator.replay(forward[1:], addresses)
        if loss is not None:
            allocator.free(loss)
        allocator.replay(backward + optimizer, addresses)
        ids, loss = addresses.get(ids_event), addresses.get(loss_event)
    return max(allocator.reserved, getattr(allocator, "peak", 0))
