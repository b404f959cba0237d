"""A plan of several-GPU points: which models, clients, shardings, GPU counts, adapters and (B, L) to
measure, read from YAML and laid out as groups of points that run smallest first.

    models: [Qwen/Qwen2.5-1.5B, ...]     # every key but `groups` is a default of each group
    clients: [trainer, sft]               # loop, trainer, sft, dpo
    precisions: [bf16-autocast]           # default: the client's (bf16 weights under bf16 autocast; loop: bf16)
    num_gpus: [2, 4]
    shardings: [ddp, fsdp]                # also fsdp-no-reshard, hsdp, zero1-3; null: tensor parallelism alone
    deepspeed: [config/deepspeed/zero3_offload.json]   # DeepSpeed configs (Trainer clients): each a layout
    shard_groups: [2]                     # hsdp's S
    tensor_parallel: [1, 2]               # T (the loop)
    adapters: [full, lora]                # lora: LoRA r=16, alpha 32, all linear layers
    hyperparameters: {warmup_steps: 10}   # TrainingArguments' optimizer and schedule numbers (Trainer clients)
    rollouts: [{num_generations: 8, max_completion_length: 512}]   # grpo, rloo: GRPOConfig keys, each a group
    packings: [{packing: true}, {padding_free: true}]   # sft: SFTConfig's packing / padding_free, each a group
    alloc_conf: "expandable_segments:True"   # PYTORCH_CUDA_ALLOC_CONF of the torchrun
    memory_history: true                  # rank 0 records the allocator's events (<out>.history/, one file a point)
    checkpointing: [true]
    grid: {batch_sizes: [1, 4], seq_lens: [512, 2048]}   # or points: [[1, 512], [4, 2048]]
    split: tuned                          # or held-out: kept out of everything tuned
    timeout_seconds: 240                  # one point's torchrun
    groups:                               # optional: blocks that override the defaults above
      - {models: [...], clients: [dpo], num_gpus: [2]}

A group is one (model, client, precision, layout, adapter, checkpointing, rollout, packing); its points run one
torchrun each (every point is its process's first), smallest first, and an out-of-memory point settles every larger
one (B' >= B and L' >= L) of its group as oom without running it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.core.errors import UserError
from pipeline.core.vocabulary import (CLIENTS, PRECISIONS, ROLLOUT_CLIENTS, SHARDINGS, SPLITS, ZERO_SHARDINGS,
                                     check_choice)
from pipeline.training.layout import Layout

DEFAULT_KEYS = {"models", "clients", "precisions", "num_gpus", "shardings", "shard_groups", "tensor_parallel",
                "adapters", "checkpointing", "grid", "points", "split", "timeout_seconds", "configs", "deepspeed",
                "hyperparameters", "alloc_conf", "memory_history", "rollouts", "packings"}
PLAN_KEYS = DEFAULT_KEYS | {"groups"}
ADAPTERS = ("full", "lora", "lora-dropout", "qlora")  # lora-dropout: with TRL's --use_peft dropout 0.05


def plan_adapter(name: str, sharding: str | None = None):
    """The AdapterSpec of a plan's adapter name (full: none; lora: LoRA r=16, alpha 32, all linear layers;
    lora-dropout: the same with dropout 0.05, TRL's `--use_peft` default; qlora: LoRA on an nf4 base, stored as
    `sharding` needs it)."""
    from pipeline.training.adapters import AdapterSpec

    if name == "full":
        return None
    return AdapterSpec.make(16, quantization="nf4" if name == "qlora" else None,
                            dropout=0.05 if name == "lora-dropout" else None).for_sharding(sharding)
# The precision a client runs on a model loaded in bf16 (the Trainer clients with bf16=True: bf16-autocast).
DEFAULT_PRECISION = {"loop": "bf16", "trainer": "bf16-autocast", "sft": "bf16-autocast", "dpo": "bf16-autocast",
                     "grpo": "bf16-autocast", "rloo": "bf16-autocast"}
# The clients whose configs turn checkpointing on by default (SFTConfig, DPOConfig, GRPOConfig, RLOOConfig)
CHECKPOINTING_CLIENTS = ("sft", "dpo", "grpo", "rloo")
DEFAULT_TIMEOUT = 240


@dataclass(frozen=True)
class Group:
    """One setting on N GPUs; `points` are its (B, L), smallest first."""

    model_id: str
    client: str
    precision: str
    num_gpus: int
    sharding: str | None
    adapter: str
    checkpointing: bool
    points: tuple
    split: str = "tuned"
    timeout: int = DEFAULT_TIMEOUT
    shard_group: int | None = None
    tensor_parallel: int = 1
    deepspeed: str | None = None  # zero1-3: the DeepSpeed config's JSON text
    hyperparameters: str | None = None  # `training.hyperparameters.Hyperparameters.to_text()`
    alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF
    memory_history: bool = False
    rollout: str | None = None  # grpo, rloo: `training.rollout.Rollout.to_text()`
    packing: str | None = None  # sft: `training.packing.Packing.to_text()`; None: B rows of L tokens

    @property
    def key(self) -> tuple:
        return (self.model_id, self.client, self.precision, self.num_gpus, self.sharding, self.shard_group,
                self.tensor_parallel, self.adapter, self.checkpointing, self.deepspeed, self.hyperparameters,
                self.alloc_conf, self.rollout, self.packing)

    def rank_arguments(self, batch: int, seq: int) -> list[str]:
        """The arguments of `python -m pipeline.measure.distributed rank` for one point of the group."""
        return (["--model", self.model_id, "--client", self.client, "--precision", self.precision, "--adapter",
                 self.adapter, "--batch", str(batch), "--seq", str(seq), "--split", self.split,
                 "--tensor-parallel", str(self.tensor_parallel)]
                + (["--sharding", self.sharding] if self.sharding else [])
                + (["--shard-group", str(self.shard_group)] if self.shard_group else [])
                + (["--deepspeed", self.deepspeed] if self.deepspeed else [])
                + (["--hyperparameters", self.hyperparameters] if self.hyperparameters else [])
                + (["--rollout", self.rollout] if self.rollout else [])
                + (["--packing", self.packing] if self.packing else [])
                + (["--checkpointing"] if self.checkpointing else []))


def read_plan(path) -> dict:
    import yaml

    try:
        plan = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{path}: cannot read the plan ({type(exc).__name__})") from None
    if not isinstance(plan, dict) or set(plan) - PLAN_KEYS:
        raise UserError(f"{path}: a plan is a mapping of {', '.join(sorted(PLAN_KEYS))}")
    for block in plan.get("groups") or [{}]:
        if not isinstance(block, dict) or set(block) - DEFAULT_KEYS:
            raise UserError(f"{path}: each of groups is a mapping of {', '.join(sorted(DEFAULT_KEYS))}")
        check_block({**plan, **block}, path)
    return plan


def check_block(block: dict, path) -> None:
    if not block.get("models") or not ("grid" in block or "points" in block):
        raise UserError(f"{path}: every group needs models and a grid (or points)")
    for client in block.get("clients", ["loop"]):
        check_choice("client", client, CLIENTS)
    for precision in block.get("precisions", []):
        check_choice("precision", precision, PRECISIONS)
    shardings = block.get("shardings", [] if "deepspeed" in block else ["ddp", "fsdp"])
    for sharding in shardings:
        if sharding is not None:
            check_choice("sharding", sharding, SHARDINGS)
    zero = block.get("deepspeed") or any(sharding in ZERO_SHARDINGS for sharding in shardings)
    if zero and "loop" in block.get("clients", ["loop"]):
        raise UserError(f"{path}: zero1-3 and deepspeed configs run with the trainer, sft and dpo clients, not loop")
    for n in block.get("num_gpus", [2]):
        if not block_layouts(block, n):
            raise UserError(f"{path}: no layout of {n} GPUs among the group's shardings, shard_groups and "
                            "tensor_parallel")
    for adapter in block.get("adapters", ["full"]):
        check_choice("adapter", adapter, ADAPTERS)
    hyperparameters_of(block, path)
    rollouts_of(block, path)
    packings_of(block, path)
    if "alloc_conf" in block:  # a setting the replay cannot answer is not worth measuring
        from pipeline.training.alloc_conf import read_alloc_conf

        read_alloc_conf(block["alloc_conf"])
    if not isinstance(block.get("memory_history", False), bool):
        raise UserError(f"{path}: memory_history is true or false")
    check_choice("split", block.get("split", "tuned"), SPLITS)


def groups(plan: dict, gpus: int | None = None) -> list[Group]:
    """Every group of the plan with N within the GPUs there are (all when `gpus` is None)."""
    found = []
    for block in plan.get("groups") or [{}]:
        merged = {key: value for key, value in plan.items() if key != "groups"}
        merged.update(block)
        found.extend(block_groups(merged, gpus))
    return found


def block_groups(block: dict, gpus: int | None) -> list[Group]:
    if "points" in block:
        points = [tuple(point) for point in block["points"]]
    else:
        points = [(b, l) for b in block["grid"]["batch_sizes"] for l in block["grid"]["seq_lens"]]
    points = tuple(sorted(points, key=lambda p: (p[0] * p[1], p[0])))
    hyperparameters = hyperparameters_of(block, "plan")
    return [Group(model, client, precision, n, sharding, adapter, bool(checkpointing), points,
                  block.get("split", "tuned"), int(block.get("timeout_seconds", DEFAULT_TIMEOUT)), group, tp, deepspeed,
                  hyperparameters, block.get("alloc_conf"), bool(block.get("memory_history", False)), rollout,
                  packing)
            for n in sorted(block.get("num_gpus", [2])) if gpus is None or n <= gpus
            for model in block["models"] for client in block.get("clients", ["loop"])
            for precision in block.get("precisions") or [DEFAULT_PRECISION[client]]
            for sharding, group, tp, deepspeed in block_layouts(block, n)
            for adapter in block.get("adapters", ["full"])
            for checkpointing in block.get("checkpointing", [client in CHECKPOINTING_CLIENTS])
            for rollout in (rollouts_of(block, "plan") if client in ROLLOUT_CLIENTS else [None])
            for packing in (packings_of(block, "plan") if client == "sft" else [None])]


def hyperparameters_of(block: dict, path) -> str | None:
    """The block's TrainingArguments numbers as the rank takes them (`Hyperparameters.to_text()`)."""
    from pipeline.training.hyperparameters import Hyperparameters

    given = block.get("hyperparameters") or {}
    if not isinstance(given, dict):
        raise UserError(f"{path}: hyperparameters is a mapping of TrainingArguments keys")
    return Hyperparameters.of(given, str(path)).to_text()


