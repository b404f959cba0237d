"""GPUs: their memory as `nvidia-smi` reports it, and the memory a training process uses outside
PyTorch's allocator, for the fit verdict (pure data, no torch).

A process runs out of memory when its allocator's segments (`torch.cuda.memory_reserved()`) plus
what lies outside them exceed the device. Outside them, measured on the committed H200 rows
(`results/peak_memory.parquet`, 2,549 ok rows): the CUDA context, the kernels' modules and library
handles (NVML's per-process `usedGpuMemory` minus peak reserved): 742-746 MiB for fp32 steps and
eager attention, 742-768 MiB (median 760) for bf16 and amp-bf16 steps with SDPA (their flash and
memory-efficient attention kernels are loaded too). And the memory that the driver keeps out of
CUDA's reach: `nvidia-smi` total minus `cudaMemGetInfo` total (torch's `total_memory`), 615 MiB on
the H200 (143,771 - 143,156 MiB) and 455 MiB on the H100 80GB HBM3 (81,559 - 81,104 MiB).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from pipeline.core.errors import UserError
from pipeline.core.text import short

MIB = 1 << 20

# Outside PyTorch's allocator, per process (MiB): the largest measured of each regime on the H200.
CONTEXT_MIB = {"fp32": 746, "bf16": 768}
# On several GPUs NCCL adds its own buffers outside the allocator, per communicator the rank is in (MiB over the
# single-GPU context), the largest measured for each count on an H200 x4 host (results/distributed/h200: NVML
# at the end of training minus the reserved bytes, every rank alike): one communicator (DDP, FSDP2: the default
# group) 846; two (tensor parallelism alone: the default group and the tp group, of 2 or 4 ranks alike) 1,230;
# three (HSDP: default, replicate, shard; FSDP2 x tensor parallel: default, dp, tp) 1,524. It grows with the
# communicators, not with their size; beyond three, each more adds the last step (294, not measured).
NCCL_MIB = (0, 846, 1230, 1524)
# Where the driver's reserve of a card is unknown: the H200's.
DEFAULT_DRIVER_RESERVED_MIB = 615


@dataclass(frozen=True)
class Device:
    """One GPU: `total_mib` as nvidia-smi reports it; `cuda_total_mib` as CUDA (torch's
    `total_memory`) does, where known; `source` where the figures come from."""

    name: str
    total_mib: int
    cuda_total_mib: int | None
    source: str

    @property
    def total_bytes(self) -> int:
        return self.total_mib * MIB

    @property
    def driver_reserved_bytes(self) -> int:
        if self.cuda_total_mib is None:
            return DEFAULT_DRIVER_RESERVED_MIB * MIB
        return (self.total_mib - self.cuda_total_mib) * MIB


# nvidia-smi "Memory-Usage" totals, read off nvidia-smi outputs in public repositories (searched by
# the figure: several independent outputs for each card agree) unless the source says otherwise.
DEVICES = {d.name: d for d in (
    Device("GB200", 189_471, None, "nvidia-smi outputs (NVIDIA GB200; 5 agree)"),
    Device("B200", 183_359, None, "nvidia-smi outputs (NVIDIA B200; 6 agree, drivers 570-595)"),
    Device("H200", 143_771, 143_156, "nvidia-smi outputs (H200 SXM and NVL); CUDA total: our H200 sweep"),
    Device("GH200 144GB", 146_831, None, "one nvidia-smi --query-gpu output (GH200 144G HBM3e, both GPUs of "
           "one host); no second output found"),
    Device("GH200 96GB", 97_871, None, "nvidia-smi outputs (named GH200 480GB or GH200 120GB after the "
           "node's memory; 7 agree)"),
    Device("H20", 97_871, None, "nvidia-smi outputs (NVIDIA H20, 96 GB; 3 agree)"),
    Device("H100 NVL", 95_830, None, "nvidia-smi outputs (NVIDIA H100 NVL; 7 agree, drivers 535-610)"),
    Device("H100 80GB", 81_559, 81_104, "nvidia-smi outputs (H100 80GB HBM3; the H100 PCIe shows the same); "
           "CUDA total 85,045,870,592 B from one public log"),
    Device("H800", 81_559, None, "nvidia-smi outputs (NVIDIA H800; 3 agree, and one --query-gpu output)"),
    Device("A100 80GB", 81_920, None, "nvidia-smi outputs (A100-SXM4-80GB)"),
    Device("A800 80GB", 81_920, None, "nvidia-smi outputs (A800-SXM4-80GB; 7 agree)"),
    Device("A100 40GB", 40_960, None, "nvidia-smi outputs (A100-SXM4-40GB and A100-PCIE-40GB)"),
    Device("RTX PRO 6000", 97_887, None, "nvidia-smi outputs (RTX PRO 6000 Blackwell: Workstation, Max-Q "
           "and Server Edition; 6 agree)"),
    Device("L40S", 46_068, None, "nvidia-smi outputs (L40S; the L40 and A40 show the same)"),
    Device("RTX 6000 Ada", 49_140, None, "nvidia-smi outputs with ECC off (9 agree); one with ECC on shows "
           "46,068 MiB"),
    Device("RTX A6000", 49_140, None, "nvidia-smi outputs with ECC off (8 agree)"),
    Device("RTX 5090", 32_607, None, "nvidia-smi outputs (GeForce RTX 5090; 8 agree, drivers 595-616)"),
    Device("RTX 4090", 24_564, None, "nvidia-smi outputs (GeForce RTX 4090)"),
    Device("RTX 3090", 24_576, None, "nvidia-smi outputs with driver 525 and later; older drivers show "
           "24,234-24,268 MiB"),
    Device("RTX 5080", 16_303, None, "nvidia-smi outputs (GeForce RTX 5080; 8 agree)"),
    Device("RTX 4080 SUPER", 16_376, None, "nvidia-smi --query-gpu outputs (GeForce RTX 4080 SUPER; 5 agree)"),
    Device("RTX 4080", 16_376, None, "nvidia-smi outputs (GeForce RTX 4080; 4 agree, one older output "
           "shows 16,384 MiB)"),
    Device("A10G", 23_028, None, "nvidia-smi outputs (A10G; the A10 shows the same)"),
    Device("L4", 23_034, None, "nvidia-smi outputs (L4)"),
    Device("V100 16GB", 16_160, None, "nvidia-smi outputs (V100-SXM2 and V100-PCIE 16GB)"),
    Device("V100 32GB", 32_768, None, "nvidia-smi outputs with recent drivers; older ones show 32,510 MiB "
           "(which one holds for a given driver not confirmed)"),
    Device("T4", 15_360, None, "nvidia-smi outputs (Tesla T4)"),
)}


def device(name: str) -> Device:
    """The catalogue's device called `name` (case and spaces ignored)."""
    wanted = _normal(name)
    for known in DEVICES.values():
        if _normal(known.name) == wanted:
            return known
    by_normal = {_normal(known.name): known.name for known in DEVICES.values()}
    close = [by_normal[n] for n in difflib.get_close_matches(wanted, by_normal, n=3, cutoff=0.6)]
    hint = f"the closest known: {', '.join(close)}" if close else f"{len(DEVICES)} are known"
    raise UserError(f"unknown GPU {short(name)}; {hint} (`estimate --help` lists them all; or give "
                    "--gpu-memory GIB)")


