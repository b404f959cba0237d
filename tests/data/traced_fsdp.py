"""A torchtitan-style trainer (its own mesh, FSDP2 per decoder layer and the root, AdamW), traced as one rank of N.

    torchrun --nproc-per-node 2 tests/data/traced_fsdp.py OUT.json     # real gloo ranks on the CPU: rank 0 writes

and `train(t, world)` inside `pipeline.trace(world_size=N)` on meta answers the same bytes (tests/test_simulate_trace.py).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import pipeline

CONFIG = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def train(t, world: int, mesh=None) -> None:
    torch.manual_seed(0)
    mesh = mesh or init_device_mesh(t.mesh_device, (world,))
    model = t.build(CONFIG)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.cuda.reset_peak_memory_stats()  # after the setup, as a measurement would
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        ids = t.batch(2, 32)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    # made before the trace: gloo's mesh keeps its rank layout in a CPU tensor, which a CPU trace would count (on
    # GPUs it is host memory, never the GPU's)
    mesh = init_device_mesh("cpu", (world,))
    with pipeline.trace(device="cpu", world_size=world) as t:
        train(t, world, mesh)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as handle:
            json.dump({"peak_bytes": t.peak_bytes, "components": t.components, "phase_peaks": t.phase_peaks}, handle)
    dist.destroy_process_group()
