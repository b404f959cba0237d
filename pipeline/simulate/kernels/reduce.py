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
    """(size, stride in elements, reduced?) of TensorIterator's dimensions for a reduction of a tensor: size-1
    dimensions dropped, the reduced ones first, each group by stride (ties: the smaller first), adjacent ones that
    are one in memory coalesced."""
    dims = [(size, stride, d in reduced) for d, (size, stride) in enumerate(zip(shape, strides)) if size != 1]
    ordered = sorted(dims, key=lambda dim: (not dim[2], dim[1], dim[0]))
    coalesced = []
    for size, stride, is_reduced in ordered:
        if coalesced and coalesced[-1][2] == is_reduced and stride == coalesced[-1][0] * coalesced[-1][1]:
            last_size, last_stride, _ = coalesced.pop()
            coalesced.append((last_size * size, last_stride, is_reduced))
        else:
            coalesced.append((size, stride, is_reduced))
    return coalesced


def output_vec_size(dims: list, num_reduce_dims: int) -> int:
    """get_output_vec_size: 4, halved until it divides the first output dimension and the input's other strides
    (the data pointer taken as aligned)."""
    vec = 4
    values = [dims[num_reduce_dims][0]] + [stride for index, (_, stride, _) in enumerate(dims) if index != num_reduce_dims]
    for value in values:
        while value % vec:
            vec //= 2
    return vec


def scratch_bytes(shape, strides, reduced, accumulate_bytes: int) -> list[int]:
    """[staging buffer, semaphores] bytes of one reduction (empty where it needs no global reduce)."""
    dims = iterator_dims(shape, strides, set(reduced))
    numel = math.prod(shape)
    if not dims or numel == 0:
        return []
    num_reduce_dims = sum(1 for _, _, is_reduced in dims if is_reduced)
    num_outputs = math.prod(size for size, _, is_reduced in dims if not is_reduced)
    inputs = numel // num_outputs
    on_fastest = num_reduce_dims == len(dims) or dims[0][1] < dims[num_reduce_dims][1]
    if on_fastest:
        dim0, dim1, fastest = inputs, num_outputs, dims[0][1]
    else:
        dim0, dim1, fastest = num_outputs, inputs, dims[num_reduce_dims][1]
    vec = 1
    if fastest == 1:
        if on_fastest and dim0 >= 128 and num_reduce_dims == 1:
            dim0 //= INPUT_VEC_SIZE
        elif not on_fastest:
            vec = output_vec_size(dims, num_reduce_dims)
            dim0 //= vec
    max_threads = MAX_THREADS // vec
    dim0_pow2 = last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(dim0_pow2, WARP)
    height = min(dim1_pow2, max_threads // width)
    width = min(dim0_pow2, max_threads // height)
    threads = width * height
    step_input = step_output = 1
    block_x_reduce = on_fastest
    if on_fastest:
        step_input *= width
    else:
        step_output *= width
    split_warps = div_up(inputs, step_input) >= min(height * 16, MAX_VALUES_PER_THREAD)
    if split_warps:
        step_input *= height
    else:
        step_output *= height
    target = MULTIPROCESSORS * (THREADS_PER_MULTIPROCESSOR // threads)
    grid = div_up(num_outputs // vec, step_output)
    per_thread = div_up(inputs, step_input)
    if not (split_warps and per_thread >= MAX_VALUES_PER_THREAD and grid <= target):
        return []
    ctas = max(min(div_up(target, grid), div_up(per_thread, MIN_VALUES_PER_THREAD)),
               div_up(per_thread, MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return []
    buffer = accumulate_bytes * num_outputs * ctas * (1 if block_x_reduce else width * vec)
    return [buffer, 4 * grid]


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


def _reduction(dim_position: int, extremum: bool = False):
    def rule(args, kwargs, out):
        tensor = args[0]
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            return []
        dim = args[dim_position] if len(args) > dim_position else kwargs.get("dim")
        size = tensor.element_size() if extremum else accumulate_bytes(tensor.dtype)
        return scratch_bytes(tuple(tensor.shape), tuple(tensor.stride()), _dims(tensor, dim), size)
    return rule


def reduction_workspaces() -> dict:
    """{aten overload: fn(args, kwargs, out) -> [bytes, ...]} of the reductions that run Reduce.cuh's kernel."""
    aten = torch.ops.aten
    return {aten.sum.dim_IntList: _reduction(1), aten.sum.default: _reduction(99), aten.mean.dim: _reduction(1),
            aten.mean.default: _reduction(99), aten.linalg_vector_norm.default: _reduction(2),
            aten.amax.default: _reduction(1, extremum=True), aten.amin.default: _reduction(1, extremum=True)}