def rollouts_of(block: dict, path) -> list[str]:
    """The block's rollouts (grpo, rloo) as the rank takes them (`Rollout.to_text()`); TRL's defaults where none."""
    from pipeline.training.rollout import Rollout

    given = block.get("rollouts") or [{}]
    if not isinstance(given, list) or not all(isinstance(keys, dict) for keys in given):
        raise UserError(f"{path}: rollouts is a list of mappings of GRPOConfig keys")
    rollout_clients = [c for c in block.get("clients", ["loop"]) if c in ROLLOUT_CLIENTS]
    if block.get("rollouts") and not rollout_clients:
        raise UserError(f"{path}: rollouts are the grpo and rloo clients' settings")
    for client in rollout_clients[1:]:  # each client's own check (RLOO has no loss_type)
        for keys in given:
            Rollout.of(keys, str(path), client)
    return [Rollout.of(keys, str(path), client).to_text() for keys in given for client in rollout_clients[:1]]


def packings_of(block: dict, path) -> list[str | None]:
    """The block's packings (sft) as the rank takes them (`Packing.to_text()`): each a mapping of `packing` and
    `padding_free` (true or false; neither on: B rows of L tokens, None); [None] where none are given."""
    from pipeline.training.packing import Packing

    given = block.get("packings")
    if given is None:
        return [None]
    if not isinstance(given, list) or not given or not all(isinstance(keys, dict) for keys in given):
        raise UserError(f"{path}: packings is a list of mappings of packing and padding_free")
    if "sft" not in block.get("clients", ["loop"]):
        raise UserError(f"{path}: packings are the sft client's settings")
    found = []
    for keys in given:
        if not keys or set(keys) - {"packing", "padding_free"}:
            raise UserError(f"{path}: each of packings is a mapping of packing and padding_free")
        packing = Packing.of(keys.get("packing"), keys.get("padding_free"), f"{path}: packings")
        found.append(packing.to_text() if packing is not None else None)
    return found


