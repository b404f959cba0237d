"""LoRA and QLoRA (docs/definitions.md): what an adapter setting is (`AdapterSpec`), and PEFT's own
code putting it on a model (`apply_adapters`), for the measurement on a GPU and the simulator alike.

    LoRA:  peft.get_peft_model(model, LoraConfig(r, lora_alpha=2r, target_modules, lora_dropout,
           task_type="CAUSAL_LM"))
           on a frozen base in the precision's dtype; with checkpointing the base calls
           enable_input_require_grads() first.
    QLoRA: the base loaded with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
           bnb_4bit_compute_dtype=bfloat16) (or load_in_8bit for int8), then
           peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=...), then the adapters.

The optimizer takes the trainable parameters only (`trainable_parameters`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline.core.errors import UserError
from pipeline.core.io import cell
from pipeline.core.io import read_json_object
from pipeline.core.text import short
from pipeline.core.vocabulary import (ADAPTER_METHODS, MAX_LORA_RANK, QUANTIZATIONS, check_bool, check_choice,
                                      check_positive_int)

ALL_LINEAR = "all-linear"
QUANT_STORAGES = ("uint8", "bfloat16")
SHARDED_QUANT_STORAGE = ("fsdp", "fsdp-no-reshard", "zero3")


def normalise_targets(targets) -> str:
    """`all-linear` or module names joined by commas (a list is accepted), sorted, without blanks."""
    if isinstance(targets, (list, tuple)):
        names = [str(t).strip() for t in targets]
    elif isinstance(targets, str):
        if targets.strip() == ALL_LINEAR:
            return ALL_LINEAR
        names = [t.strip() for t in targets.split(",")]
    else:
        raise UserError(f"lora targets must be {ALL_LINEAR!r} or module names separated by commas, not {targets!r}")
    names = sorted(set(n for n in names if n))
    if not names:
        raise UserError(f"lora targets must be {ALL_LINEAR!r} or module names separated by commas, not {targets!r}")
    if ALL_LINEAR in names:
        raise UserError(f"lora targets: {ALL_LINEAR!r} cannot be combined with module names")
    return ",".join(names)


# adapter_config.json options that change memory in ways no estimator models (named in the notes),
# and its options that must be JSON booleans.
PEFT_UNMODELLED = {"use_dora": "DoRA (use_dora)", "modules_to_save": "modules_to_save (fully trained modules)",
                   "bias": "trained biases (bias)", "layers_to_transform": "layers_to_transform",
                   "rank_pattern": "per-module ranks (rank_pattern)"}
PEFT_FLAGS = ("use_dora", "use_rslora", "fan_in_fan_out", "inference_mode")


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter setting: LoRA of rank `r` (scale `alpha`, default 2r) on `targets`, on a base that
    is not quantized (`lora`) or quantized (`qlora`: nf4 4-bit or int8 8-bit), with PEFT's dropout on each
    adapter's input (`dropout`, LoraConfig's lora_dropout: PEFT's default 0; TRL's `--use_peft` 0.05)."""

    method: str = "lora"
    r: int = 16
    alpha: int | None = None
    targets: str = ALL_LINEAR
    quantization: str | None = None
    # bnb_4bit_quant_storage: the dtype the packed 4-bit weights are stored in; bfloat16 where FSDP or ZeRO-3 shards
    # them (`for_sharding`: FSDP2 leaves integer tensors out of its sharding, FSDP1 cannot flatten them)
    quant_storage: str = "uint8"
    # lora_dropout: above 0, each adapted layer's input is dropped out anew for its adapter (a copy and a mask saved)
    dropout: float = 0.0
    # what the adapter's config asks for that no estimator models (named in the answer's notes)
    notes: tuple = field(default=(), compare=False)

    def __post_init__(self):
        check_choice("adapter method", self.method, ADAPTER_METHODS)
        object.__setattr__(self, "r", check_positive_int("lora r", self.r, MAX_LORA_RANK))
        if self.alpha is None:
            object.__setattr__(self, "alpha", 2 * self.r)
        object.__setattr__(self, "alpha", check_positive_int("lora alpha", self.alpha))
        object.__setattr__(self, "targets", normalise_targets(self.targets))
        quantization = self.quantization
        if self.method == "qlora" and quantization is None:
            quantization = "nf4"
            object.__setattr__(self, "quantization", quantization)
        if quantization is not None:
            check_choice("quantization", quantization, QUANTIZATIONS)
        if self.method == "lora" and quantization is not None:
            raise UserError("a quantized base is QLoRA: method qlora (lora has no quantization)")
        check_choice("bnb_4bit_quant_storage", self.quant_storage, QUANT_STORAGES)
        object.__setattr__(self, "dropout", check_dropout(self.dropout))

    def for_sharding(self, sharding: str | None) -> AdapterSpec:
        """The spec as a run sharded by `sharding` loads its base: a 4-bit base stored in bfloat16 under FSDP and
        ZeRO-3, as the FSDP + QLoRA recipes (PEFT's, Axolotl's) load it, so that the packed weights shard."""
        if self.quantization == "nf4" and sharding in SHARDED_QUANT_STORAGE:
            return replace(self, quant_storage="bfloat16")
        return self

    @classmethod
    def make(cls, r: int, alpha: int | None = None, targets=ALL_LINEAR, quantization: str | None = None,
             dropout: float | None = None) -> AdapterSpec:
        """LoRA, or QLoRA when `quantization` is given (the estimators' and the plan's arguments)."""
        return cls("qlora" if quantization else "lora", r, alpha, targets, quantization,
                   dropout=0.0 if dropout is None else dropout)

    @classmethod
    def from_peft_config(cls, source, quantization: str | None = None) -> AdapterSpec:
        """The spec of PEFT's adapter_config.json (a path, a folder holding it, or its dict): r,
        lora_alpha, target_modules and lora_dropout."""
        data = source if isinstance(source, dict) else _read_adapter_config(source)
        if data.get("peft_type", "LORA") != "LORA":
            raise UserError(f"adapter config: peft_type {short(data.get('peft_type'))} is not LORA")
        if "r" not in data:
            raise UserError("adapter config: no 'r' (the LoRA rank)")
        targets = data.get("target_modules")
        if targets is None:
            raise UserError("adapter config: no 'target_modules'")
        for flag in PEFT_FLAGS:
            if data.get(flag) is not None:
                check_bool(f"adapter config: {flag}", data[flag])
        notes = tuple(f"adapter config: {what} is not modelled" for key, what in PEFT_UNMODELLED.items()
                      if data.get(key) not in (None, False, [], "none"))
        spec = cls.make(data["r"], data.get("lora_alpha"), targets, quantization, data.get("lora_dropout"))
        return replace(spec, notes=notes)

    @property
    def target_names(self) -> list[str] | str:
        """LoraConfig's target_modules: "all-linear" or the list of names."""
        return ALL_LINEAR if self.targets == ALL_LINEAR else self.targets.split(",")

    def columns(self) -> dict:
        """The peak table's adapter columns (`ADAPTER_COLUMNS`)."""
        return {"lora_r": self.r, "lora_alpha": self.alpha, "lora_targets": self.targets,
                "quantization": self.quantization, "lora_dropout": self.dropout}

    @classmethod
    def from_row(cls, row) -> AdapterSpec | None:
        """The adapter of a row of a peak table (a dict or a named tuple; None: full fine-tuning). A row written
        before the lora_dropout column ran without dropout."""
        r, alpha, targets, quantization, dropout = (cell(row, name) for name in ADAPTER_COLUMNS)
        if r is None:
            return None
        return cls.make(int(r), None if alpha is None else int(alpha), targets or ALL_LINEAR, quantization or None,
                        float(dropout or 0.0))


