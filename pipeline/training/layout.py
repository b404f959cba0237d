"""The layout of a run on several GPUs: one object that knows the mesh (as torchtitan's ParallelDims does).

`Layout(num_gpus N, sharding, shard_group S, tensor_parallel T)`:

- tensor parallelism over T GPUs (transformers' own plan for the model, `base_model_tp_plan`), data
  parallelism over the N / T ranks that hold the same tensor-parallel shard;
- `sharding` of the data-parallel ranks: `ddp` (every rank the whole model), `fsdp` / `fsdp-no-reshard` (FSDP2
  over all of them), `hsdp` (FSDP2 over groups of S, replicated across the N / T / S groups: a 2-D mesh
  ("replicate", "shard")); None with T = N (tensor parallelism alone) or on one GPU.

The mesh's dimensions, outermost first: ("replicate", "shard") for hsdp, ("dp",) for ddp and fsdp, then
("tp",) when T > 1 (`mesh_shape`, `mesh(device_type)`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.core.errors import UserError
from pipeline.core.vocabulary import MAX_GPUS, SHARDINGS, ZERO_SHARDINGS, check_choice, check_positive_int


@dataclass(frozen=True)
class Layout:
    num_gpus: int = 1
    sharding: str | None = None
    shard_group: int | None = None
    tensor_parallel: int = 1

    def __post_init__(self):
        n = check_positive_int("num_gpus", self.num_gpus, MAX_GPUS)
        t = check_positive_int("tensor_parallel", self.tensor_parallel, MAX_GPUS)
        object.__setattr__(self, "num_gpus", n)
        object.__setattr__(self, "tensor_parallel", t)
        if self.sharding is not None:
            check_choice("sharding", self.sharding, SHARDINGS)
        if n % t:
            raise UserError(f"tensor_parallel {t} does not divide num_gpus {n}")
        data_parallel = n // t
        if self.sharding is None and data_parallel > 1:
            raise UserError(f"num_gpus {n} needs a sharding ({', '.join(SHARDINGS)}) for its {data_parallel} "
                            "data-parallel ranks")
        if self.sharding == "hsdp":
            if self.shard_group is None:
                raise UserError("sharding hsdp needs a shard_group (the GPUs a model is sharded over, usually a node's 8)")
            s = check_positive_int("shard_group", self.shard_group, MAX_GPUS)
            object.__setattr__(self, "shard_group", s)
            if data_parallel % s:
                raise UserError(f"shard_group {s} does not divide the {data_parallel} data-parallel ranks "
                                f"(num_gpus {n} / tensor_parallel {t})")
        elif self.shard_group is not None:
            raise UserError("shard_group is hsdp's (FSDP2 over groups of that many GPUs); give --sharding hsdp")
        if t > 1 and self.sharding in ZERO_SHARDINGS:
            raise UserError("tensor parallelism with DeepSpeed's ZeRO (AutoTP) is not simulated: use fsdp or hsdp")
        if t > 1 and self.sharding == "ddp":
            raise UserError("tensor parallelism with ddp is not a layout torch runs (DDP takes no DTensor "
                            "parameters): use fsdp or hsdp over the data-parallel ranks")

    @property
    def data_parallel(self) -> int:
        return self.num_gpus // self.tensor_parallel

    @property
    def sharded(self) -> bool:
        """Several GPUs."""
        return self.num_gpus > 1

    @property
    def shards(self) -> int:
        """Ranks a data-parallel FSDP2 shard is cut over (1 under ddp)."""
        if self.sharding == "hsdp":
            return self.shard_group
        return self.data_parallel if self.sharding in ("fsdp", "fsdp-no-reshard", *ZERO_SHARDINGS) else 1

    @property
    def communicators(self) -> int:
        """NCCL communicators a rank is in: the default group, and on a mesh of several dimensions a group for each
        dimension of more than one rank (HSDP's replicate and shard groups; the data- and tensor-parallel groups)."""
        if not self.sharded:
            return 0
        shape, _ = self.mesh_shape()
        return 1 + (sum(1 for size in shape if size > 1) if len(shape) > 1 else 0)

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        if self.sharding == "hsdp":
            shape, names = (self.data_parallel // self.shard_group, self.shard_group), ("replicate", "shard")
        else:
            shape, names = (self.data_parallel,), ("dp",)
        if self.tensor_parallel > 1:
            shape, names = shape + (self.tensor_parallel,), names + ("tp",)
        return shape, names

    def mesh(self, device_type: str):
        """torch's DeviceMesh of the layout (the default process group holds num_gpus ranks)."""
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = self.mesh_shape()
        return init_device_mesh(device_type, shape, mesh_dim_names=names)

    @staticmethod
    def data_mesh(mesh):
        """The data-parallel part of `mesh` (what FSDP2 shards and replicates over)."""
        names = mesh.mesh_dim_names
        return mesh[("replicate", "shard")] if "replicate" in names else mesh["dp"]

    def columns(self) -> dict:
        """The layout as the tables and answers name it: num_gpus, sharding, shard_group, tensor_parallel."""
        return {"num_gpus": self.num_gpus, "sharding": self.sharding, "shard_group": self.shard_group,
                "tensor_parallel": self.tensor_parallel}

    def describe(self) -> str:
        parts = [f"{self.num_gpus} GPU" + ("s" if self.num_gpus > 1 else "")]
        if self.sharding == "hsdp":
            replicas = self.data_parallel // self.shard_group
            parts.append(f"hsdp ({replicas} replica{'s' if replicas > 1 else ''} x {self.shard_group} shards)")
        elif self.sharding:
            parts.append(self.sharding)
        if self.tensor_parallel > 1:
            parts.append(f"tensor parallel {self.tensor_parallel}")
        return ", ".join(parts)


NODE = 8  # GPUs of one node: HSDP's shard group and tensor parallelism's largest size, as people lay them out


def candidate_layouts(num_gpus: int, client: str = "loop", heads: tuple = ()) -> list[Layout]:
    """The layouts worth asking about on `num_gpus` GPUs: ddp, fsdp and fsdp-no-reshard for every client; for the
    loop also hsdp with a node's shard group (when N spans nodes) and tensor parallelism within a node (T of 2, 4,
    8 dividing N and every count of `heads`), alone or with fsdp or hsdp over the data-parallel ranks."""
    if num_gpus == 1:
        return [Layout()]
    found = [Layout(num_gpus, sharding) for sharding in ("ddp", "fsdp", "fsdp-no-reshard")]
    if client != "loop":
        return found
    if num_gpus > NODE and num_gpus % NODE == 0:
        found.append(Layout(num_gpus, "hsdp", NODE))
    for tp in (2, 4, NODE):
        if tp > num_gpus or num_gpus % tp or any(h % tp for h in heads):
            continue
        data = num_gpus // tp
        found.append(Layout(num_gpus, None if data == 1 else "fsdp", None, tp))
        if data > NODE and data % NODE == 0:
            found.append(Layout(num_gpus, "hsdp", NODE, tp))
    return found
