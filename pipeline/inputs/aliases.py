"""The names under which config.json files spell each shape fact: one table for every reader (the
build's facts in `inputs.modeling`, the measurement's records, the formula's features). First match
wins; nested dicts (dbrx's attn_config / ffn_config) are searched too by each reader."""

from __future__ import annotations

FIELDS = {
    "hidden": ("hidden_size", "n_embd", "d_model", "dim"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "heads": ("num_attention_heads", "n_head", "n_heads", "attention_heads", "num_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "kv_n_heads", "n_head_kv", "num_query_groups",
                 "multi_query_group_num"),
    "head_dim": ("head_dim", "kv_channels"),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "d_ff"),
    "vocab": ("vocab_size", "padded_vocab_size"),
    "experts": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts",
                "n_experts"),
    # `top_k` last: older configs also carry a generation `top_k`
    "top_k": ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "num_selected_experts", "moe_k",
              "experts_per_token", "top_k_experts", "top_k"),
    "moe_intermediate": ("moe_intermediate_size", "expert_intermediate_size"),
    # rows of a learned position embedding
    "positions": ("n_positions", "max_position_embeddings", "max_seq_len"),
    # the longest position the model takes
    "context": ("max_position_embeddings", "n_positions", "max_sequence_length", "max_seq_len", "seq_length", "n_ctx"),
}
# Model types whose `num_heads` are state-space heads, not attention heads.
STATE_SPACE_HEADS = {"mamba2"}
# Hybrids whose experts exist only in the layers their pattern names: (the transformers config's list of
# layer kinds, the kind of an expert layer); a dense member keeps its config class's default expert count.
EXPERT_LAYER_PATTERNS = {"nemotron_h": ("layers_block_type", "moe")}


def names_of(fact: str, model_type: str | None) -> tuple:
    """The aliases of `fact` in a config of `model_type`."""
    if fact == "heads" and model_type in STATE_SPACE_HEADS:
        return tuple(name for name in FIELDS["heads"] if name != "num_heads")
    return FIELDS[fact]