# The peak tables' adapter columns (None for full fine-tuning).
ADAPTER_COLUMNS = ("lora_r", "lora_alpha", "lora_targets", "quantization", "lora_dropout")


def check_dropout(value) -> float:
    """LoRA dropout: a probability in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise UserError(f"lora dropout must be a number in [0, 1), not {short(value)}")
    return float(value)


def _read_adapter_config(path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "adapter_config.json"
    return read_json_object(path, "adapter config not found", "not valid JSON", "not a JSON object")


def linear_module_names(model) -> list[str]:
    """Leaf names of the modules LoRA can target (nn.Linear and its bitsandbytes subclasses,
    transformers' Conv1D), the output head included."""
    import torch

    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if name and (isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D")}
    return sorted(names)


def check_targets(model, spec: AdapterSpec) -> None:
    """UserError naming the modules that exist when a target names none of the model's."""
    if spec.targets == ALL_LINEAR:
        return
    existing = linear_module_names(model)
    unknown = [name for name in spec.target_names if name not in existing]
    if unknown:
        model_type = getattr(getattr(model, "config", None), "model_type", "this model")
        raise UserError(f"lora targets {', '.join(unknown)}: no such module in {model_type}; "
                        f"its linear modules are {', '.join(existing)}")


def lora_config(spec: AdapterSpec):
    from peft import LoraConfig

    return LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=spec.target_names, lora_dropout=spec.dropout,
                      task_type="CAUSAL_LM")


def apply_adapters(model, spec: AdapterSpec, gradient_checkpointing: bool):
    """PEFT's own code on `model` (wrapped in place): the PeftModel to train.

    A quantized base (loaded with its BitsAndBytesConfig) goes through prepare_model_for_kbit_training
    first; with checkpointing, a LoRA base calls enable_input_require_grads()."""
    import peft

    check_targets(model, spec)
    if spec.quantization:
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    elif gradient_checkpointing:
        model.enable_input_require_grads()
    return peft.get_peft_model(model, lora_config(spec))


def trainable_parameters(model) -> int:
    """Parameters that take gradients (the adapters' for a PeftModel)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def quantization_config(spec: AdapterSpec):
    """The BitsAndBytesConfig of a QLoRA base."""
    import torch
    from transformers import BitsAndBytesConfig

    if spec.quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                              bnb_4bit_quant_storage=getattr(torch, spec.quant_storage))


# --- the model of an adapter point, built fresh (PEFT wraps modules in place) ---------------------

def saved_base_folder(config, model_id: str) -> Path:
    """Where the random init of a model is saved: under $AVP_ADAPTER_BASES, else the temporary
    folder's avp-adapter-bases, named by the model id and a digest of its config."""
    import hashlib
    import tempfile

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_id)
    digest = hashlib.sha1(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:10]
    root = os.environ.get("AVP_ADAPTER_BASES") or Path(tempfile.gettempdir()) / "avp-adapter-bases"
    return Path(root) / f"{safe}-{digest}"


