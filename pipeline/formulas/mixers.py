"""Layer patterns and the token mixers beside attention, in config.json facts (no torch).

Hybrid decoders say per layer what mixes the tokens: full or sliding-window attention, a linear
attention (gated delta-net: Qwen3.5, Qwen3-Next; Kimi delta attention: Kimi-Linear), a gated short
convolution (LFM2) or a Mamba-2 mixer (Nemotron-H, Granite 4, and Falcon-H1, where it runs beside
the attention of every layer); and whether the layer has a dense MLP, experts, or neither
(Nemotron-H's layers are one block each). `layer_pattern` reads that from the config's own
words (`layer_types`, `hybrid_override_pattern`, `full_attn_idxs`, `linear_attn_config`,
`full_attention_interval`); `read_mixer` reads the mixer's widths, with the model type's defaults
(`MIXER_DEFAULTS`) where the file leaves a field out, and its parameters per layer.

The widths a mixer's forward keeps per token (`Mixer`), as the reference PyTorch paths compute
them (their chunked scans: the gated delta rule in chunks of 64 tokens, Mamba-2's SSD in chunks of
`chunk_size`; none loops per token):

- `projection`: its input projections (q, k, v, gates; Mamba-2's in_proj; LFM2's B, C, x);
- `conv`: the channels of its causal depthwise convolution (padded by kernel - 1, so at L tokens
  it outputs L + kernel - 1 positions);
- `inner`: its output before the output projection (and the gated norm's, the core's);
- `keys`: heads x key (state) width in fp32 (keys repeated per value head, Mamba-2's B and C per head);
- `state`: the recurrent state, heads x key x value elements, kept once per chunk;
- `chunk_heads`: heads x chunk length: the within-chunk products (decays, attention-like weights); x the
  key width where the decay is per channel (Kimi delta attention).

Beside what it keeps, Mamba-2's reference SSD (transformers' `mamba2_chunk_scan` fallback, the same in
Nemotron-H, Granite 4 and Falcon-H1; it runs whenever `mamba_ssm` is absent) builds each of its einsums as a
broadcast product in fp32 and then sums it, one layer at a time (`ssd_transient_bytes`): C x B per chunk
(chunk x heads x state per token), M x x (chunk x heads x head dim), B x x and C x states (heads x head dim x
state), and the states' decay across chunks (chunks + 1)^2 x heads x head dim x state per sequence. The forward
holds one such product; the backward of a product holds both operands' gradients at its full size at once
(the engine reduces them to the operands' shapes after the node returns), so twice the largest.
"""

from __future__ import annotations

from dataclasses import dataclass

