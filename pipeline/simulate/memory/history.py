"""The allocator replay fed a real process's requests: a recorded allocator history (`training.memory_history`:
every malloc and free of a measured point, its stream, and where `empty_cache` was called) run through
`CachingAllocator` with the device's capacity. Where the replay of the real requests gives the real reserved
bytes, the replay's rules (block sizes, splitting, pools per stream, the retry at capacity) are the allocator's;
what is left between a simulated answer and the measurement is then in the requests the simulation makes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.simulate.memory.allocator import CachingAllocator, ExpandableSegments, segment_size


@dataclass
class Replayed:
    """What the replay of a history gives, beside what the real allocator recorded."""

    peak_reserved: int  # the replay's largest reserved bytes within the window (the measurement's peak counter's)
    real_peak_reserved: int  # the real allocator's, from its own segment events, within the same window
    retries: int  # times the replay gave its cached segments back at the capacity, within the window
    real_freed: int  # segments the real allocator gave back outside explicit empty_cache calls, within the window
    out_of_memory: bool
    real_out_of_memory: bool
    # the replay's segments by stream at its peak (the default allocator's; empty with expandable segments)
    reserved_by_stream: dict = field(default_factory=dict)


class Counting(CachingAllocator):
    """The caching allocator, counting its retries at the capacity (`CachingAllocator._grow` makes them)."""

    retries = 0

    def _grow(self, size: int, key: tuple) -> tuple[int, int]:
        if self.capacity is not None and self.reserved + segment_size(size) > self.capacity:
            self.retries += 1
        return super()._grow(size, key)


def window(history: dict) -> tuple[int, int]:
    """(first, end) event indices of the measured steps: from the last "setup" mark before the first "forward"
    (where the measurement resets its peak counters as training begins) to the "train_end" mark (or the end)."""
    marks = history["meta"]["marks"]
    forward = next((index for name, index in marks if name == "forward"), len(history["action"]))
    start = max((index for name, index in marks if name == "setup" and index <= forward), default=0)
    end = next((index for name, index in marks if name == "train_end"), len(history["action"]))
    return start, end


def replay(history: dict, capacity: int | None = None, expandable: bool = False) -> Replayed:
    """The history's requests from the process's start, through the replay (`capacity`: the bytes the process
    may reserve, None for no edge); the peaks are taken within `window(history)`."""
    allocator = ExpandableSegments(capacity) if expandable else Counting(capacity)
    start, end = window(history)
    empties = {index for name, index in history["meta"]["marks"] if name == "empty_cache"}
    live, peak, real, real_peak, real_freed, oom, retries_before = {}, 0, 0, 0, 0, False, 0
    explicit = False  # within the segment frees of an explicit empty_cache call
    by_stream = {}
    actions, addresses, sizes, streams = history["action"], history["addr"], history["size"], history["stream"]
    for index in range(min(end, len(actions))):
        if index in empties:
            explicit = True
            allocator.empty_cache()
        action = actions[index]
        if action == "alloc":
            explicit = False
            live[int(addresses[index])] = allocator.malloc(int(sizes[index]), int(streams[index]))[0]
        elif action == "free_completed":
            address = live.pop(int(addresses[index]), None)
            if address is not None:
                allocator.free(address)
        elif action in ("segment_alloc", "segment_map"):
            explicit = False
            real += int(sizes[index])
        elif action in ("segment_free", "segment_unmap"):
            real -= int(sizes[index])
            real_freed += index >= start and not explicit
        elif action == "oom":
            oom |= index >= start
        if index == start:
            retries_before = getattr(allocator, "retries", 0)
        if index >= start:
            if allocator.reserved > peak:
                peak, by_stream = allocator.reserved, _by_stream(allocator)
            real_peak = max(real_peak, real)
    return Replayed(peak, real_peak, getattr(allocator, "retries", 0) - retries_before, real_freed,
                    allocator.out_of_memory, oom, by_stream)


def _by_stream(allocator) -> dict:
    found = {}
    for address, end in allocator.segments.items():
        stream = allocator.blocks[address][2][0] if address in allocator.blocks else None
        found[stream] = found.get(stream, 0) + end - address
    return found
