"""Config facts -> the formula's features: plain `config.json` dicts in, numbers out (no torch).

`read_facts(config)` reads the shape of a decoder from a config.json dict under the usual field
aliases (`FIELDS`), with the model type's defaults where the file leaves a field out, and lists
what it could not read (`Facts.unread`). `parameter_count(facts)` is N in closed form (tied weights
once; MoE: total and active per token). `feature_values(facts, seq_len)` are the formula's terms
per token (`FEATURES` defines each in config.json names).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.inputs.aliases import FIELDS, names_of

# Architectures whose MLP has two matrices (up, down): every other one is gated (gate, up, down).
NOT_GATED = {"gpt2", "gpt_neox", "opt", "bloom", "falcon", "gpt_bigcode", "gpt_neo", "codegen", "xglm",
             "starcoder2", "phi", "mpt", "gptj", "persimmon", "nemotron"}
GATED_ACTIVATIONS = ("silu", "swish", "glu")
KNOWN_GATED = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma", "gemma2",
               "gemma3_text", "phi3", "phimoe", "olmo", "olmo2", "olmoe", "cohere", "cohere2", "granite",
               "granitemoe", "stablelm", "deepseek_v2", "deepseek_v3", "dbrx", "jetmoe", "glm", "glm4_moe",
               "llama4_text", "smollm3", "gpt_oss", "recurrent_gemma"}
# Learned position embeddings (extra rows: OPT keeps 2 more).
LEARNED_POSITIONS = {"gpt2": 0, "gpt_bigcode": 0, "gpt_neo": 0, "opt": 2}
# Biases and norms by architecture: (q/k/v bias, output bias, MLP bias, norm has a bias, norms per layer, lm head bias)
LAYOUT = {
    "gpt2": (1, 1, 1, 1, 2, 0), "gpt_neox": (1, 1, 1, 1, 2, 0), "opt": (1, 1, 1, 1, 2, 0),
    "bloom": (1, 1, 1, 1, 2, 0), "gpt_bigcode": (1, 1, 1, 1, 2, 0), "gpt_neo": (0, 1, 1, 1, 2, 0),
    "codegen": (0, 0, 1, 1, 1, 1), "xglm": (1, 1, 1, 1, 2, 0), "starcoder2": (1, 1, 1, 1, 2, 0),
    "phi": (1, 1, 1, 1, 1, 1), "gptj": (0, 0, 1, 1, 1, 1), "persimmon": (1, 1, 1, 1, 2, 0),
    "stablelm": (0, 0, 0, 1, 2, 0), "qwen2": (1, 0, 0, 0, 2, 0), "qwen2_moe": (1, 0, 0, 0, 2, 0),
    "mpt": (0, 0, 0, 0, 2, 0), "olmo": (0, 0, 0, 0, 0, 0), "cohere": (0, 0, 0, 0, 1, 0),
    "cohere2": (0, 0, 0, 0, 1, 0), "nemotron": (0, 0, 0, 1, 2, 0), "falcon": (0, 0, 0, 1, 2, 0),
}
DEFAULT_LAYOUT = (0, 0, 0, 0, 2, 0)  # llama-like: no biases, RMSNorm weight only, two norms per layer
# Implementations that run every routed expert on every token (the router only weights the outputs).
EVERY_EXPERT = {"llama4_text"}
RECURRENT = {"mamba", "mamba2", "recurrent_gemma", "rwkv"}
# Architectures that run eager attention whatever is asked (no SDPA path in the transformers measured).
EAGER_ONLY = {"bloom", "codegen", "gpt_neo", "xglm"}
# Dropout probabilities (hidden states, attention probabilities) the model type's config defaults to, where
# not zero; the config's own fields (DROPOUT_FIELDS) win. Training mode keeps a mask per dropout.
DROPOUT_DEFAULTS = {"gpt2": (0.1, 0.1), "gpt_bigcode": (0.1, 0.1), "opt": (0.1, 0.0), "xglm": (0.1, 0.1)}
DROPOUT_FIELDS = (("resid_pdrop", "hidden_dropout", "resid_dropout", "dropout"), ("attn_pdrop", "attention_dropout"))
# MLP activations written as several elementwise ops in Python (each saves its input): tanh-approximated GELU
# and QuickGELU; the model type's default activation where the config names none.
COMPOSITE_ACTIVATIONS = ("gelu_new", "gelu_fast", "quick_gelu")
DEFAULT_ACTIVATION = {"gpt2": "gelu_new", "gpt_neo": "gelu_new", "codegen": "gelu_new", "gptj": "gelu_new",
                      "phi": "gelu_new", "gpt_bigcode": "gelu_pytorch_tanh"}
# Architectures whose norms are torch's LayerNorm (F.layer_norm: on CUDA autocast's fp32 list), and those whose
# partial rotary embedding mixes fp32 and 16-bit halves of the queries and keys (their concatenation is fp32).
LAYER_NORM_TYPES = {"gpt2", "gpt_neox", "opt", "bloom", "gpt_bigcode", "gpt_neo", "codegen", "xglm", "starcoder2",
                    "phi", "gptj", "persimmon", "stablelm", "nemotron", "falcon", "mpt"}
PARTIAL_ROTARY_TYPES = {"phi", "stablelm", "persimmon"}
# Bytes the peak holds beside weights, gradients, state and activations: cuBLAS workspaces (2 x 32 MiB + 1 MiB).
WORKSPACE_BYTES = 65 << 20
# Bytes per logit of the loss's backward at its start: the fp32 gradient of log_softmax and of its input.
LOSS_BACKWARD_BYTES = 8

FEATURES = {
    "embedding": "hidden_size (the embedding output of one token)",
    "hidden": "num_hidden_layers x hidden_size (residual stream, norms, layer outputs)",
    "attention": "attention layers x (num_attention_heads + 2 x num_key_value_heads) x head_dim (q, k, v)",
    "attention_output": "attention layers x num_attention_heads x head_dim (attention context)",
    "mlp": "dense layers x MLP width (intermediate_size; shared experts added)",
    "mlp_gated": "gated dense layers x MLP width (the third matrix of a gated MLP)",
    "experts": "MoE layers x num_experts_per_tok x moe_intermediate_size (routed expert width per token; "
               "num_experts instead of num_experts_per_tok where every expert runs on every token: Llama 4)",
    "router": "MoE layers x num_experts (router logits)",
    "recurrent": "recurrent layers x expand x hidden_size (state-space / recurrent inner width)",
    "vocabulary": "vocab_size (logits of one token)",
    "scores": "attention layers x num_attention_heads x L (attention scores per token; a sliding window masks them, "
              "the kernels still compute L x L), "
              "only where the kernel materialises them (`attention_kernel`: eager, or SDPA's math fallback)",
    "mlp_composite": "dense layers x MLP width where the activation is composed of elementwise ops "
                     "(activation_function / hidden_act in gelu_new, gelu_fast, quick_gelu)",
    "dropout": "(2 x num_hidden_layers + 1) x hidden_size where hidden-state dropout is on in training "
               "(resid_pdrop / dropout > 0, the model type's default included): the masks of the attention output, "
               "the MLP output and the embeddings",
    "scores_dropout": "the scores term again where attention-probability dropout is on (attn_pdrop / "
                      "attention_dropout > 0) and the scores are materialised (its mask and output)",
    "mask": "attention layers x L where a sliding window makes SDPA take an explicit mask (one mask row per "
            "token and layer, converted to the activation dtype)",
}
PER_LAYER = ("attention", "attention_output", "mlp", "mlp_gated", "mlp_composite", "experts", "router", "recurrent", "scores",
             "scores_dropout", "mask")
KERNELS = {
    "eager": "eager attention: the architecture has no SDPA path (EAGER_ONLY) or eager was asked for",
    "math": "SDPA's math fallback: fp32 with grouped key/value heads and no mask (flash needs 16-bit; the "
            "memory-efficient kernel takes no GQA), or a head_dim the fused kernels cannot align",
    "fused": "flash or memory-efficient SDPA: scores never materialised",
}


@dataclass
class Facts:
    """A decoder's shape, read from a config.json dict."""

    model_type: str
    hidden: int
    layers: int
    vocab: int
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    q_dim: int = 0  # width of the query (MLA: its own head dims)
    kv_dim: int = 0  # width of keys + values together
    intermediate: int = 0
    gated: bool = True
    tied: bool = True
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    moe_layers: int = 0
    shared_intermediate: int = 0
    recurrent_layers: int = 0
    recurrent_width: int = 0
    window: int | None = None
    window_layers: int = 0
    positions: int = 0
    mla: tuple = ()  # (q_lora_rank, kv_lora_rank, qk_rope_head_dim, v_head_dim) of multi-head latent attention
    state_size: int = 0  # state-space models: (time_step_rank, state_size, conv_kernel)
    time_step_rank: int = 0
    conv_kernel: int = 4
    embed_width: int = 0  # OPT's word_embed_proj_dim (projected in and out), else hidden
    dropout: tuple = (0.0, 0.0)  # (hidden states, attention probabilities) in training
    composite: bool = False  # the MLP activation is composed of elementwise ops
    activation: str = ""  # the MLP activation's name (hidden_act / activation_function, or the type's default)
    unread: list = field(default_factory=list)

    @property
    def attention_layers(self) -> int:
        return self.layers - self.recurrent_layers

    @property
    def dense_layers(self) -> int:
        """Layers with a dense MLP (recurrent Gemma's recurrent blocks have one, Mamba's do not)."""
        mlp_free = 0 if self.model_type == "recurrent_gemma" else self.recurrent_layers
        return self.layers - self.moe_layers - mlp_free


