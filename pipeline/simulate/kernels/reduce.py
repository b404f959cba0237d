"""The staging buffer of PyTorch's CUDA reductions (ATen's `native/cuda/Reduce.cuh`: sum, mean, norms, amax).

A reduction whose inputs per output are many and whose outputs are few splits each output's inputs across
thread blocks ("global reduce"): `gpu_reduce_kernel` then takes a buffer for the blocks' partial results and a few
bytes of semaphores from the caching allocator, and gives both back when the launch returns. The sum of a norm's
weight gradient over the batch's tokens is one (a [B*L, H] input, H outputs: 50 MB for B*L = 4096, H = 1536);
allocated and freed inside the op, it counts in the allocated peak where it falls, and in the segments the
allocator has to find for it.

`setReduceConfig` decides, from the input's layout as TensorIterator orders it (reduced dimensions first, each
group fastest first, adjacent dimensions coalesced) and from the device's multiprocessors: it is ported here for
the simulated device, an sm90 GPU (132 multiprocessors of 2048 threads: H100, H200).
"""

from __future__ import annotations

import math

import torch

MULTIPROCESSORS = 132  # sm90 (H100, H200): cudaDeviceProp.multiProcessorCount
THREADS_PER_MULTIPROCESSOR = 2048  # maxThreadsPerMultiProcessor
WARP = 32
MAX_THREADS = 512  # mnt_wrapper<T>::MAX_NUM_THREADS (256 for complex double)
INPUT_VEC_SIZE = 4  # gpu_reduce_kernel's vt0 = input_vec_size
MIN_VALUES_PER_THREAD, MAX_VALUES_PER_THREAD = 16, 256