def custom_device(total_gib: float) -> Device:
    """A device given by its nvidia-smi total in GiB (the driver's reserve taken as the H200's)."""
    if isinstance(total_gib, bool) or not isinstance(total_gib, (int, float)) or not 0 < total_gib < 1 << 20:
        raise UserError(f"gpu_memory_gib must be a positive number of GiB, not {short(total_gib)}")
    return Device(f"{total_gib:g} GiB", round(total_gib * 1024), None, "given")


@dataclass(frozen=True)
class Verdict:
    """Whether a step fits a device: its reserved bytes plus the memory outside PyTorch."""

    device: Device
    reserved_bytes: float
    outside_bytes: int
    expandable_reserved_bytes: float

    @property
    def fits(self) -> bool:
        return self.reserved_bytes + self.outside_bytes <= self.device.total_bytes

    @property
    def headroom_bytes(self) -> float:
        return self.device.total_bytes - self.reserved_bytes - self.outside_bytes

    @property
    def expandable_fits(self) -> bool:
        return self.expandable_reserved_bytes + self.outside_bytes <= self.device.total_bytes


def context_bytes(precision: str, attn_implementation: str | None = None) -> int:
    """Memory of the process outside the allocator's segments (CUDA context, kernels, libraries):
    the most measured on the H200 for this regime (other cards: the same figure, not measured)."""
    low = precision == "fp32" or attn_implementation == "eager"
    return CONTEXT_MIB["fp32" if low else "bf16"] * MIB


def nccl_bytes(communicators: int) -> int:
    """NCCL's memory outside the allocator for a rank in `communicators` process groups (0 on one GPU)."""
    if communicators < len(NCCL_MIB):
        return NCCL_MIB[communicators] * MIB
    return (NCCL_MIB[-1] + (communicators - len(NCCL_MIB) + 1) * (NCCL_MIB[-1] - NCCL_MIB[-2])) * MIB


def outside_bytes(dev: Device, precision: str, attn_implementation: str | None = None, communicators: int = 0) -> int:
    """Everything between the allocator's reserved bytes and nvidia-smi's total on `dev` (on several GPUs, NCCL's
    buffers of the rank's `communicators` too)."""
    return context_bytes(precision, attn_implementation) + dev.driver_reserved_bytes + nccl_bytes(communicators)


def _normal(name: str) -> str:
    return "".join(name.lower().replace("nvidia", "").replace("geforce", "").split())
