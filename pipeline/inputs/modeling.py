"""Models built from their configs: the build itself (meta device or random weights on a device,
in a precision's dtype, for training) and the facts read from a config or a built model
(parameter counts, MoE routing, shape facts of models.parquet).
"""

from __future__ import annotations

import contextlib

from pipeline.inputs.aliases import EXPERT_LAYER_PATTERNS, FIELDS, names_of


@contextlib.contextmanager
def transformers_quiet():
    """transformers' warnings off for the block (defaults of unstated token ids warn, and change no shape)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def context_length(config) -> int | None:
    """The longest position the model takes (None when it has no limit, e.g. state-space models);
    `config` a transformers config or a config.json dict."""
    if isinstance(config, dict):
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        get = text.get
    else:
        text = getattr(config, "get_text_config", lambda: config)()
        get = lambda name: attribute(text, name)  # noqa: E731
    for name in FIELDS["context"]:
        value = get(name)
        if isinstance(value, int) and value > 0:
            return value
    return None


def build_model(config, device: str = "meta", dtype=None, attn_implementation: str | None = None):
    """A causal LM built from its config with no weights loaded (meta) or random weights on `device`.

    trust_remote_code is never passed: only architectures in transformers itself are built.
    """
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype or torch.float32}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    return model


def model_dtype(precision: str):
    """The dtype a precision builds its weights in (`vocabulary.Precision.weights`)."""
    import torch

    from pipeline.core.vocabulary import precision_mode

    return torch.bfloat16 if precision_mode(precision).weights == "bf16" else torch.float32


def training_config(config):
    """A copy of the config for training: use_cache off (also in a nested text config)."""
    import copy

    config = copy.deepcopy(config)
    config.use_cache = False
    text = getattr(config, "get_text_config", lambda: config)()
    text.use_cache = False
    return config


def build(config, precision: str, attn: str = "default", device: str = "cuda"):
    """The model with random weights directly on `device`, in the precision's dtype."""
    attn_implementation = None if attn == "default" else attn
    return build_model(training_config(config), device=device, dtype=model_dtype(precision),
                       attn_implementation=attn_implementation)


