"""The formulas of training memory, in plain Python: the blog's as published and the heuristic's.

Both sum the same components (bytes):

    parameters, gradients, optimizer_state, optimizer_intermediates, activations

- the blog: every term N*P with P the bytes of the precision, AdamW state 2*N*P, activations
  A*B*L*P with A = 4.6894e-4*N + 1.8494e6 (fp32 BYTES per token, so P counts twice: see
  `BLOG_NOTES`); peak = parameters + optimizer_state + max(gradients + intermediates, activations).
- the heuristic: A in activation ELEMENTS per token (a refit, coefficients.json), times bytes per
  element of the precision, precision-aware weights (amp-bf16: fp32 weights, gradients and state,
  bf16 activations plus the bf16 weight copies autocast keeps); peak = parameters +
  optimizer_state + gradients + max(intermediates, activations) (`heuristic_peak` says why).

No torch, no numpy: a formula is usable without the measuring code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Bytes per parameter (weights, gradients, optimizer state) and per activation element of a precision.
from pipeline.core.vocabulary import ACTIVATION_BYTES, PRECISION_MODES, WEIGHT_BYTES

# The blog's published fit: A in fp32 BYTES per token (4 bytes x hook elements).
BLOG_SLOPE = 4.6894e-4
BLOG_INTERCEPT = 1.8494e6
BLOG_A_BYTES_PER_ELEMENT = 4
# The blog has one P per run; for the amp modes we take the fp32 bytes of their weights, grads and state:
# the weights' bytes of every precision.
BLOG_P = dict(WEIGHT_BYTES)
# The blog's calculator divides activations by this under gradient checkpointing (project brief;
# the calculator's code is not part of the published text).
BLOG_CHECKPOINTING_DIVISOR = 5
BLOG_NOTES = [
    "A = 4.6894e-4*N + 1.8494e6 is fp32 BYTES per token (its hook sums numel*element_size), yet "
    "Activation Memory = A*B*L*P multiplies by P again: 4x too much in fp32, 2x in bf16.",
    "The post states two totals: max(gradients + optimizer intermediates, activations) and "
    "max(gradients, optimizer intermediates, activations); this uses the first.",
    "The hook count sums outputs of every module (containers included) for one token; it is not what "
    "autograd saves for backward and has no term growing with L (attention scores, fp32 logits for the loss).",
    "P is one precision for everything: mixed precision (fp32 weights and state, bf16 activations) is not "
    "covered; here amp-bf16 takes P = 4.",
    "Gradient checkpointing: activations divided by a constant 5, not measured.",
    "The fit misses the post's own example: for Qwen2.5-1.5B it gives A = 2,573,309 bytes per token, "
    "the hook count is 5,065,216.",
    "Measured peaks (H200, standard step) are in the backward or the optimizer step, never in the forward; "
    "in the backward the gradients and the activations are alive together, which the max() leaves out.",
]

# The optimizers' memory, by the key `optimizer_key` gives: (state buffers in the weights' dtype,
# weight-sized temporaries of the step, state bytes per parameter in a dtype of its own).
OPTIMIZER_TERMS = {
    "adamw": (2, 1, 0),  # torch's AdamW (foreach): two moments; the step needs about one more copy of the weights
    "sgd": (1, 0, 0),  # SGD with momentum: one buffer; its step peaks at weights + momentum + gradients + ~6%
    "adamw_torch_fused": (2, 0, 0),  # one fused kernel per parameter group: no weight-sized temporaries
    "adafactor": (0, 0, 0),  # transformers' Adafactor (beta1=None): row and column second moments, ~0 of N
    "sgd_no_momentum": (0, 0, 0),  # transformers' "sgd": momentum 0, no state
    "adamw_bnb_8bit": (0, 0, 2),  # bitsandbytes: two 8-bit moments (+ a 4-byte absmax per 256 values)
}
# The trainer client's `optim` names whose memory is one of the loop's optimizers, or has a key of its own.
OPTIM_KEYS = {"adamw_torch": "adamw", "sgd": "sgd_no_momentum"}
STATE_BUFFERS = {name: OPTIMIZER_TERMS[name][0] for name in ("adamw", "sgd")}  # the loop's (coefficients.json)
INTERMEDIATE_BUFFERS = {name: OPTIMIZER_TERMS[name][1] for name in ("adamw", "sgd")}


def optimizer_key(client: str = "loop", optimizer: str | None = "adamw", optim: str | None = None) -> str:
    """The OPTIMIZER_TERMS key of a run: the loop's optimizer, or the trainer's optim."""
    if client == "loop":
        return optimizer or "adamw"
    return OPTIM_KEYS.get(optim, optim)


def optimizer_bytes(key: str, parameters, weight_bytes) -> tuple[float, float]:
    """(optimizer state, optimizer-step temporaries) in bytes for N parameters."""
    buffers, temporaries, own_bytes = OPTIMIZER_TERMS[key]
    return parameters * (buffers * weight_bytes + own_bytes), parameters * temporaries * weight_bytes


# Under autocast every fp32 weight is cast to a bf16 copy that autograd keeps until backward: it
# lives beside the activations (the saved-for-backward counts of amp-bf16 show it as ~2N bytes).
# bf16 weights under autocast (bf16-autocast) are not copied.
AMP_WEIGHT_COPY_BYTES = {name: 2 for name, mode in PRECISION_MODES.items() if mode.weight_copies}
# A precision whose constants are not measured (yet) takes those of one with the same tensor sizes:
# amp-fp16 keeps amp-bf16's tensors; bf16-autocast bf16's (the same weights, grads, state and activation
# sizes; autocast's fp32 ops on bf16 inputs add a little, `features.autocast_fp32_bytes`).
MEASURED_LIKE = {"amp-fp16": "amp-bf16", "bf16-autocast": "bf16", "mp-bf16": "bf16"}

PEAK_FORMULAS = {
    "blog": "parameters + optimizer_state + max(gradients + optimizer_intermediates, activations)",
    "heuristic": "parameters + optimizer_state + gradients + max(optimizer_intermediates, activations)",
    "exact": "simulated peak; components are the live bytes by role at that moment",
    "formula": "parameters + gradients + optimizer_state + max(optimizer_intermediates, activations); activations = "
               "B x L x sum_k c_k x_k(L) + c_weights x N (closed-form features of the config)",
}


def blog_a_bytes(parameters):
    """The blog's A for N parameters: fp32 BYTES per token, exactly as published."""
    return BLOG_SLOPE * parameters + BLOG_INTERCEPT