def lookup(config: dict, names):
    """The first of `names` with a value in the config or one of its nested dicts (None if none)."""
    nested = [v for v in config.values() if isinstance(v, dict)]
    for source in (config, *nested):
        for name in names:
            value = source.get(name)
            if value is not None and not isinstance(value, bool):
                return value
    return None


def _int(config: dict, fact: str, default=None, unread=None):
    value = lookup(config, names_of(fact, config.get("model_type")))
    if isinstance(value, (int, float)) and value > 0:
        return int(value)
    if unread is not None:
        unread.append(f"{fact} ({'/'.join(FIELDS[fact][:3])})")
    return default


def read_facts(config: dict) -> Facts:
    """The shape facts of a config.json dict; `unread` names the terms taken as zero or a default."""
    if "text_config" in config and isinstance(config["text_config"], dict):
        config = {**config["text_config"], "model_type": config["text_config"].get("model_type", config.get("model_type"))}
    unread = []
    model_type = str(config.get("model_type") or "")
    hidden = _int(config, "hidden", 0, unread)
    layers = _int(config, "layers", 0, unread)
    vocab = _int(config, "vocab", 0, unread)
    facts = Facts(model_type, hidden, layers, vocab, unread=unread)
    facts.tied = bool(config.get("tie_word_embeddings", True))
    if model_type in RECURRENT:
        _read_recurrent(facts, config)
    if facts.recurrent_layers < layers:
        _read_attention(facts, config)
    _read_mlp(facts, config)
    _read_moe(facts, config)
    _read_window(facts, config)
    facts.embed_width = int(config.get("word_embed_proj_dim") or hidden)
    facts.dropout = _dropout(config, model_type)
    if model_type == "llama4_text" and config.get("intermediate_size_mlp"):
        facts.intermediate = int(config["intermediate_size_mlp"])  # dense layers; experts keep intermediate_size
    offset = LEARNED_POSITIONS.get(model_type)
    if offset is not None:
        facts.positions = _int(config, "positions", 1024) + offset
    return facts


