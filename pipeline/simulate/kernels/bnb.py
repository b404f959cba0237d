"""bitsandbytes' 4-bit matmul as CUDA runs it (sm90: an H100 or H200, 132 SMs).

`torch.ops.bitsandbytes.gemm_4bit` (MatMul4Bit's forward) either runs bitsandbytes' own kernel
(output only) or, where its heuristic says dequantize + F.linear is faster, dequantizes the whole
weight into a temporary of the compute dtype first: scratch of out*in*2 bytes inside the op. The
choice is bitsandbytes' own `_gemm_4bit_use_custom_cuda`, read from its source (the CUDA backend
module cannot be imported without CUDA) and run with sm90's properties; M above
`_gemm_4bit_custom_max_m` (1536) always takes the fallback. The backward's dequantized weight is a
Python-level op output (`F.dequantize_4bit`), counted by the tracker as it is.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from pathlib import Path

SM90 = (132, 9, 0)  # (multiprocessors, major, minor) of an H100 SXM / H200
CUSTOM_MAX_M = 1536  # bitsandbytes' _gemm_4bit_custom_max_m on CUDA
CUSTOM_FLOOR_M = 4  # _GEMM_4BIT_CUSTOM_FLOOR_M


@functools.cache
def use_custom_kernel():
    """bitsandbytes' `_gemm_4bit_use_custom_cuda(device_index, dtype, M, N, K)` with sm90's properties."""
    import torch

    spec = importlib.util.find_spec("bitsandbytes")
    source = Path(next(iter(spec.submodule_search_locations))) / "backends" / "cuda" / "ops.py"
    tree = ast.parse(source.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_gemm_4bit_use_custom_cuda")
    node.decorator_list = []
    namespace = {"torch": torch, "_GEMM_4BIT_CUSTOM_FLOOR_M": CUSTOM_FLOOR_M, "_gpu_dispatch_props": lambda index: SM90}
    exec(compile(ast.Module([node], []), str(source), "exec"), namespace)  # noqa: S102 - bitsandbytes' own code
    return namespace["_gemm_4bit_use_custom_cuda"]


def gemm_4bit_workspace(args, kwargs, out):
    """Scratch of CUDA's gemm_4bit: the dequantized weight where the fallback runs."""
    a, shape, blocksize = args[0], args[2], args[4]
    k = a.shape[-1]
    m, n = a.numel() // k, shape[0]
    if m <= CUSTOM_MAX_M and k % blocksize == 0 and use_custom_kernel()(0, a.dtype, m, n, k):
        return []
    return [n * k * a.element_size()]


def bnb_workspace_rules() -> dict:
    """The rules, where bitsandbytes is loaded (a quantized model imports it; nothing else does)."""
    if "bitsandbytes" not in sys.modules:
        return {}
    import torch

    return {torch.ops.bitsandbytes.gemm_4bit.default: gemm_4bit_workspace}
