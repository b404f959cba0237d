"""Config facts -> the formula's features: plain `config.json` dicts in, numbers out (no torch).

`read_facts(config)` reads the shape of a decoder from a config.json dict under the usual field
aliases (`FIELDS`), with the model type's defaults where the file leaves a field out, and lists
what it could not read (`Facts.unread`). `parameter_count(facts)` is N in closed form (tied weights
once; MoE: total and active per token). `feature_values(facts, seq_len)` are the formula's terms
per token (`FEATURES` defines each in config.json names).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.formulas.components import WeightShape
from pipeline.formulas.mixers import Mixer, layer_pattern, positive, read_mixer, whole
from pipeline.inputs.aliases import FIELDS, names_of

# Architectures whose MLP has two matrices (up, down): every other one is gated (gate, up, down).
NOT_GATED = {"gpt2", "gpt_neox", "opt", "bloom", "falcon", "gpt_bigcode", "gpt_neo", "codegen", "xglm",
             "starcoder2", "phi", "mpt", "gptj", "persimmon", "nemotron", "nemotron_h", "nanochat", "apertus"}
GATED_ACTIVATIONS = ("silu", "swish", "glu")
KNOWN_GATED = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma", "gemma2",
               "gemma3_text", "phi3", "phimoe", "olmo", "olmo2", "olmoe", "cohere", "cohere2", "granite",
               "granitemoe", "stablelm", "deepseek_v2", "deepseek_v3", "dbrx", "jetmoe", "glm", "glm4_moe",
               "llama4_text", "smollm3", "gpt_oss", "recurrent_gemma", "bitnet", "gemma4_text", "qwen3_5_text",
               "qwen3_5_moe_text", "qwen3_next", "lfm2", "falcon_h1", "granitemoehybrid", "kimi_linear"}
# MLP activations that save more than a gated SiLU (their own term each): relu-squared (relu, then a square
# that CUDA autocast runs in fp32) and xIELU (a dozen elementwise ops in Python).
SQUARED_ACTIVATIONS = ("relu2",)
XIELU_ACTIVATIONS = ("xielu",)
ACTIVATION_FIELDS = ("hidden_act", "activation_function", "hidden_activation", "mlp_hidden_act")
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
    "glm4": (1, 0, 0, 0, 4, 0), "seed_oss": (1, 0, 0, 0, 2, 0), "gemma4_text": (0, 0, 0, 0, 4, 0),
    "gemma2": (0, 0, 0, 0, 4, 0), "gemma3_text": (0, 0, 0, 0, 4, 0),
    "nemotron_h": (0, 0, 0, 0, 1, 0), "nanochat": (0, 0, 0, 0, 0, 0),
}
NORM_FREE = {"nanochat"}  # parameter-free RMS norms (no final norm weight either)
# BitNet normalises inside its blocks: the attention output (hidden_size) and the MLP's product
# (intermediate_size), each a norm with a weight.
SUB_NORMS = {"bitnet"}
# Attention whose query projection also makes an output gate as wide as the queries (attn_output_gate).
GATED_ATTENTION = {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}
# DeepSeek sparse attention: a lightweight indexer per layer picks the keys; SDPA then takes an explicit mask.
SPARSE_INDEXER = {"deepseek_v32", "glm_moe_dsa"}
# query/key norms: always in these types; elsewhere where use_qk_norm / qk_layernorm is true
QK_NORM_TYPES = {"qwen3", "qwen3_moe", "olmo2", "olmoe", "gemma3_text", "gemma4_text", "qwen3_5_text", "qwen3_5_moe_text",
                 "qwen3_next", "exaone4", "olmo3", "hunyuan_v1_dense", "apertus", "nanochat", "lfm2"}
QK_NORM_FIELDS = ("use_qk_norm", "qk_layernorm")
DEFAULT_LAYOUT = (0, 0, 0, 0, 2, 0)  # llama-like: no biases, RMSNorm weight only, two norms per layer
# Implementations that run every routed expert on every token (the router only weights the outputs).
EVERY_EXPERT = {"llama4_text"}
RECURRENT = {"mamba", "mamba2", "recurrent_gemma", "rwkv"}
# Architectures that run eager attention whatever is asked (no SDPA path in the transformers measured).
EAGER_ONLY = {"bloom", "codegen", "gpt_neo", "xglm"}
# Dropout probabilities (hidden states, attention probabilities) the model type's config defaults to, where
# not zero; the config's own fields (DROPOUT_FIELDS) win. Training mode keeps a mask per dropout.
DROPOUT_DEFAULTS = {"gpt2": (0.1, 0.1), "gpt_bigcode": (0.1, 0.1), "opt": (0.1, 0.0), "xglm": (0.1, 0.1),
                    "seed_oss": (0.1, 0.1)}
DROPOUT_FIELDS = (("resid_pdrop", "hidden_dropout", "resid_dropout", "residual_dropout", "dropout"),
                  ("attn_pdrop", "attention_dropout"))
# MLP activations written as several elementwise ops in Python (each saves its input): tanh-approximated GELU
# and QuickGELU; the model type's default activation where the config names none.
COMPOSITE_ACTIVATIONS = ("gelu_new", "gelu_fast", "quick_gelu")
DEFAULT_ACTIVATION = {"gpt2": "gelu_new", "gpt_neo": "gelu_new", "codegen": "gelu_new", "gptj": "gelu_new",
                      "phi": "gelu_new", "gpt_bigcode": "gelu_pytorch_tanh", "nemotron_h": "relu2", "nanochat": "relu2",
                      "bitnet": "relu2", "apertus": "xielu"}
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
    "mask": "attention layers x L where a sliding window (or DeepSeek sparse attention's indexer) makes SDPA take an "
            "explicit mask (one mask row per token and layer, converted to the activation dtype)",
    "mixer_in": "mixer layers x the width of the input projections of a token mixer other than attention "
                "(`pipeline.formulas.mixers`: gated delta-net 2 x linear_num_key_heads x linear_key_head_dim + 2 x "
                "linear_num_value_heads x (linear_value_head_dim + 1); Kimi delta attention; LFM2 3 x hidden_size; "
                "Mamba-2 2 x mamba heads x head dim + 2 x n_groups x ssm_state_size + mamba heads)",
    "mixer_conv": "mixer layers x the channels of its causal depthwise convolution x (L + kernel - 1) / L",
    "mixer_out": "mixer layers x its output width before the output projection (value heads x value head dim; "
                 "Mamba-2's heads x head dim; LFM2 hidden_size)",
    "mixer_keys": "mixer layers x 2 x heads x key (state) width: keys and queries per value head, Mamba-2's B and C "
                  "per head, in fp32; this and the next two terms x ceil(L / chunk) x chunk / L (the chunked scan "
                  "pads L to whole chunks)",
    "mixer_state": "mixer layers x heads x key width x value width / chunk length: the recurrent state kept once per "
                   "chunk of the chunked scan (64 tokens for the gated delta rule, chunk_size for Mamba-2)",
    "mixer_chunk": "mixer layers x heads x chunk length (x the key width where the decay is per channel: Kimi delta "
                   "attention): the within-chunk decays and products of the chunked scan",
    "extra_norms": "layers x hidden_size x the norms per layer beyond two (Gemma 2, 3 and 4 and GLM-4 normalise "
                   "before and after attention and MLP: `LAYOUT`)",
    "mlp_squared": "dense layers x MLP width where the activation is relu-squared (hidden_act / mlp_hidden_act relu2)",
    "mlp_xielu": "dense layers x MLP width where the activation is xIELU (hidden_act xielu)",
    "sub_norms": "layers x (hidden_size + MLP width) where the blocks normalise their attention output and MLP "
                 "product (BitNet's attn_sub_norm and ffn_sub_norm)",
    "per_layer_input": "layers x hidden_size_per_layer_input (Gemma 4's per-layer input embeddings, their gates and "
                       "projections)",
    "indexer": "attention layers x (index_n_heads x index_head_dim + 2 x index_head_dim + index_n_heads): DeepSeek "
               "sparse attention's indexer (no gradient: nothing saved)",
    "qk_norm": "attention layers x (num_attention_heads + num_key_value_heads) x head_dim where queries and keys "
               "are normalised (model type in QK_NORM_TYPES or use_qk_norm / qk_layernorm true; Llama 4: its "
               "layers with rotary embeddings): an RMSNorm's fp32 copies of its input, per element",
}
PER_LAYER = ("attention", "attention_output", "mlp", "mlp_gated", "mlp_composite", "experts", "router", "recurrent", "scores",
             "scores_dropout", "mask", "mixer_in", "mixer_conv", "mixer_out", "mixer_keys", "mixer_state", "mixer_chunk",
             "extra_norms", "mlp_squared", "mlp_xielu", "sub_norms", "per_layer_input", "indexer", "qk_norm")
# The terms tensor parallelism splits across its T GPUs (each rank computes its heads and its slice of the MLP
# width: `base_model_tp_plan`'s colwise q, k, v, gate, up and rowwise o, down); the residual stream, the norms,
# the embeddings' output and the logits (gathered) stay whole on every rank.
TENSOR_PARALLEL_TERMS = ("attention", "attention_output", "mlp", "mlp_gated", "mlp_composite", "experts", "scores",
                         "scores_dropout", "mlp_squared", "mlp_xielu", "qk_norm")
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
    squared: bool = False  # relu-squared MLP activation
    xielu: bool = False  # xIELU MLP activation
    expert_gated: bool = True  # experts with a gate matrix (Nemotron-H's are up and down only)
    # hybrids (`pipeline.formulas.mixers`): per-layer counts read from the layer pattern (None: every layer alike)
    pattern_attention: int | None = None  # layers that attend
    pattern_mlp: int | None = None  # layers with an MLP or experts (Nemotron-H: its '-' and 'E' layers)
    mixer: Mixer | None = None  # the token mixer of the other layers
    mixer_layers: int = 0
    # heterogeneous attention (Gemma 4's full layers, MiMo's sliding ones): (layers, q, kv, out, heads) per kind
    attention_kinds: tuple = ()
    gated_attention: bool = False  # the query projection also makes an output gate as wide as the queries
    extra_dense_width: int = 0  # MLP width beyond dense layers x intermediate (Gemma 4's double-wide layers)
    per_layer_input: int = 0  # Gemma 4's hidden_size_per_layer_input
    per_layer_vocab: int = 0
    indexer: tuple = ()  # (index_n_heads, index_head_dim) of DeepSeek sparse attention
    extra_parameters: int = 0  # beyond attention, mixer, MLP and norms (BitNet's sub-norms, router scales, sinks)
    qk_norm: int = 0  # query and key elements per token that query/key norms normalise (all layers)
    softcap: bool = False  # final_logit_softcapping (logits_soft_cap): the logits divided, tanh'd and scaled
    unread: list = field(default_factory=list)

    @property
    def attention_layers(self) -> int:
        if self.pattern_attention is not None:
            return self.pattern_attention
        return self.layers - self.recurrent_layers

    @property
    def dense_layers(self) -> int:
        """Layers with a dense MLP (recurrent Gemma's recurrent blocks have one, Mamba's do not)."""
        if self.pattern_mlp is not None:
            return self.pattern_mlp - self.moe_layers
        mlp_free = 0 if self.model_type == "recurrent_gemma" else self.recurrent_layers
        return self.layers - self.moe_layers - mlp_free

    @property
    def dense_width(self) -> int:
        """The summed MLP width of the dense layers and of the shared experts beside the routed ones."""
        return self.dense_layers * self.intermediate + self.moe_layers * self.shared_intermediate + self.extra_dense_width

    def attention_totals(self) -> tuple[int, int, int, int]:
        """(query, key + value, attention output, heads) widths summed over the attention layers."""
        if self.attention_kinds:
            return tuple(sum(n * kind[i] for n, *kind in self.attention_kinds) for i in range(4))
        layers = self.attention_layers
        return layers * self.q_dim, layers * self.kv_dim, layers * self.q_dim, layers * self.heads


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
    pattern = layer_pattern(config, model_type, layers)
    if pattern:
        _read_pattern(facts, config, pattern)
    if facts.recurrent_layers < layers:
        _read_attention(facts, config)
    _read_mlp(facts, config)
    _read_moe(facts, config, pattern)
    _read_window(facts, config)
    _read_architecture(facts, config)
    _read_norms(facts, config)
    facts.embed_width = whole(config.get("word_embed_proj_dim"), hidden) or hidden
    facts.dropout = _dropout(config, model_type)
    if model_type == "llama4_text" and config.get("intermediate_size_mlp"):
        facts.intermediate = whole(config["intermediate_size_mlp"], facts.intermediate)  # dense layers; experts keep intermediate_size
    offset = LEARNED_POSITIONS.get(model_type)
    if offset is not None:
        facts.positions = _int(config, "positions", 1024) + offset
    return facts


def _read_pattern(facts: Facts, config: dict, pattern: list) -> None:
    """Which layers attend, which run the hybrid's other mixer, which have an MLP (`mixers.layer_pattern`)."""
    mixers = [mixer for mixer, _ in pattern]
    facts.pattern_attention = sum("attention" in m for m in mixers)
    facts.pattern_mlp = sum(mlp != "none" for _, mlp in pattern)
    facts.mixer_layers = sum(m in ("linear", "conv", "mamba", "attention+mamba") for m in mixers)
    facts.mixer = read_mixer(config, facts.model_type, facts.hidden) if facts.mixer_layers else None
    if facts.mixer is None:
        facts.mixer_layers = 0
    if facts.model_type == "nemotron_h":
        facts.moe_layers = sum(mlp == "moe" for _, mlp in pattern)