def div_up(a: int, b: int) -> int:
    return -(-a // b)


def last_pow2(n: int) -> int:
    return max(1, 1 << (max(n, 1).bit_length() - 1))


def iterator_dims(shape, strides, reduced) -> list[tuple[int, int, bool]]:
    """(size, input stride in elements, reduced?) of TensorIterator's dimensions for a reduction of a tensor:
    size-1 dimensions dropped; ordered as `reorder_dimensions` compares the output first (the reduced dimensions,
    its stride 0, to the front; the others by its contiguous strides: the last one fastest), then the input's
    strides among the reduced; adjacent dimensions coalesced where both operands are one run in memory."""
    kept = [d for d, size in enumerate(shape) if size != 1]
    outputs = [d for d in kept if d not in reduced]
    out_stride, running = {}, 1
    for d in reversed(outputs):
        out_stride[d], running = running, running * shape[d]
    ordered = sorted((d for d in kept if d in reduced), key=lambda d: (strides[d], shape[d]))
    ordered += sorted(outputs, key=lambda d: out_stride[d])
    coalesced = []  # [size, input stride, output stride, reduced?]
    for d in ordered:
        dim = [shape[d], strides[d], out_stride.get(d, 0), d in reduced]
        last = coalesced[-1] if coalesced else None
        if last and last[3] == dim[3] and dim[1] == last[0] * last[1] and dim[2] == last[0] * last[2]:
            last[0] *= dim[0]
        else:
            coalesced.append(dim)
    return [(size, stride, is_reduced) for size, stride, _, is_reduced in coalesced]


def output_vec_size(dims: list, num_reduce_dims: int) -> int:
    """get_output_vec_size: 4, halved until it divides the first output dimension and the input's other strides
    (the data pointer taken as aligned)."""
    vec = 4
    values = [dims[num_reduce_dims][0]] + [stride for index, (_, stride, _) in enumerate(dims)
                                           if index != num_reduce_dims]
    for value in values:
        while value % vec:
            vec //= 2
    return vec


class ReduceConfig:
    """ATen's ReduceConfig as `setReduceConfig` fills it, for the bytes of the global reduce."""

    def __init__(self, accumulate_bytes: int, num_outputs: int, num_inputs: int):
        self.accumulate_bytes, self.num_outputs, self.num_inputs = accumulate_bytes, num_outputs, num_inputs
        self.step_input = self.step_output = 1
        self.block_x_reduce = self.split_warps = False
        self.width = self.height = 1
        self.vec = 1
        self.ctas = 1

    def set_block_dimension(self, dim0: int, dim1: int) -> None:
        max_threads = MAX_THREADS // self.vec
        dim0_pow2 = last_pow2(dim0) if dim0 < max_threads else max_threads
        dim1_pow2 = last_pow2(dim1) if dim1 < max_threads else max_threads
        self.width = min(dim0_pow2, WARP)
        self.height = min(dim1_pow2, max_threads // self.width)
        self.width = min(dim0_pow2, max_threads // self.height)

    def values_per_thread(self) -> int:
        return div_up(self.num_inputs, self.step_input)

    def grid(self) -> int:
        return div_up(self.num_outputs // self.vec, self.step_output)

    def split_across_blocks(self) -> None:
        """Divide the input across thread blocks when each thread has much work and the outputs are few."""
        threads = self.width * self.height
        target = MULTIPROCESSORS * (THREADS_PER_MULTIPROCESSOR // threads)
        per_thread, grid = self.values_per_thread(), self.grid()
        if not (self.split_warps and per_thread >= MAX_VALUES_PER_THREAD and grid <= target):
            return
        self.ctas = max(min(div_up(target, grid), div_up(per_thread, MIN_VALUES_PER_THREAD)),
                        div_up(per_thread, MAX_VALUES_PER_THREAD))

    def scratch_bytes(self) -> list[int]:
        """[staging buffer, semaphores] of the global reduce, or nothing without one."""
        if self.ctas <= 1:
            return []
        per_output = 1 if self.block_x_reduce else self.width * self.vec
        return [self.accumulate_bytes * self.num_outputs * self.ctas * per_output, 4 * self.grid()]


def scratch_bytes(shape, strides, reduced, accumulate_bytes: int) -> list[int]:
    """[staging buffer, semaphores] bytes of one reduction of a tensor (empty where it needs no global reduce)."""
    dims = iterator_dims(shape, strides, set(reduced))
    numel = math.prod(shape)
    if not dims or numel == 0:
        return []
    num_reduce_dims = sum(1 for _, _, is_reduced in dims if is_reduced)
    num_outputs = math.prod(size for size, _, is_reduced in dims if not is_reduced)
    config = ReduceConfig(accumulate_bytes, num_outputs, numel // num_outputs)
    on_fastest = num_reduce_dims == len(dims) or dims[0][1] < dims[num_reduce_dims][1]
    if on_fastest:
        dim0, dim1, fastest = config.num_inputs, num_outputs, dims[0][1]
    else:
        dim0, dim1, fastest = num_outputs, config.num_inputs, dims[num_reduce_dims][1]
    if fastest == 1 and on_fastest and dim0 >= 128 and num_reduce_dims == 1:
        dim0 //= INPUT_VEC_SIZE  # vectorize along the input
    elif fastest == 1 and not on_fastest:
        config.vec = output_vec_size(dims, num_reduce_dims)  # vectorize along the output
        dim0 //= config.vec
    config.set_block_dimension(dim0, dim1)
    config.block_x_reduce = on_fastest
    if on_fastest:
        config.step_input *= config.width
    else:
        config.step_output *= config.width
    config.split_warps = config.values_per_thread() >= min(config.height * 16, MAX_VALUES_PER_THREAD)
    if config.split_warps:
        config.step_input *= config.height
    else:
        config.step_output *= config.height
    config.split_across_blocks()
    return config.scratch_bytes()


def accumulate_bytes(dtype: torch.dtype) -> int:
    """The accumulation type's bytes of a sum or a norm on CUDA (acc_type: float for 16-bit floats)."""
    if dtype.is_floating_point:
        return max(4, dtype.itemsize)
    return 8  # integers sum in int64


def _dims(tensor, dim) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(tensor.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return [d % max(tensor.dim(), 1) for d in dims]


def _reduction(dim_position: int | None, extremum: bool = False):
    """The scratch rule of a reduction op whose `dim` is its argument `dim_position` (None: it reduces all)."""
    def rule(args, kwargs, out):
        tensor = args[0]
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            return []
        given = dim_position is not None and len(args) > dim_position
        dim = args[dim_position] if given else kwargs.get("dim")
        size = tensor.element_size() if extremum else accumulate_bytes(tensor.dtype)
        return scratch_bytes(tuple(tensor.shape), tuple(tensor.stride()), _dims(tensor, dim), size)
    return rule


def reduction_workspaces() -> dict:
    """{aten overload: fn(args, kwargs, out) -> [bytes, ...]} of the reductions that run Reduce.cuh's kernel."""
    aten = torch.ops.aten
    return {aten.sum.dim_IntList: _reduction(1), aten.sum.default: _reduction(None), aten.mean.dim: _reduction(1),
            aten.mean.default: _reduction(None), aten.linalg_vector_norm.default: _reduction(2),
            aten.amax.default: _reduction(1, extremum=True), aten.amin.default: _reduction(1, extremum=True)}