def _dropout(config: dict, model_type: str) -> tuple:
    defaults = DROPOUT_DEFAULTS.get(model_type, (0.0, 0.0))
    values = []
    for names, default in zip(DROPOUT_FIELDS, defaults):
        value = next((config[n] for n in names if isinstance(config.get(n), (int, float))), default)
        values.append(float(value))
    return tuple(values)


def _read_recurrent(facts: Facts, config: dict) -> None:
    if facts.model_type == "recurrent_gemma":
        pattern = config.get("block_types") or ["recurrent", "recurrent", "attention"]
        kinds = [pattern[i % len(pattern)] for i in range(facts.layers)]
        facts.recurrent_layers = sum(kind == "recurrent" for kind in kinds)
        facts.recurrent_width = int(config.get("lru_width") or facts.hidden)
    else:
        facts.recurrent_layers = facts.layers
        facts.recurrent_width = int(config.get("expand", 2) * facts.hidden)
        facts.state_size = int(config.get("state_size") or 16)
        facts.time_step_rank = int(config.get("time_step_rank") or -(-facts.hidden // 16))
        facts.conv_kernel = int(config.get("conv_kernel") or 4)


def _read_attention(facts: Facts, config: dict) -> None:
    heads = _int(config, "heads", 0, facts.unread)
    kv = _int(config, "kv_heads", None)
    if kv is None:
        kv = 1 if config.get("multi_query") and not config.get("new_decoder_architecture") else heads
    head_dim = _int(config, "head_dim", None) or (facts.hidden // heads if heads else 0)
    facts.heads, facts.kv_heads, facts.head_dim = heads, kv, head_dim
    facts.q_dim, facts.kv_dim = heads * head_dim, 2 * kv * head_dim
    if config.get("kv_lora_rank"):  # multi-head latent attention: per-head nope + rope query and key, own v width
        qk = int(config.get("qk_nope_head_dim", 0)) + int(config.get("qk_rope_head_dim", 0))
        facts.q_dim = heads * qk
        facts.kv_dim = heads * (qk + int(config.get("v_head_dim") or head_dim))
        facts.mla = (int(config.get("q_lora_rank") or 0), int(config["kv_lora_rank"]),
                     int(config.get("qk_rope_head_dim", 0)), int(config.get("v_head_dim") or head_dim))


def _read_mlp(facts: Facts, config: dict) -> None:
    act = str(config.get("hidden_act") or config.get("activation_function") or config.get("hidden_activation") or "")
    facts.gated = facts.model_type not in NOT_GATED
    facts.activation = act or DEFAULT_ACTIVATION.get(facts.model_type, "")
    facts.composite = facts.activation in COMPOSITE_ACTIVATIONS
    if facts.model_type not in NOT_GATED | KNOWN_GATED and act:
        facts.gated = any(g in act for g in GATED_ACTIVATIONS)  # an unknown architecture: by its activation
    width = _int(config, "intermediate", None)
    if width is None and config.get("expansion_ratio"):
        width = int(config["expansion_ratio"] * facts.hidden)
    if width is None and facts.recurrent_layers < facts.layers:
        width = 4 * facts.hidden  # GPT-2, Falcon, BLOOM: 4 x hidden when the file says nothing
        if facts.model_type not in {"gpt2", "falcon", "bloom", "gpt_neo", "codegen", "gptj", "gpt_bigcode"}:
            facts.unread.append("intermediate (intermediate_size; taken as 4 x hidden_size)")
    if facts.model_type == "recurrent_gemma" and width:
        width //= 2  # its gated MLP's matrices are intermediate_size / 2 wide
    facts.intermediate = width or 0


def _read_moe(facts: Facts, config: dict) -> None:
    experts = _int(config, "experts", 0)
    top_k = _int(config, "top_k", 0)
    if experts < 2 or not top_k:
        return
    facts.experts, facts.top_k = experts, top_k
    facts.moe_intermediate = _int(config, "moe_intermediate", facts.intermediate)
    shared = config.get("shared_expert_intermediate_size") or 0
    if config.get("n_shared_experts"):
        shared = int(config["n_shared_experts"]) * facts.moe_intermediate
    if facts.model_type == "llama4_text":
        shared = facts.intermediate  # one shared expert as wide as a routed one
    facts.shared_intermediate = int(shared)
    facts.moe_layers = _moe_layer_count(facts.layers, config)


def _moe_layer_count(layers: int, config: dict) -> int:
    first_dense = int(config.get("first_k_dense_replace") or 0)
    step = int(config.get("decoder_sparse_step") or config.get("interleave_moe_layer_step")
               or config.get("moe_layer_freq") or 1)
    only_dense = set(config.get("mlp_only_layers") or [])
    return sum(1 for i in range(first_dense, layers) if (i + 1) % step == 0 and i not in only_dense)


def _read_window(facts: Facts, config: dict) -> None:
    window = config.get("sliding_window") or config.get("attention_window_size") or config.get("window_size")
    if not isinstance(window, int) or window <= 0 or config.get("use_sliding_window") is False:
        return
    facts.window = window
    types = config.get("layer_types")
    if isinstance(types, list):
        facts.window_layers = sum("sliding" in str(t) for t in types)
    elif config.get("sliding_window_pattern"):
        pattern = int(config["sliding_window_pattern"])
        facts.window_layers = sum(1 for i in range(facts.layers) if (i + 1) % pattern)
    elif facts.model_type in {"gemma2", "cohere2"}:
        facts.window_layers = facts.attention_layers // 2 + facts.attention_layers % 2
    else:
        facts.window_layers = facts.attention_layers


def parameter_count(facts: Facts) -> tuple[int, int]:
    """(N, parameters active per token) in closed form: embeddings, attention, MLP, experts, norms."""
    qkv_bias, out_bias, mlp_bias, norm_bias, norms, head_bias = LAYOUT.get(facts.model_type, DEFAULT_LAYOUT)
    h, norm = facts.hidden, facts.hidden * (2 if norm_bias else 1)
    width = facts.embed_width or h
    embedding = facts.vocab * width + facts.positions * h + (2 * h * width if width != h else 0)
    head = 0 if facts.tied else facts.vocab * width
    head += facts.vocab if head_bias else 0
    attention = h * (facts.q_dim + facts.kv_dim) + facts.q_dim * h + qkv_bias * (facts.q_dim + facts.kv_dim)
    attention += out_bias * h
    if facts.mla:
        attention = _mla_parameters(facts)
    matrices = 3 if facts.gated else 2

    def mlp(width: int) -> int:
        return matrices * h * width + mlp_bias * (width + h)

    expert = mlp(facts.moe_intermediate) if facts.experts else 0
    moe = h * facts.experts + mlp(facts.shared_intermediate) if facts.shared_intermediate else h * facts.experts
    recurrent = _recurrent_parameters(facts) if facts.recurrent_layers else 0
    final_norm = 0 if facts.model_type == "opt" and width != h else norm
    total = embedding + head + final_norm
    total += facts.attention_layers * (attention + norms * norm)
    total += facts.recurrent_layers * (recurrent + norm)
    total += facts.dense_layers * mlp(facts.intermediate)
    total += facts.moe_layers * (moe + facts.experts * expert)
    active = total - facts.moe_layers * (facts.experts - facts.top_k) * expert
    return int(total), int(active)


def _mla_parameters(facts: Facts) -> int:
    """Multi-head latent attention: low-rank query (or a full one), compressed keys and values, output."""
    q_rank, kv_rank, rope, v_dim = facts.mla
    h, heads, q_dim = facts.hidden, facts.heads, facts.q_dim
    query = h * q_rank + q_rank + q_rank * q_dim if q_rank else h * q_dim
    keys_values = h * (kv_rank + rope) + kv_rank + kv_rank * heads * (q_dim // heads - rope + v_dim)
    return query + keys_values + heads * v_dim * h


def _recurrent_parameters(facts: Facts) -> int:
    """One recurrent block: Mamba's mixer, or recurrent Gemma's block with its attention layers' share apart."""
    h, inner = facts.hidden, facts.recurrent_width
    if facts.model_type == "recurrent_gemma":
        heads = facts.heads or 1
        gates = 2 * (inner * inner // heads + inner)
        return 2 * (h * inner + inner) + inner * h + h + inner * facts.conv_kernel + inner + gates + inner + h
    rank, state = facts.time_step_rank, facts.state_size
    return (2 * h * inner + inner * facts.conv_kernel + inner + inner * (rank + 2 * state)
            + rank * inner + inner + inner * state + inner + inner * h)


def attention_kernel(facts: Facts, precision: str = "bf16", attention: str | None = None) -> str:
    """The kernel CUDA runs the attention with (`KERNELS`), in config terms (pipeline.simulate.sdpa's rule)."""
    if not facts.attention_layers:
        return "fused"
    if attention == "eager" or facts.model_type in EAGER_ONLY:
        return "eager"
    grouped = facts.kv_heads < facts.heads and not facts.mla
    if precision == "fp32" and grouped and facts.window is None:
        return "math"  # GQA reaches SDPA unrepeated only without a mask; fp32 has no flash, efficient no GQA
    if facts.head_dim % (4 if precision == "fp32" else 8):
        return "math"
    return "fused"


def matmul_parameters(facts: Facts) -> int:
    """Weights of the forward's matrix products (attention, MLP, routed and shared experts, recurrent blocks,
    the lm head): what autocast casts to a bf16 copy that autograd keeps for the backward."""
    total, _ = parameter_count(facts)
    width = facts.embed_width or facts.hidden
    embedding = facts.vocab * width + facts.positions * facts.hidden
    norm = facts.hidden * (2 if LAYOUT.get(facts.model_type, DEFAULT_LAYOUT)[3] else 1)
    norms = norm * (1 + facts.layers * LAYOUT.get(facts.model_type, DEFAULT_LAYOUT)[4])
    return int(total - embedding - norms + (facts.vocab * width if facts.tied else 0))


def feature_values(facts: Facts, seq_len: int = 1, kernel: str = "eager") -> dict:
    """The formula's features per token (elements), `FEATURES` order; `seq_len` enters `scores` and `mask`,
    which count only where the attention `kernel` materialises them (default: as the hook count sees it)."""
    attention = facts.attention_layers
    dense_width = facts.intermediate
    dense = facts.dense_layers * dense_width + facts.moe_layers * facts.shared_intermediate
    scores = facts.heads * attention * seq_len  # eager and SDPA's math compute the full L x L, window or not
    materialised = kernel in ("eager", "math")
    return {
        "embedding": facts.hidden,
        "hidden": facts.layers * facts.hidden,
        "attention": attention * (facts.q_dim + facts.kv_dim),
        "attention_output": attention * facts.q_dim,
        "mlp": dense,
        "mlp_gated": dense if facts.gated else 0,
        "experts": facts.moe_layers * facts.moe_intermediate
        * (facts.experts if facts.model_type in EVERY_EXPERT else facts.top_k),
        "router": facts.moe_layers * facts.experts,
        "recurrent": facts.recurrent_layers * facts.recurrent_width,
        "vocabulary": facts.vocab,
        "mlp_composite": dense if facts.composite else 0,
        "dropout": (2 * facts.layers + 1) * facts.hidden if facts.dropout[0] > 0 else 0,
        "scores_dropout": scores if materialised and facts.dropout[1] > 0 else 0,
        "scores": scores if materialised else 0,
        "mask": attention * seq_len if facts.window and kernel == "fused" else 0,
    }


def autocast_fp32_bytes(facts: Facts, checkpointing: bool = False) -> float:
    """Bytes per token that bf16 weights under bf16 autocast save beyond bf16 without autocast: the ops on
    CUDA autocast's fp32 list run on bf16 inputs in fp32. Each LayerNorm keeps an fp32 copy of its input
    where bf16 kept the input itself (2 x hidden more per norm); tanh-GELU written with pow (gelu_new)
    computes its chain in fp32 (6 x its width more per layer); a partial rotary embedding leaves fp32
    queries and keys (2 x their width more per layer). llama-style RMSNorm upcasts to fp32 by itself,
    the same with autocast or without: 0. With checkpointing one layer's tensors live at a time."""
    layers = 1 if checkpointing else facts.layers
    norms = LAYOUT.get(facts.model_type, DEFAULT_LAYOUT)[4]
    total = 0.0
    if facts.model_type in LAYER_NORM_TYPES:
        total += 2 * facts.hidden * (norms * layers + 1)
    if facts.composite and facts.activation == "gelu_new":
        total += 6 * facts.intermediate * min(layers, facts.dense_layers)
    if facts.model_type in PARTIAL_ROTARY_TYPES:
        total += 2 * (facts.q_dim + facts.kv_dim) * min(layers, facts.attention_layers)
    return total


def korthikanti_bytes_per_token(facts: Facts, seq_len: int) -> float:
    """Korthikanti et al. (2022), per layer 34*s*b*h + 5*a*s^2*b bytes (16-bit), per token, all layers."""
    return facts.layers * (34 * facts.hidden + 5 * facts.heads * seq_len)


def feature_rows(records: dict) -> list:
    """One dict per ok configs.json record: N in closed form and the features (per token; `scores` and
    `mask` at L = 1, multiply by L), with the attention kernel per precision: what a refit needs."""
    rows = []
    for model_id, record in sorted(records.items()):
        if record.get("status") != "ok":
            continue
        facts = read_facts(record["config"])
        total, active = parameter_count(facts)
        row = {"model_id": model_id, "family": record.get("family"), "model_type": facts.model_type,
               "parameters_closed_form": total, "active_parameters_closed_form": active,
               "matmul_parameters": matmul_parameters(facts),
               "kernel_fp32": attention_kernel(facts, "fp32"), "kernel_bf16": attention_kernel(facts, "bf16"),
               "unread_terms": "; ".join(facts.unread)}
        row.update({f"feature_{k}": v for k, v in feature_values(facts, 1, "eager").items()})
        row["feature_mask"] = feature_values(facts, 1, "fused")["mask"]  # a mask only where the kernel is fused
        rows.append(row)
    return rows