def _read_architecture(facts: Facts, config: dict) -> None:
    """What a few architectures add to the common shape (attention kinds per layer, per-layer inputs, ...)."""
    model_type = facts.model_type
    facts.gated_attention = model_type in GATED_ATTENTION and config.get("attn_output_gate", True) is not False
    if model_type in SPARSE_INDEXER:
        facts.indexer = (whole(config.get("index_n_heads"), 64), whole(config.get("index_head_dim"), 128))
    if model_type in SUB_NORMS:
        facts.extra_parameters += facts.layers * (facts.hidden + facts.intermediate)
    if model_type == "gemma4_text":
        _read_gemma4(facts, config)
    elif model_type == "mimo_v2_flash":
        _read_mimo(facts, config)
    elif model_type == "lfm2" and config.get("block_auto_adjust_ff_dim"):
        width = int(2 * whole(config.get("block_ff_dim"), facts.intermediate) / 3)
        multiplier = config.get("block_ffn_dim_multiplier")
        width = int((multiplier if isinstance(multiplier, (int, float)) and multiplier > 0 else 1.0) * width)
        multiple = whole(config.get("block_multiple_of"), 256)
        facts.intermediate = multiple * -(-width // multiple)
    elif model_type == "granitemoehybrid":
        shared = whole(config.get("shared_intermediate_size"), 1024)
        if facts.experts:
            facts.moe_intermediate, facts.shared_intermediate = facts.intermediate, shared
        facts.intermediate = shared  # the shared MLP of every layer; experts keep intermediate_size


def _read_norms(facts: Facts, config: dict) -> None:
    """Query/key norms (`QK_NORM_TYPES`, or a config flag) on the layers that have them (Llama 4: those with rotary
    embeddings, all but each `no_rope_layer_interval`-th, 4 by default), and the logits' soft cap."""
    if facts.model_type in QK_NORM_TYPES or any(config.get(name) is True for name in QK_NORM_FIELDS):
        query, key_value, _, _ = facts.attention_totals()
        layers = facts.attention_layers
        if facts.model_type == "llama4_text":
            layers -= layers // max(whole(config.get("no_rope_layer_interval"), 4), 1)
        share = layers / facts.attention_layers if facts.attention_layers else 0
        facts.qk_norm = round(share * (query + key_value // 2))
    cap = config.get("final_logit_softcapping") or config.get("logits_soft_cap")  # RecurrentGemma's name
    facts.softcap = isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0


def _read_gemma4(facts: Facts, config: dict) -> None:
    """Gemma 4: full-attention layers with their own head_dim (global_head_dim) and key/value heads (keys as
    values with attention_k_eq_v), the last num_kv_shared_layers reusing earlier keys and values (with
    double-wide MLPs under use_double_wide_mlp), per-layer input embeddings, and experts beside the MLP."""
    types = config.get("layer_types")
    if not isinstance(types, list):
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(facts.layers)]
    shared_from = facts.layers - whole(config.get("num_kv_shared_layers"), 0)
    k_eq_v = bool(config.get("attention_k_eq_v"))
    kinds = {}
    for index, kind in enumerate(types[:facts.layers]):
        full = kind == "full_attention"
        head_dim = whole(config.get("global_head_dim"), 512) if full else facts.head_dim
        kv_heads = whole(config.get("num_global_key_value_heads"), facts.kv_heads) if full and k_eq_v else facts.kv_heads
        kv = 0 if index >= shared_from else kv_heads * head_dim * (1 if full and k_eq_v else 2)
        key = (facts.heads * head_dim, kv, facts.heads * head_dim, facts.heads)
        kinds[key] = kinds.get(key, 0) + 1
    facts.attention_kinds = tuple((n, *key) for key, n in kinds.items())
    if config.get("use_double_wide_mlp"):
        facts.extra_dense_width = (facts.layers - shared_from) * facts.intermediate
    facts.per_layer_input = whole(config.get("hidden_size_per_layer_input"), 0)
    facts.per_layer_vocab = whole(config.get("vocab_size_per_layer_input"), facts.vocab) if facts.per_layer_input else 0
    if config.get("enable_moe_block") and facts.experts:
        facts.moe_layers, facts.shared_intermediate = facts.layers, facts.intermediate
        facts.extra_parameters += facts.layers * (4 * facts.hidden + facts.experts)  # three more norms, router scales


def _read_mimo(facts: Facts, config: dict) -> None:
    """MiMo-V2: sliding-window layers (hybrid_layer_pattern 1) with their own heads, head dims and sinks."""
    pattern = config.get("hybrid_layer_pattern")
    pattern = pattern if isinstance(pattern, list) else [0] * facts.layers
    v_dim = whole(config.get("v_head_dim"), facts.head_dim)
    full = (facts.heads * facts.head_dim, facts.kv_heads * (facts.head_dim + v_dim), facts.heads * v_dim, facts.heads)
    heads = whole(config.get("swa_num_attention_heads"), facts.heads)
    kv_heads = whole(config.get("swa_num_key_value_heads"), facts.kv_heads)
    head_dim, swa_v = whole(config.get("swa_head_dim"), facts.head_dim), whole(config.get("swa_v_head_dim"), v_dim)
    sliding = (heads * head_dim, kv_heads * (head_dim + swa_v), heads * swa_v, heads)
    windowed = sum(1 for p in pattern[:facts.layers] if p is True or whole(p))
    facts.attention_kinds = ((facts.layers - windowed, *full), (windowed, *sliding))
    facts.window_layers = windowed
    if config.get("add_swa_attention_sink_bias"):
        facts.extra_parameters += heads * windowed


def _dropout(config: dict, model_type: str) -> tuple:
    defaults = DROPOUT_DEFAULTS.get(model_type, (0.0, 0.0))
    values = []
    for names, default in zip(DROPOUT_FIELDS, defaults):
        value = next((config[n] for n in names if isinstance(config.get(n), (int, float))), default)
        values.append(float(value))
    return tuple(values)


def _read_recurrent(facts: Facts, config: dict) -> None:
    if facts.model_type == "recurrent_gemma":
        pattern = config.get("block_types")
        pattern = pattern if isinstance(pattern, list) and pattern else ["recurrent", "recurrent", "attention"]
        kinds = [pattern[i % len(pattern)] for i in range(facts.layers)]
        facts.recurrent_layers = sum(kind == "recurrent" for kind in kinds)
        facts.recurrent_width = positive(config.get("lru_width"), facts.hidden)
    else:
        facts.recurrent_layers = facts.layers
        facts.recurrent_width = positive(config.get("expand"), 2) * facts.hidden
        facts.state_size = positive(config.get("state_size"), 16)
        facts.time_step_rank = positive(config.get("time_step_rank"), -(-facts.hidden // 16))
        facts.conv_kernel = positive(config.get("conv_kernel"), 4)


def _read_attention(facts: Facts, config: dict) -> None:
    heads = _int(config, "heads", 0, facts.unread)
    kv = _int(config, "kv_heads", None)
    if kv is None:
        kv = 1 if config.get("multi_query") and not config.get("new_decoder_architecture") else heads
    head_dim = _int(config, "head_dim", None) or (facts.hidden // heads if heads else 0)
    facts.heads, facts.kv_heads, facts.head_dim = heads, kv, head_dim
    facts.q_dim, facts.kv_dim = heads * head_dim, 2 * kv * head_dim
    if config.get("kv_lora_rank"):  # multi-head latent attention: per-head nope + rope query and key, own v width
        qk = whole(config.get("qk_nope_head_dim")) + whole(config.get("qk_rope_head_dim"))
        facts.q_dim = heads * qk
        facts.kv_dim = heads * (qk + (whole(config.get("v_head_dim")) or head_dim))
        facts.mla = (whole(config.get("q_lora_rank")), whole(config["kv_lora_rank"]),
                     whole(config.get("qk_rope_head_dim")), whole(config.get("v_head_dim")) or head_dim)


def _read_mlp(facts: Facts, config: dict) -> None:
    act = str(next((config[n] for n in ACTIVATION_FIELDS if config.get(n)), ""))
    facts.gated = facts.model_type not in NOT_GATED
    facts.activation = act or DEFAULT_ACTIVATION.get(facts.model_type, "")
    facts.composite = facts.activation in COMPOSITE_ACTIVATIONS
    facts.squared, facts.xielu = facts.activation in SQUARED_ACTIVATIONS, facts.activation in XIELU_ACTIVATIONS
    if facts.model_type not in NOT_GATED | KNOWN_GATED and act:
        facts.gated = any(g in act for g in GATED_ACTIVATIONS)  # an unknown architecture: by its activation
    width = _int(config, "intermediate", None)
    if width is None and config.get("expansion_ratio"):
        width = int(whole(config["expansion_ratio"], 4) * facts.hidden) or None
    if width is None and facts.recurrent_layers < facts.layers:
        width = 4 * facts.hidden  # GPT-2, Falcon, BLOOM: 4 x hidden when the file says nothing
        if facts.model_type not in {"gpt2", "falcon", "bloom", "gpt_neo", "codegen", "gptj", "gpt_bigcode"}:
            facts.unread.append("intermediate (intermediate_size; taken as 4 x hidden_size)")
    if facts.model_type == "recurrent_gemma" and width:
        width //= 2  # its gated MLP's matrices are intermediate_size / 2 wide
    facts.intermediate = width or 0


SHARED_EXPERT_FIELDS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
# Model types whose number of shared experts defaults to one when the config does not say.
ONE_SHARED_EXPERT = {"kimi_linear", "nemotron_h"}


def _read_moe(facts: Facts, config: dict, pattern=None) -> None:
    experts = _int(config, "experts", 0)
    top_k = _int(config, "top_k", 0)
    if experts < 2 or not top_k or (facts.model_type == "nemotron_h" and not facts.moe_layers):
        facts.moe_layers = 0
        return
    facts.experts, facts.top_k = experts, top_k
    facts.moe_intermediate = _int(config, "moe_intermediate", facts.intermediate)
    shared = whole(config.get("shared_expert_intermediate_size"))
    count = next((whole(config[n]) for n in SHARED_EXPERT_FIELDS if isinstance(config.get(n), int)),
                 1 if facts.model_type in ONE_SHARED_EXPERT else 0)
    if count:
        shared = int(count) * facts.moe_intermediate
    if facts.model_type == "llama4_text":
        shared = facts.intermediate  # one shared expert as wide as a routed one
    if facts.model_type == "nemotron_h":  # up and down experts, a shared expert of its own width
        facts.expert_gated = False
        shared = whole(config.get("moe_shared_expert_intermediate_size"), 7688) * (count or 1)
    facts.shared_intermediate = int(shared)
    if facts.model_type != "nemotron_h":  # Nemotron-H: its pattern's 'E' layers
        facts.moe_layers = _moe_layer_count(facts.layers, config)


def _moe_layer_count(layers: int, config: dict) -> int:
    """Layers with experts: after first_k_dense_replace, every step-th (decoder_sparse_step, moe_layer_freq ...)
    but mlp_only_layers; moe_layer_freq given as a list marks each layer (MiMo); ERNIE 4.5 says where they start,
    end and how often (moe_layer_start_index, moe_layer_end_index, moe_layer_interval)."""
    frequency = config.get("moe_layer_freq")
    if isinstance(frequency, list):
        return sum(1 for flag in frequency[:layers] if flag is True or whole(flag))
    if "moe_layer_start_index" in config or "moe_layer_interval" in config:
        start = max(whole(config.get("moe_layer_start_index")), 0)
        end = whole(config.get("moe_layer_end_index"), -1)
        end = layers - 1 if end < 0 else end
        interval = max(whole(config.get("moe_layer_interval"), 1), 1)
        return sum(1 for i in range(start, min(end, layers - 1) + 1) if (i - start) % interval == 0)
    first_dense = max(whole(config.get("first_k_dense_replace")), 0)
    step = max(whole(config.get("decoder_sparse_step") or config.get("interleave_moe_layer_step") or frequency, 1), 1)
    only = config.get("mlp_only_layers")
    only_dense = {whole(i, -1) for i in only} if isinstance(only, list) else set()
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
        pattern = max(whole(config["sliding_window_pattern"], 1), 1)
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
    embedding += _per_layer_input_parameters(facts)
    head = 0 if facts.tied else facts.vocab * width
    head += facts.vocab if head_bias else 0
    layers = facts.attention_layers
    q, kv, out, _ = facts.attention_totals()
    attention = h * (q + kv) + out * h + qkv_bias * (q + kv) + out_bias * h * layers
    attention += q * h if facts.gated_attention else 0  # the output gate's half of the query projection
    if facts.mla:
        attention = layers * _mla_parameters(facts)
    if facts.indexer:
        attention += layers * _indexer_parameters(facts)
    matrices = 3 if facts.gated else 2

    def mlp(width: int) -> int:
        return matrices * h * width + mlp_bias * (width + h)

    expert = mlp(facts.moe_intermediate) if facts.experts else 0
    moe = h * facts.experts + mlp(facts.shared_intermediate) if facts.shared_intermediate else h * facts.experts
    recurrent = _recurrent_parameters(facts) if facts.recurrent_layers else 0
    final_norm = 0 if (facts.model_type == "opt" and width != h) or facts.model_type in NORM_FREE else norm
    total = embedding + head + final_norm + attention + facts.extra_parameters
    if facts.pattern_attention is None:
        total += layers * norms * norm
        total += facts.recurrent_layers * (recurrent + norm)
    else:  # hybrids: every layer has its norms, whatever mixes its tokens
        total += facts.layers * norms * norm
    if facts.mixer:
        total += facts.mixer_layers * facts.mixer.parameters
    total += facts.dense_layers * mlp(facts.intermediate) + matrices * h * facts.extra_dense_width
    total += facts.moe_layers * (moe + facts.experts * expert)
    active = total - facts.moe_layers * (facts.experts - facts.top_k) * expert
    return int(total), int(active)


def weight_shape(facts: Facts, parameters: float) -> WeightShape:
    """The model's weights as FSDP2 and tensor parallelism split them (`components.WeightShape`)."""
    width = facts.embed_width or facts.hidden
    embedding = facts.vocab * width
    head = 0 if facts.tied else facts.vocab * width
    experts = 0
    if facts.experts:
        matrices = 3 if facts.gated else 2
        experts = facts.moe_layers * facts.experts * matrices * facts.hidden * facts.moe_intermediate
    return WeightShape(parameters, embedding, embedding + head, min(experts, parameters), facts.experts,
                       facts.layers)


def _per_layer_input_parameters(facts: Facts) -> int:
    """Gemma 4's per-layer inputs: their embedding and projection from the hidden state (with a norm), and
    per layer a gate, a projection back and a norm."""
    width, h = facts.per_layer_input, facts.hidden
    if not width:
        return 0
    return facts.per_layer_vocab * facts.layers * width + facts.layers * width * h + width + facts.layers * (2 * width * h + h)


def _indexer_parameters(facts: Facts) -> int:
    """DeepSeek sparse attention's indexer: queries from the low-rank query, one key, its LayerNorm, head weights."""
    heads, dim = facts.indexer
    q_rank = facts.mla[0] if facts.mla else facts.hidden
    return q_rank * heads * dim + facts.hidden * dim + 2 * dim + facts.hidden * heads


def _mla_parameters(facts: Facts) -> int:
    """Multi-head latent attention: low-rank query (or a full one), compressed keys and values, output."""
    q_rank, kv_rank, rope, v_dim = facts.mla
    h, heads, q_dim = facts.hidden, facts.heads, facts.q_dim
    query = h * q_rank + q_rank + q_rank * q_dim if q_rank else h * q_dim
    keys_values = h * (kv_rank + rope) + kv_rank + kv_rank * heads * ((q_dim // heads if heads else 0) - rope + v_dim)
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
    """The kernel CUDA runs the attention with (`KERNELS`), in config terms (pipeline.simulate.kernels.sdpa's rule)."""
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
    embedding = facts.vocab * width + facts.positions * facts.hidden + facts.per_layer_vocab * facts.layers * facts.per_layer_input
    norm = facts.hidden * (2 if LAYOUT.get(facts.model_type, DEFAULT_LAYOUT)[3] else 1)
    norms = norm * (1 + facts.layers * LAYOUT.get(facts.model_type, DEFAULT_LAYOUT)[4])
    return int(total - embedding - norms + (facts.vocab * width if facts.tied else 0))


def feature_values(facts: Facts, seq_len: int = 1, kernel: str = "eager") -> dict:
    """The formula's features per token (elements), `FEATURES` order; `seq_len` enters `scores` and `mask`,
    which count only where the attention `kernel` materialises them (default: as the hook count sees it)."""
    attention = facts.attention_layers
    q, kv, out, heads = facts.attention_totals()
    dense = facts.dense_width
    scores = heads * seq_len  # eager and SDPA's math compute the full L x L, window or not
    materialised = kernel in ("eager", "math")
    mixer, mixers = facts.mixer, facts.mixer_layers
    padded = mixers * -(-seq_len // mixer.chunk) * mixer.chunk / seq_len if mixer and mixer.chunk else 0
    index_heads, index_dim = facts.indexer or (0, 0)
    return {
        "embedding": facts.hidden,
        "hidden": facts.layers * facts.hidden,
        "attention": q * (2 if facts.gated_attention else 1) + kv,
        "attention_output": out,
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
        "mask": attention * seq_len if (facts.window or facts.indexer) and kernel == "fused" else 0,
        "mixer_in": mixers * mixer.projection if mixer else 0,
        "mixer_conv": mixers * mixer.conv if mixer else 0,
        "mixer_out": mixers * mixer.inner if mixer else 0,
        "mixer_keys": padded * mixer.keys if padded else 0,
        "mixer_state": padded * mixer.state / mixer.chunk if padded else 0,
        "mixer_chunk": padded * mixer.chunk_heads if padded else 0,
        "extra_norms": facts.layers * facts.hidden * max(LAYOUT.get(facts.model_type, DEFAULT_LAYOUT)[4] - 2, 0),
        "mlp_squared": dense if facts.squared else 0,
        "mlp_xielu": dense if facts.xielu else 0,
        "sub_norms": facts.layers * (facts.hidden + facts.intermediate) if facts.model_type in SUB_NORMS else 0,
        "per_layer_input": facts.layers * facts.per_layer_input,
        "indexer": attention * (index_heads * index_dim + 2 * index_dim + index_heads),
        "qk_norm": facts.qk_norm,
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