def attn_used(model) -> str | None:
    return getattr(model.config, "_attn_implementation", None)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def vocabulary_size(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return min(config.vocab_size, model.get_input_embeddings().num_embeddings)


def parameter_counts(model, config) -> dict:
    """N, embedding, non-embedding and active (per token, MoE) parameters of a built model."""
    import torch

    params = list(model.parameters())  # shared/tied parameters come once
    total = sum(p.numel() for p in params)
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    embedding = sum(p.numel() for p in params if id(p) in embedding_ids)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    untied_head = sum(p.numel() for p in output.parameters() if id(p) not in embedding_ids) if output else 0
    num_experts, top_k = moe_routing(config)
    routed = routed_expert_parameters(model, num_experts)
    active = total - routed * (1 - top_k / num_experts) if routed else total
    return {
        "parameters": total,
        "embedding_parameters": embedding,
        "non_embedding_parameters": total - embedding - untied_head,
        "active_parameters": int(round(active)),
        "routed_expert_parameters": routed,
    }


def moe_routing(config) -> tuple[int | None, int | None]:
    """(number of routed experts, experts selected per token) from a config, under their various names;
    (None, None) for a dense model, also where a hybrid's layer pattern names no expert layer (a dense
    Nemotron-H keeps its config class's default expert count)."""
    text = text_config(config)
    num_experts = first_int(text, FIELDS["experts"])
    top_k = first_int(text, FIELDS["top_k"])
    if not num_experts or num_experts < 2 or not top_k:
        return None, None
    pattern = EXPERT_LAYER_PATTERNS.get(attribute(text, "model_type"))
    if pattern and pattern[1] not in (attribute(text, pattern[0]) or ()):
        return None, None
    return num_experts, top_k


def routed_expert_parameters(model, num_experts: int | None) -> int:
    """Parameters of the routed experts: those of a module named (or of a class named) `*expert*`, not
    a shared expert, stacked with a leading dimension of `num_experts` or in a ModuleList of `num_experts`."""
    import torch

    if not num_experts:
        return 0
    seen, total = set(), 0
    for name, module in model.named_modules():
        names = f"{name.rsplit('.', 1)[-1]} {type(module).__name__}".lower()
        if "expert" not in names or "shared" in names:
            continue
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_experts:
            candidates = list(module.parameters())
        else:  # not recursing: a router's (num_experts, hidden) weight is not an expert
            candidates = [p for p in module.parameters(recurse=False) if p.dim() and p.shape[0] == num_experts]
        for p in candidates:
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def text_config(config):
    """The text part of a config (a transformers config or a config.json dict)."""
    if isinstance(config, dict):
        return config["text_config"] if isinstance(config.get("text_config"), dict) else config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attribute(config, name: str, default=None):
    """`config.name` (default when absent); for a per-layer attribute of a heterogeneous config, which
    transformers refuses to read globally (Gemma 4's head_dim and key/value heads differ in its full
    attention layers), the value most layers have; `config` a transformers config or a config.json dict."""
    if isinstance(config, dict):
        return config.get(name, default)
    if name in (getattr(config, "per_layer_attributes", None) or ()):
        values = [getattr(layer, name, default) for layer in config.per_layer_config]
        return max(values, key=values.count)
    return getattr(config, name, default)


def first_int(config, names) -> int | None:
    """The first of `names` set to an int on the config (a transformers config or a config.json dict)
    or on a nested part of it (e.g. dbrx's ffn_config)."""
    if isinstance(config, dict):
        sources = [config, *(value for value in config.values() if isinstance(value, dict))]
    else:
        sources = [config, *(value for key, value in vars(config).items()
                             if not key.startswith("_") and hasattr(value, "to_dict"))]
    for source in sources:
        for name in names:
            value = attribute(source, name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def architecture_facts(config) -> dict:
    """Shape facts of models.parquet (docs/architecture.md), read from the text config."""
    text = text_config(config)
    heads = first_int(text, names_of("heads", attribute(text, "model_type")))
    hidden = first_int(text, FIELDS["hidden"])
    kv_heads = first_int(text, FIELDS["kv_heads"])
    if kv_heads is None and heads:
        kv_heads = 1 if attribute(text, "multi_query", False) else heads
    head_dim = first_int(text, FIELDS["head_dim"]) or (hidden // heads if hidden and heads else None)
    num_experts, top_k = moe_routing(config)
    return {
        "num_hidden_layers": first_int(text, FIELDS["layers"]),
        "hidden_size": hidden,
        "intermediate_size": first_int(text, FIELDS["intermediate"]),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": first_int(text, FIELDS["vocab"]),
        "context_length": context_length(config),
        "tie_word_embeddings": bool(attribute(text, "tie_word_embeddings", attribute(config, "tie_word_embeddings", False))),
        "attention_kind": attention_kind(text, heads, kv_heads),
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
    }


def attention_kind(text, heads: int | None, kv_heads: int | None) -> str:
    if attribute(text, "kv_lora_rank"):
        return "mla"  # multi-head latent attention (DeepSeek-V2/V3 and kin)
    if not heads:
        return "none"  # state-space and recurrent models
    if kv_heads == heads:
        return "mha"
    return "mqa" if kv_heads == 1 else "gqa"


def decoder_layers(model) -> list:
    """The model's decoder layers: instances of its `_no_split_modules` classes (the modules that
    transformers keeps whole on one device), outermost only; for a model that names none, the
    layers of its top-level ModuleLists of 3 or more (not experts inside a layer)."""
    import torch

    names = set(getattr(model, "_no_split_modules", None) or ())
    layers, inside = [], set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__name__ in names or (not names and isinstance(module, torch.nn.ModuleList) and len(module) >= 3):
            found = list(module) if isinstance(module, torch.nn.ModuleList) else [module]
            layers.extend(found)
            inside.update(id(m) for m in module.modules())
    return layers
