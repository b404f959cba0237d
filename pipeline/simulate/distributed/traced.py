"""Your own several-GPU training code, traced: `pipeline.trace(gpu=..., world_size=N)` runs code that builds its own
mesh and calls `fully_shard` / `parallelize_module` (a torchtitan-style trainer) as rank 0 of N.

On meta (the default) the block runs in the several-GPU wing's world: torch's fake process group of N ranks is the
default group (the code's `init_device_mesh("cuda", ...)` meshes come from it; `dist.init_process_group` and
`torch.cuda.set_device` in the code are answered as done), FSDP2 runs on meta parameters with its side streams
replayed, and the tracker counts DTensors by their local shards (`world`, `tracker`). `device="cpu"` runs the same
code for real inside a process group the caller made (gloo, N processes): each rank counts its own bytes under
the same tracker, and rank 0's answer equals the meta trace's (tests/test_simulate_trace.py). `t.mesh_device` is
the device type the code's meshes take: "cuda" on meta, "cpu" for the real CPU run.
"""

from __future__ import annotations

import contextlib

from pipeline.core.errors import UserError
from pipeline.simulate.trace import Trace


class ShardedTrace(Trace):
    """A `Trace` of rank 0 of `world_size` (see the module docstring)."""

    def __init__(self, world_size: int, device_type: str = "meta", **kwargs):
        from pipeline.simulate.distributed.tracker import ShardedTracker, host_copy_stand_ins

        meta = device_type == "meta"
        super().__init__(device_type, tracker_class=ShardedTracker,
                         stand_ins=host_copy_stand_ins() if meta else None, **kwargs)
        self.world_size = world_size
        self.mesh_device = "cuda" if meta else device_type
        self.world = None
        if meta:
            from pipeline.simulate.distributed.world import stream_name

            self.tracker.stream = stream_name

    def __enter__(self) -> ShardedTrace:
        from pipeline.simulate.distributed.step import roles

        self.world = contextlib.ExitStack()
        try:
            if self.device_type == "meta":
                from pipeline.simulate.distributed.world import fake_process_group, meta_fsdp, started_by_the_world

                self.world.enter_context(fake_process_group(self.world_size))
                self.world.enter_context(meta_fsdp())
                self.world.enter_context(started_by_the_world())
            else:
                from pipeline.simulate.distributed.check import detached_collectives

                self.check_real_world()
                self.world.enter_context(detached_collectives())
            self.world.enter_context(roles(self.tracker))
            return super().__enter__()
        except BaseException:
            self.world.close()
            raise

    def __exit__(self, *exc_info):
        import torch.distributed as dist

        try:
            # the default group and every group the code's meshes made: NCCL's buffers for the verdict
            self.communicators = len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 1
            return super().__exit__(*exc_info)
        finally:
            self.world.close()

    def check_real_world(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() != self.world_size:
            raise UserError(f"a CPU trace of world_size {self.world_size} runs in a process group of that many "
                            "ranks (dist.init_process_group('gloo', ...) in each process first)")