def training_components(parameters, activation_elements_per_token, batch, seq, precision, optimizer="adamw",
                        activation_multiplier=1.0, checkpointing_factor=1.0) -> dict:
    """Bytes of each term of the heuristic, in consistent units (see module docstring); `optimizer`
    is an OPTIMIZER_TERMS key (`optimizer_key`).

    activations = multiplier x checkpointing factor x A x B x L x bytes per element, plus for
    amp-bf16 the bf16 weight copies (2 bytes x N) that autocast keeps for backward.
    """
    weight = WEIGHT_BYTES[precision]
    activations = (activation_elements_per_token * batch * seq * ACTIVATION_BYTES[precision]
                   * activation_multiplier * checkpointing_factor)
    state, temporaries = optimizer_bytes(optimizer, parameters, weight)
    return {
        "parameters": parameters * weight,
        "gradients": parameters * weight,
        "optimizer_state": state,
        "optimizer_intermediates": temporaries,
        "activations": activations + AMP_WEIGHT_COPY_BYTES.get(precision, 0) * parameters,
    }


@dataclass(frozen=True)
class WeightShape:
    """What FSDP2 and tensor parallelism see of a model's weights, in parameters: transformers' tensor-parallel
    plans leave the input `embedding` whole on every rank and split the rest; FSDP2's root group (the embedding and
    an untied head: `root`) stays gathered from the forward to the end of the backward; the fused 3D `experts`
    weights ([experts, ...], transformers 5) are sharded on their first dimension, which FSDP2 pads to a multiple
    of the shards: past `expert_count` shards each rank holds one expert's rows, and gathers one per shard."""
    parameters: float
    embedding: float = 0.0
    root: float = 0.0
    experts: float = 0.0
    expert_count: int = 0
    layers: int = 1

    def held(self, shards: int, tensor_parallel: int = 1) -> float:
        """Parameters one GPU holds between steps."""
        rest = self.parameters - self.embedding - self.experts
        experts = self.experts / tensor_parallel * self._padded(shards) / shards
        return self.embedding / shards + rest / (shards * tensor_parallel) + experts

    def unsharded(self, shards: int, tensor_parallel: int = 1) -> float:
        """Parameters one GPU holds with every group gathered (fsdp-no-reshard between forward and backward)."""
        rest = self.parameters - self.embedding - self.experts
        return self.embedding + (rest + self.experts * self._padded(shards)) / tensor_parallel

    def gathered(self, shards: int, tensor_parallel: int = 1) -> float:
        """Parameters the root group holds gathered from the forward to the end of the backward under fsdp and
        hsdp (the embedding whole, an untied head split by tensor parallelism)."""
        return self.embedding + (self.root - self.embedding) / tensor_parallel

    def layer(self, shards: int, tensor_parallel: int = 1) -> float:
        """Parameters of one decoder layer's all-gather (or reduce-scatter) on one GPU, FSDP2's padding included."""
        rest = max(self.parameters - self.root - self.experts, 0.0)
        return (rest + self.experts * self._padded(shards)) / max(self.layers, 1) / tensor_parallel

    def _padded(self, shards: int) -> float:
        """The fused experts' all-gathered size over their own (1 unless FSDP2 pads the expert dimension)."""
        if not self.expert_count:
            return 1.0
        return shards * math.ceil(self.expert_count / shards) / self.expert_count