def remove_saved_base(config, model_id: str) -> None:
    """The saved random init goes when its job ends (an 8B model's is 16 GB of disk)."""
    import shutil

    shutil.rmtree(saved_base_folder(config, model_id), ignore_errors=True)


def saved_base(config, model_id: str) -> Path:
    """A folder holding a random init of the model in bf16 (safetensors), saved once per model:
    the weights' values change no memory, and a quantized base is loaded from a checkpoint."""
    import torch

    from pipeline.inputs.modeling import build_model, training_config

    import shutil

    folder = saved_base_folder(config, model_id)
    if (folder / "complete").exists():
        return folder
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(training_config(config), device=device, dtype=torch.bfloat16)
    writing = folder.with_name(f"{folder.name}.writing-{os.getpid()}")  # two writers of one model never mix files
    model.save_pretrained(writing)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    (writing / "complete").touch()
    if not (folder / "complete").exists():  # an earlier crashed write, not another writer's finished copy
        shutil.rmtree(folder, ignore_errors=True)
    try:
        writing.rename(folder)
    except OSError:  # another process's complete copy got there first
        shutil.rmtree(writing, ignore_errors=True)
    return folder


def load_quantized(folder, spec: AdapterSpec, precision: str, attn: str = "default", device: str = "cuda"):
    """The base reloaded with its BitsAndBytesConfig, the unquantized weights in the precision's dtype."""
    from transformers import AutoModelForCausalLM

    from pipeline.inputs.modeling import model_dtype

    import torch

    kwargs = {} if attn == "default" else {"attn_implementation": attn}
    if device == "cuda":  # this process's GPU (a rank's, under torchrun)
        device = f"cuda:{torch.cuda.current_device()}"
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization_config(spec),
                                                dtype=model_dtype(precision), device_map=device, **kwargs)


