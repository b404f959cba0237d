"""The two counts of one forward (hook elements, saved storages) and one model's counting forwards.

Forwards run on the meta device (`forward=meta`). When a forward needs a value that meta tensors do
not have (`Tensor.item()` in a data-dependent branch), it runs again with the values that follow
from the input ids computed for real on the CPU beside the meta tensors (`forward=meta-fallback`).
What still fails runs on the CPU with real buffers and weights that take no memory (`forward=cpu`)
when its activations fit, else the point is an error with its reason.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass

from pipeline.core.text import first_line
from pipeline.activations.points import CPU_FORWARD_MAX_BYTES, FORWARD_SETTINGS
from pipeline.activations.replay import Tally, replayed_layers
from pipeline.inputs.modeling import architecture_facts, build_model


def hook_elements(model, ids, replay: bool = False, tally: Tally | None = None) -> int:
    """The blog's method: numel of every module's tensor outputs, eval mode, no_grad."""
    import torch

    tally = tally or Tally()

    def add_outputs(module, inputs, output):
        if isinstance(output, torch.Tensor):
            tally.hook_elements += output.numel()
        elif isinstance(output, (tuple, list)):
            tally.hook_elements += sum(t.numel() for t in output if isinstance(t, torch.Tensor))

    handles = [module.register_forward_hook(add_outputs) for module in model.modules()]
    try:
        model.eval()
        with torch.no_grad(), replayed_layers(model, tally, replay):
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return tally.hook_elements


def saved_storages(model, ids, autocast: bool = False, replay: bool = False,
                   tally: Tally | None = None) -> tuple[int, int]:
    """(bytes, elements) of the distinct storages autograd saves in the standard step's forward.

    Storages are told apart by their StorageImpl (`_cdata`), which views share and which stays
    unique while the storage is alive (meta tensors all have data_ptr 0); the model's parameters
    and buffers, and views of them, are excluded.
    """
    import torch

    from pipeline.training.autocast import CudaAutocast

    state = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    storages = {}
    tally = tally or Tally()

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in state and storage._cdata not in storages:
            storages[storage._cdata] = storage
            tally.saved_bytes += storage.nbytes()
            tally.saved_elements += storage.nbytes() // tensor.element_size()
        # Not the tensor: a graph node saving its own output through a hook would hold itself (a
        # cycle through C++ that leaks). The storages above stay alive until the forward ends.
        return None

    model.train()
    with ExitStack() as stack:
        stack.enter_context(torch.enable_grad())
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None))  # no backward
        if autocast:
            stack.enter_context(CudaAutocast(device_type=ids.device.type).autocast(torch.bfloat16))
        stack.enter_context(replayed_layers(model, tally, replay, storages))
        model(input_ids=ids, labels=ids, use_cache=False)
    return tally.saved_bytes, tally.saved_elements


FORWARD_PATHS = ("meta", "meta-fallback", "cpu")


class PointTimeout(BaseException):
    """Raised by the alarm; a BaseException so that no `except Exception` on the way swallows it."""


@dataclass
class Measurement:
    elements: int | None = None
    bytes: int | None = None
    forward: str | None = None
    status: str = "ok"
    reason: str | None = None
    seconds: float = 0.0


class ModelCounter:
    """One model's counting forwards: built on meta once per dtype, falling back path by path.

    Paths: `meta`; `meta-fallback` (input-derived values tracked, see dispatch.MetaDispatchMode);
    `cpu`: a real CPU forward with real buffers and weights that take no memory (a zero expanded
    to the weight's shape), for branches on weight-derived values such as MoE routing with
    `.tolist()`; the math SDPA kernel is used there, as on meta.
    """

    def __init__(self, config, replay_layers: bool = True):
        self.config = config
        self.replay_layers = replay_layers  # see replayed_layers; never on the CPU path (real values)
        self.models = {}
        self.first_path = {"hook": "meta", "saved": "meta"}
        self.vocab_size = architecture_facts(config)["vocab_size"] or 2
        self.elements_per_token = None  # of the hook method, once measured
        self.shape_cache = {}
        self.last_tally = None  # of the last forward

    def model(self, dtype: str, device: str = "meta"):
        if (dtype, device) not in self.models:
            if device == "cpu":
                self.models = {key: m for key, m in self.models.items() if key[1] == "meta"}  # one at a time
                self.models[dtype, device] = zero_weight_model(self.config, dtype)
            else:
                self.models[dtype, device] = build_uninitialised(self.config, device, dtype)
        return self.models[dtype, device]

    def parameters(self) -> int:
        return sum(p.numel() for p in self.model("float32").parameters())

    def hook(self, batch: int, seq: int) -> Measurement:
        measurement = self.measure("hook", batch, seq, "float32")
        if measurement.status == "ok":
            self.elements_per_token = measurement.elements / (batch * seq)
        return measurement

    def saved(self, batch: int, seq: int, precision: str) -> Measurement:
        dtype, autocast = FORWARD_SETTINGS[precision]
        return self.measure("saved", batch, seq, dtype, autocast)

    def measure(self, method: str, batch: int, seq: int, dtype: str, autocast: bool = False) -> Measurement:
        start = time.perf_counter()
        errors = []
        for path in FORWARD_PATHS[FORWARD_PATHS.index(self.first_path[method]):]:
            try:
                elements, nbytes = self.run(path, method, batch, seq, dtype, autocast)
            except PointTimeout:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure means: try the next path
                errors.append(f"{path}: {first_line(exc)}")
                continue
            if path != "cpu":
                self.first_path[method] = path  # later points start where this one succeeded
            return Measurement(elements, nbytes, path, seconds=time.perf_counter() - start)
        return Measurement(status="error", reason="; ".join(errors), seconds=time.perf_counter() - start)

    def run(self, path: str, method: str, batch: int, seq: int, dtype: str, autocast: bool):
        """(elements, bytes) of one forward on `path`; bytes is None for the hook method."""
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from pipeline.activations.dispatch import MetaDispatchMode, ZeroWeightRetryMode

        ids = self.input_ids(method, batch, seq)
        if path == "cpu":
            if autocast:
                raise RuntimeError("amp-bf16 is not counted on the CPU path (casts of zero weights would be free)")
            likely = 8 * (self.elements_per_token or 2e6) * batch * seq
            if likely > CPU_FORWARD_MAX_BYTES:
                raise RuntimeError(f"a CPU forward would hold about {likely / 2**30:.0f} GiB of activations")
            model = self.model(dtype, "cpu")
            with sdpa_kernel(SDPBackend.MATH), ZeroWeightRetryMode():
                return self.count(method, model, ids, autocast, replay=False)
        model = self.model(dtype)
        mode = MetaDispatchMode(path == "meta-fallback", self.shape_cache)
        meta_ids = torch.empty(ids.shape, dtype=ids.dtype, device="meta")
        if path == "meta-fallback":
            mode.track(meta_ids, ids)
        with mode:
            return self.count(method, model, meta_ids, autocast, replay=self.replay_layers)

    def count(self, method: str, model, ids, autocast: bool, replay: bool):
        self.last_tally = Tally()
        if method == "hook":
            return hook_elements(model, ids, replay, self.last_tally), None
        nbytes, elements = saved_storages(model, ids, autocast, replay, self.last_tally)
        return elements, nbytes

    def input_ids(self, method: str, batch: int, seq: int):
        """The blog's zeros for the hook method; ids uniform over the vocabulary for the training step."""
        import torch

        if method == "hook":
            return torch.zeros((batch, seq), dtype=torch.int64)
        generator = torch.Generator().manual_seed(0)
        return torch.randint(0, self.vocab_size, (batch, seq), generator=generator)


def build_uninitialised(config, device: str, dtype: str):
    """pipeline.inputs.modeling.build_model without initialising the weights (their values never matter
    here; on meta this builds 2-5x faster), then tied as transformers' init_weights would tie them."""
    import torch
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = build_model(config, device=device, dtype=getattr(torch, dtype))
    model.tie_weights(recompute_mapping=False)
    return model


def zero_weight_model(config, dtype: str):
    """The model on the CPU, with real buffers (rotary tables ...) and weights that take no memory.

    Built without weight initialisation (untouched allocations cost no memory), then each weight is
    replaced by a zero expanded to its shape; tied weights stay tied.
    """
    import torch

    model = build_uninitialised(config, "cpu", dtype)
    zeros = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) not in zeros:
                zero = torch.zeros((), dtype=param.dtype).expand(param.shape)
                zeros[id(param)] = torch.nn.Parameter(zero, requires_grad=param.requires_grad)
            if param is not None:
                module._parameters[name] = zeros[id(param)]
    return model


def quiet_transformers():
    from transformers.utils import logging

    logging.set_verbosity_error()