def shard_components(components: dict, sharding: str | None = None, shards: int = 1,
                     tensor_parallel: int = 1, shape: WeightShape | None = None, gathered_bytes: int = 2) -> dict:
    """One GPU's components under a layout (closed forms; the exact estimator runs the real DDP / FSDP2 /
    tensor-parallel code): weights, gradients, optimizer state and the step's temporaries are the share of the
    weights one GPU holds (`WeightShape.held`: split over the `shards` of FSDP2 (hsdp: its shard group; ddp: 1) and
    the `tensor_parallel` ranks; the activations tensor parallelism splits are the formula's,
    `peak.closed_form_peak`); ddp adds the gradient buckets allreduce reads (a second copy of the gradients);
    fsdp-no-reshard keeps every gathered weight from the forward to the backward, beside the shards and the
    activations; fsdp and
    hsdp hold `gathered_weights` (the root group's and the layer being back-propagated, `gathered_bytes` per
    element: the dtype they are gathered in) and, during a layer's backward, `weights_in_flight` (the next layer's
    all-gather and this one's reduce-scatter input, in the gradients' dtype): `peak.peak_of` places them. Without
    a `shape` (the blog's and the heuristic's, which know only N) the weights are one even block and nothing is
    counted gathered."""
    if sharding is None and tensor_parallel == 1:
        return components
    parts = dict(components)
    exact_shape = shape is not None
    shape = shape or WeightShape(1.0)
    held = shape.held(shards, tensor_parallel) / shape.parameters
    for name in ("parameters", "gradients", "optimizer_state", "optimizer_intermediates"):
        parts[name] = components[name] * held
    if sharding == "ddp":
        parts["ddp_buckets"] = parts["gradients"]
    if sharding == "fsdp-no-reshard":
        parts["activations"] += components["parameters"] * shape.unsharded(shards, tensor_parallel) / shape.parameters
    elif shards > 1 and exact_shape:
        layer = shape.layer(shards, tensor_parallel)
        parts["gathered_weights"] = (shape.gathered(shards, tensor_parallel) + layer) * gathered_bytes
        parts["weights_in_flight"] = layer * (gathered_bytes + components["gradients"] / shape.parameters)
    return parts


def blog_components(parameters, batch, seq, precision, optimizer="adamw", checkpointing=False) -> dict:
    """The blog's terms exactly as published (A already in fp32 bytes, times P again)."""
    p = BLOG_P[precision]
    activations = blog_a_bytes(parameters) * batch * seq * p
    return {
        "parameters": parameters * p,
        "gradients": parameters * p,
        "optimizer_state": optimizer_bytes(optimizer, parameters, p)[0],
        "optimizer_intermediates": parameters * p,
        "activations": activations / BLOG_CHECKPOINTING_DIVISOR if checkpointing else activations,
    }


def blog_peak(c: dict) -> float:
    """The blog's total: weights + state + max(gradients + optimizer intermediates, activations)."""
    return c["parameters"] + c["optimizer_state"] + c.get("ddp_buckets", 0.0) \
        + max(c["gradients"] + c["optimizer_intermediates"], c["activations"])


def heuristic_peak(c: dict) -> float:
    """weights + state + gradients + max(optimizer intermediates, activations).

    The measured peaks are never in the forward: about half are in the optimizer step (weights +
    state + gradients + intermediates, as the blog says), the others in the backward, where the
    gradients pile up while the activations are still alive; so gradients count in both branches.
    """
    return c["parameters"] + c["optimizer_state"] + c.get("ddp_buckets", 0.0) + c["gradients"] \
        + max(c["optimizer_intermediates"], c["activations"])


# The components each peak adds outside its max(): what the activations branch must leave room for.
OUTSIDE_MAX = {
    "blog": ("parameters", "optimizer_state"),
    "heuristic": ("parameters", "optimizer_state", "gradients"),
    "formula": ("parameters", "optimizer_state", "gradients"),
}


def unit_mismatch_example(parameters: int = 1_543_714_304, batch: int = 16, seq: int = 256,
                          hook_elements_per_token: int = 1_266_304) -> dict:
    """Qwen2.5-1.5B in numbers: the blog's A is already bytes, and its formula multiplies by P again.

    `hook_elements_per_token` is the count the blog itself reports (5,065,216 fp32 bytes / 4),
    which our meta-device hook count reproduces (docs/definitions.md).
    """
    a_bytes = blog_a_bytes(parameters)
    as_published = a_bytes * batch * seq * 4
    meant = a_bytes * batch * seq
    return {
        "model_id": "Qwen/Qwen2.5-1.5B",
        "parameters": parameters,
        "batch_size": batch,
        "seq_len": seq,
        "precision": "fp32",
        "blog_A_fp32_bytes_per_token": a_bytes,
        "blog_activation_bytes_as_published": as_published,
        "blog_activation_bytes_meant": meant,
        "factor": as_published / meant,
        "blog_measured_hook_fp32_bytes": hook_elements_per_token * 4 * batch * seq,
        "explanation": "A = 4.6894e-4*N + 1.8494e6 is fp32 bytes per token; Activation Memory = A*B*L*P "
                       "multiplies by P = 4 bytes again, so it is 4x (fp32) or 2x (bf16) what the fit meant.",
    }