def build_adapter_model(config, model_id: str, spec: AdapterSpec, precision: str, attn: str, device: str,
                        gradient_checkpointing: bool):
    """The PeftModel of one point: `build_adapter_base`, then `apply_adapters`."""
    model = build_adapter_base(config, model_id, spec, precision, attn, device)
    return apply_adapters(model, spec, gradient_checkpointing)


def build_adapter_base(config, model_id: str, spec: AdapterSpec, precision: str, attn: str, device: str):
    """The base of one adapter point, fresh: random weights in the precision's dtype, or the quantized
    reload of a saved random init."""
    from pipeline.inputs.modeling import build

    if spec.quantization:
        return load_quantized(saved_base(config, model_id), spec, precision, attn, device)
    return build(config, precision, attn, device)


# --- command-line arguments (measure here; the lead's estimate) -------------------------------------

def add_adapter_arguments(parser) -> None:
    """--lora-r, --lora-alpha, --lora-targets, --lora-dropout, --quantization, --peft-config."""
    from pipeline.core.arguments import positive_int

    parser.add_argument("--lora-r", type=positive_int, metavar="R", help="LoRA rank (adapters on a frozen base)")
    parser.add_argument("--lora-alpha", type=positive_int, metavar="A", help="LoRA alpha (default 2r)")
    parser.add_argument("--lora-targets", metavar="MODULES",
                        help=f"{ALL_LINEAR} (default) or module names separated by commas (q_proj,v_proj)")
    parser.add_argument("--lora-dropout", type=float, metavar="P",
                        help="LoRA dropout on each adapter's input (default 0, PEFT's; TRL's --use_peft takes 0.05)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, help="QLoRA: the base quantized by bitsandbytes")
    parser.add_argument("--peft-config", metavar="FILE",
                        help="PEFT's adapter_config.json (r, lora_alpha, target_modules, lora_dropout)")


def adapter_from_arguments(args) -> AdapterSpec | None:
    """The AdapterSpec the arguments ask for (None: full fine-tuning)."""
    return adapter_from_options(args.lora_r, args.lora_alpha, args.lora_targets, args.quantization, args.peft_config,
                                args.lora_dropout)


def adapter_from_options(lora_r=None, lora_alpha=None, lora_targets=None, quantization=None,
                         peft_config=None, lora_dropout=None) -> AdapterSpec | None:
    """The AdapterSpec of the options (command line or Python; None: full fine-tuning)."""
    if peft_config:
        if lora_r or lora_alpha or lora_targets or lora_dropout is not None:
            raise UserError("--peft-config gives r, alpha, targets and dropout: leave out --lora-r, --lora-alpha, "
                            "--lora-targets, --lora-dropout")
        return AdapterSpec.from_peft_config(peft_config, quantization)
    if lora_r is None:
        if lora_alpha or lora_targets or quantization or lora_dropout is not None:
            raise UserError("--lora-alpha, --lora-targets, --lora-dropout and --quantization need --lora-r "
                            "(or --peft-config)")
        return None
    return AdapterSpec.make(lora_r, lora_alpha, lora_targets or ALL_LINEAR, quantization, lora_dropout)