def block_layouts(block: dict, num_gpus: int) -> list[tuple]:
    """(sharding, shard_group, tensor_parallel, deepspeed) of a block on `num_gpus` GPUs: the valid layouts among
    each sharding with each T (hsdp with each of its shard groups; zero1-3 with the stage's default config), and
    each of its DeepSpeed config files (`training.zero.read_deepspeed`: the stage is the file's)."""
    from pipeline.training.zero import STAGES, default_config, read_deepspeed

    found = []
    for path in block.get("deepspeed", []):
        settings = read_deepspeed(path)
        found.append((settings["sharding"], None, 1, settings["deepspeed"]))
    for tp in block.get("tensor_parallel", [1]):
        for sharding in block.get("shardings", [] if "deepspeed" in block else ["ddp", "fsdp"]):
            for group in block.get("shard_groups", [None]) if sharding == "hsdp" else [None]:
                try:
                    Layout(num_gpus, sharding, group, tp)
                except UserError:
                    continue
                found.append((sharding, group, tp, default_config(sharding) if sharding in STAGES else None))
    return found


def settled_by(point: tuple, oom_at: list) -> tuple | None:
    """The smaller out-of-memory point that settles `point` (B' >= B and L' >= L), or None."""
    return next((o for o in oom_at if point[0] >= o[0] and point[1] >= o[1]), None)