GATED_DELTA_NET = {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}
KIMI_DELTA = {"kimi_linear"}
SHORT_CONV = {"lfm2", "lfm2_moe"}
MAMBA2_HYBRIDS = {"nemotron_h", "granitemoehybrid", "falcon_h1"}
# The model type's defaults (transformers 5.17's config classes) of the fields read here.
MIXER_DEFAULTS = {
    "qwen3_5_text": {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                     "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4},
    "qwen3_next": {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                   "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4},
    "kimi_linear": {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
    "lfm2": {"conv_L_cache": 3, "conv_bias": False},
    "nemotron_h": {"mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128,
                   "conv_kernel": 4, "chunk_size": 128, "use_conv_bias": True, "mamba_proj_bias": False},
    "granitemoehybrid": {"mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4,
                         "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False},
    "falcon_h1": {"mamba_d_ssm": 1024, "mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256,
                  "mamba_d_conv": 4, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
                  "mamba_rms_norm": False},
}
MIXER_DEFAULTS["qwen3_5_moe_text"] = MIXER_DEFAULTS["qwen3_5_text"]
MIXER_DEFAULTS["lfm2_moe"] = MIXER_DEFAULTS["lfm2"]
DELTA_CHUNK = 64  # tokens per chunk of the gated delta rule's PyTorch path (gated delta-net and Kimi's)
# Nemotron-H's layer pattern: one character per layer.
NEMOTRON_PATTERN = {"M": ("mamba", "none"), "*": ("attention", "none"), "-": ("none", "dense"), "E": ("none", "moe")}


@dataclass(frozen=True)
class Mixer:
    """A token mixer other than attention: its widths per token (see the module docstring) and its
    parameters, per layer that runs it."""

    kind: str  # "linear" | "conv" | "mamba2"
    projection: int
    conv: int
    kernel: int
    inner: int
    keys: int
    state: int
    chunk_heads: int
    chunk: int  # tokens per chunk of its scan (0: no scan)
    parameters: int
    heads: int = 0  # Mamba-2: its heads (B and C repeated to them from their groups)
    state_width: int = 0  # Mamba-2: the state (B, C) width per head


def whole(value, default: int = 0) -> int:
    """`value` as a whole number where it is one (an int, or a finite float), else `default`: the formula answers
    for any config that passed `inputs.checks`, whose fields it reads beyond those checks."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        return default
    return int(value)


def positive(value, default: int) -> int:
    """`value` as a whole number above zero where it is one, else `default`."""
    number = whole(value, default)
    return number if number > 0 else default


def _get(config: dict, model_type: str, name: str):
    """A field of the config, else the model type's default (booleans as given; numbers as whole numbers)."""
    default = MIXER_DEFAULTS.get(model_type, {}).get(name)
    value = config.get(name)
    if isinstance(default, bool) or isinstance(value, bool):
        return bool(value) if value is not None else bool(default)
    return whole(value, whole(default, 0)) if value is not None else whole(default, 0)


def layer_pattern(config: dict, model_type: str, layers: int) -> list[tuple[str, str]] | None:
    """Per layer (its token mixer, its MLP): mixer in attention | sliding_attention | linear | conv |
    mamba | attention+mamba | none, MLP in dense | moe | none (moe decided later by the MoE facts);
    None for a model whose layers are all alike (plain attention)."""
    if model_type == "nemotron_h":
        pattern = config.get("hybrid_override_pattern")
        if isinstance(pattern, str) and pattern:
            return [NEMOTRON_PATTERN.get(c, ("none", "none")) for c in pattern[:layers]]
        kinds = config.get("layers_block_type") or []
        words = {"mamba": ("mamba", "none"), "attention": ("attention", "none"), "mlp": ("none", "dense"),
                 "moe": ("none", "moe")}
        return [words.get(str(k), ("none", "none")) for k in kinds[:layers]] or None
    if model_type == "falcon_h1":
        return [("attention+mamba", "dense")] * layers
    if model_type in KIMI_DELTA and isinstance(config.get("linear_attn_config"), dict):
        full = set(whole(i, -1) for i in config["linear_attn_config"].get("full_attn_layers") or [])  # 1-indexed
        return [("attention" if i + 1 in full else "linear", "dense") for i in range(layers)]
    types = config.get("layer_types")
    if isinstance(types, list) and types:
        words = {"full_attention": "attention", "attention": "attention", "sliding_attention": "sliding_attention",
                 "linear_attention": "linear", "conv": "conv", "mamba": "mamba"}
        return [(words.get(str(t), "attention"), "dense") for t in types[:layers]]
    if model_type in SHORT_CONV and isinstance(config.get("full_attn_idxs"), list):
        full = set(whole(i, -1) for i in config["full_attn_idxs"])
        return [("attention" if i in full else "conv", "dense") for i in range(layers)]
    if model_type in GATED_DELTA_NET | KIMI_DELTA:
        interval = _get(config, model_type, "full_attention_interval") or 4
        return [("attention" if (i + 1) % interval == 0 else "linear", "dense") for i in range(layers)]
    return None


def read_mixer(config: dict, model_type: str, hidden: int) -> Mixer | None:
    """The mixer of a hybrid's non-attention layers (None for a model without one)."""
    if model_type in GATED_DELTA_NET:
        return _gated_delta_net(config, model_type, hidden)
    if model_type in KIMI_DELTA:
        return _kimi_delta(config, model_type, hidden)
    if model_type in SHORT_CONV:
        return _short_conv(config, model_type, hidden)
    if model_type in MAMBA2_HYBRIDS:
        return _mamba2(config, model_type, hidden)
    return None


def _gated_delta_net(config: dict, model_type: str, h: int) -> Mixer:
    key_heads, value_heads = (_get(config, model_type, n) for n in ("linear_num_key_heads", "linear_num_value_heads"))
    key_dim, value_dim = (_get(config, model_type, n) for n in ("linear_key_head_dim", "linear_value_head_dim"))
    kernel = _get(config, model_type, "linear_conv_kernel_dim")
    keys, values = key_heads * key_dim, value_heads * value_dim
    conv = 2 * keys + values
    projection = conv + values + 2 * value_heads  # q, k, v; the output gate z; beta and the decay
    # in projections, depthwise conv (no bias), dt_bias and A_log per head, the gated norm, the output projection
    parameters = h * projection + conv * kernel + 2 * value_heads + value_dim + values * h
    return Mixer("linear", projection, conv, kernel, values, 2 * value_heads * key_dim,
                 value_heads * key_dim * value_dim, value_heads * DELTA_CHUNK, DELTA_CHUNK, parameters)


def _kimi_delta(config: dict, model_type: str, h: int) -> Mixer:
    linear = config.get("linear_attn_config") if isinstance(config.get("linear_attn_config"), dict) else {}
    defaults = MIXER_DEFAULTS[model_type]
    heads = whole(linear.get("num_heads") or config.get("linear_num_heads"), defaults["num_heads"])
    dim = whole(linear.get("head_dim") or config.get("linear_head_dim"), defaults["head_dim"])
    kernel = whole(linear.get("short_conv_kernel_size") or config.get("linear_conv_kernel_dim"),
                   defaults["short_conv_kernel_size"])
    width = heads * dim
    # q, k, v; the per-channel forget gate (low rank: dim, then width); beta per head; the output gate (low rank)
    projection = 3 * width + 2 * (dim + width) + heads
    parameters = (3 * h * width + 3 * width * kernel + width + heads + 2 * (h * dim + dim * width) + h * heads
                  + dim + width * h)
    # its decay is per channel: the within-chunk products are heads x chunk x key width
    return Mixer("linear", projection, 3 * width, kernel, width, 2 * width, heads * dim * dim,
                 heads * DELTA_CHUNK * dim, DELTA_CHUNK, parameters)


def _short_conv(config: dict, model_type: str, h: int) -> Mixer:
    kernel = _get(config, model_type, "conv_L_cache")
    bias = 1 if _get(config, model_type, "conv_bias") else 0
    parameters = h * 3 * h + bias * 3 * h + h * kernel + bias * h + h * h + bias * h
    return Mixer("conv", 3 * h, h, kernel, h, 0, 0, 0, 0, parameters)


def _mamba2(config: dict, model_type: str, h: int) -> Mixer:
    if model_type == "nemotron_h":
        heads, head_dim = _get(config, model_type, "mamba_num_heads"), _get(config, model_type, "mamba_head_dim")
        groups, state = _get(config, model_type, "n_groups"), _get(config, model_type, "ssm_state_size")
        kernel, chunk = _get(config, model_type, "conv_kernel"), _get(config, model_type, "chunk_size")
        conv_bias, proj_bias, norm = _get(config, model_type, "use_conv_bias"), _get(config, model_type, "mamba_proj_bias"), True
        inner = heads * head_dim
    else:
        heads, groups = _get(config, model_type, "mamba_n_heads"), _get(config, model_type, "mamba_n_groups")
        state, kernel = _get(config, model_type, "mamba_d_state"), _get(config, model_type, "mamba_d_conv")
        chunk = _get(config, model_type, "mamba_chunk_size")
        conv_bias, proj_bias = _get(config, model_type, "mamba_conv_bias"), _get(config, model_type, "mamba_proj_bias")
        expanded = (_get(config, model_type, "mamba_expand") or 2) * h
        inner = (_get(config, model_type, "mamba_d_ssm") or expanded) if model_type == "falcon_h1" else expanded
        norm = bool(_get(config, model_type, "mamba_rms_norm")) if model_type == "falcon_h1" else True
    conv = inner + 2 * groups * state
    projection = inner + conv + heads  # the gate z, x with B and C, dt per head
    parameters = (h * projection + (projection if proj_bias else 0) + conv * kernel + (conv if conv_bias else 0)
                  + 3 * heads + (inner if norm else 0) + inner * h + (h if proj_bias else 0))
    return Mixer("mamba2", projection, conv, kernel, inner, 2 * heads * state, inner * state, heads * chunk, chunk,
                 parameters, heads, state)


SSD_BYTES = 4  # the reference SSD's products are fp32 whatever the weights' dtype (it upcasts x, B and C)


def ssd_transient_bytes(mixer: Mixer | None, batch: int, seq: int, backward: bool = True) -> float:
    """Bytes of the largest transient of one Mamba-2 layer's reference SSD (module docstring), beside what the
    layer keeps: 4 x max(B x padded L x chunk x heads x state, B x padded L x chunk x inner, B x padded L x inner
    x state, B x (chunks + 1)^2 x inner x state), twice that in the backward (both operands' gradients of the
    product at its size); padded L = chunks x chunk, chunks = ceil(L / chunk). 0 for any other mixer."""
    if mixer is None or mixer.kind != "mamba2" or not mixer.chunk or not mixer.heads:
        return 0.0
    chunk, inner, state = mixer.chunk, mixer.inner, mixer.state_width
    chunks = -(-seq // chunk)
    padded = batch * chunks * chunk
    largest = max(padded * chunk * mixer.heads * state, padded * chunk * inner, padded * inner * state,
                  batch * (chunks + 1) ** 2 * inner * state)
    return float((2 if backward else 1) * SSD_BYTES * largest)
