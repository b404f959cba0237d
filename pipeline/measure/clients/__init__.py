"""The clients that run a measured point's training steps on an already built model: `loop` (the
standard step of pipeline.training.step), `trainer` (transformers.Trainer), `sft` (TRL's SFTTrainer) and
`dpo` (TRL's DPOTrainer), `grpo` and `rloo` (TRL's GRPOTrainer and RLOOTrainer; the TRL clients wrap a point's
adapters themselves). One module per client, each with

    unavailable(setting, device) -> str | None   why the point cannot run here (a skipped row), or None
    run_steps(model, setting, precision, batch, seq, device, tracker, use_cache) -> (seconds, state bytes)

`run_steps` leaves the model as it found it (weights only, no hooks, no wrappers), so that the
next point of the process starts from the same state. A new client is a module and an entry here.
"""

from __future__ import annotations

import importlib

CLIENT_MODULES = {"loop": "pipeline.measure.clients.loop", "trainer": "pipeline.measure.clients.trainer",
                  "sft": "pipeline.measure.clients.sft", "dpo": "pipeline.measure.clients.dpo",
                  "grpo": "pipeline.measure.clients.grpo", "rloo": "pipeline.measure.clients.grpo"}
# Clients given a point's adapters as a configuration (they wrap the base themselves), not a PeftModel.
WRAPS_ADAPTERS = ("sft", "dpo", "grpo", "rloo")
# Clients whose imports the sweep's parent may pay once before forking. Importing transformers'
# Trainer initialised CUDA in the parent on the H100 machine (with bitsandbytes importable), which
# makes forked children unusable: each trainer child imports it itself.
FORK_SAFE_IMPORTS = ("loop",)
# Clients whose every measured point runs in a process of its own (none now). The Trainer was one
# while consecutive Trainer points inflated each other on the H100 (Qwen3-0.6B: B=4, L=512 at
# 20.4 GB right after B=1, L=512, 16.9 GB as a process's first point): accelerate marks a model it
# prepared (`_is_accelerate_prepared`) and never wraps it again, so every Trainer after the first ran
# without autocast. The trainer client's `restore` removes the mark.
ONE_POINT_PER_PROCESS: tuple[str, ...] = ()


def client_module(name: str):
    """The module of client `name` (imported on first use: the trainer's imports are heavy)."""
    return importlib.import_module(CLIENT_MODULES[name])
