"""The hook count's own features: what the modules output, per op, in config facts (no torch).

The hook method sums the outputs of every module (`pipeline.activations.counts.hook_elements`), so
its terms are the modules' output widths, not what autograd saves. These differ from the
saved-bytes features (`pipeline.formulas.features.feature_values`), both read off per-module counts of the
meta forward (`python -m pipeline count`; hooks grouped by module class):

- experts: the Hugging Face implementations hold the experts in one module whose matrix products
  are not modules; what the hooks see per expert that runs on a token is the activation module's
  output (moe_intermediate_size wide; gpt-oss applies its activation as a function: none) and,
  where each expert is a module (DBRX, the parallel experts of JetMoE), its output
  (hidden_size) and its input projection (2 x moe_intermediate_size, gated). Llama 4 runs every
  expert on every token and its experts module returns each expert's output.
- token mixers beside attention (`pipeline.formulas.mixers`): their causal convolution is padded by
  kernel - 1, so at one token the convolution module outputs `kernel` positions; their states, keys
  per head and within-chunk products are not module outputs (no term).
- MLP activations: relu-squared and xIELU are one module each, whose output is as wide as any other
  activation's (no term of their own: the saved bytes have one).

Everything else is `feature_values` at L = 1 (one token: no term in L).
"""

from __future__ import annotations

from pipeline.formulas.features import EVERY_EXPERT, FEATURES, feature_values

# Per expert that runs on a token, outputs the hooks see: (moe_intermediate_size wide, hidden_size wide).
# Default: the fused experts module of transformers (its activation module only).
EXPERT_OUTPUTS = {
    "gpt_oss": (0, 0),  # activation written as a function inside the experts module
    "dbrx": (1, 1),  # each expert a module (DbrxExpertGLU) returning its hidden-wide output
    "jetmoe": (3, 1),  # parallel experts: input linear (2 x width, gated), activation, output linear
    "llama4_text": (1, 1),  # every expert runs; the experts module returns each one's output
}
DEFAULT_EXPERT_OUTPUTS = (1, 0)
# The saved-bytes terms that are no module's output: L x L scores and masks, experts as the saved bytes see
# them, the chunked scans' states, keys and within-chunk products, the activations' inner elementwise ops.
NOT_MODULE_OUTPUTS = ("experts", "scores", "mask", "mixer_keys", "mixer_state", "mixer_chunk", "mlp_squared",
                      "mlp_xielu", "mixer_conv")  # the convolution's outputs: `mixer_conv_outputs` below

HOOK_FEATURES = {
    **{k: v for k, v in FEATURES.items() if k not in NOT_MODULE_OUTPUTS},
    "expert_activations": "MoE layers x experts run per token (num_experts_per_tok; num_experts for Llama 4) x "
                          "moe_intermediate_size x the intermediate-wide module outputs per expert "
                          "(`EXPERT_OUTPUTS`: 1 for the fused experts' activation module, 0 for gpt-oss, 3 for "
                          "parallel experts with their input linear)",
    "expert_outputs": "MoE layers x experts run per token x hidden_size where each expert's output is a module "
                      "output (DBRX, JetMoE, Llama 4)",
    "qk_norm": "the saved bytes' qk_norm term read as module outputs: one output as wide as the queries and one as "
               "wide as the keys per layer whose queries and keys are normalised",
    "mixer_conv_outputs": "mixer layers x the channels of its causal depthwise convolution x its kernel (the "
                          "convolution's output at one token: kernel positions)",
}
HOOK_TERMS = list(HOOK_FEATURES)
HOOK_ONLY_TERMS = [t for t in HOOK_TERMS if t not in FEATURES]  # the hook count's own terms


def hook_feature_values(facts) -> dict:
    """The hook count's features of one token (`HOOK_FEATURES` order), from a config's facts."""
    values = feature_values(facts, 1, "eager")
    run = facts.experts if facts.model_type in EVERY_EXPERT else facts.top_k
    wide, hidden = EXPERT_OUTPUTS.get(facts.model_type, DEFAULT_EXPERT_OUTPUTS)
    per_layer = facts.moe_layers * run
    values["expert_activations"] = per_layer * facts.moe_intermediate * wide
    values["expert_outputs"] = per_layer * facts.hidden * hidden
    values["mixer_conv_outputs"] = values["mixer_conv"] * facts.mixer.kernel if facts.mixer else 0
    return {t: values[t] for t in HOOK_TERMS}
