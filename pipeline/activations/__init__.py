"""Stage 3: parameter and activation counts of every registry model, on the meta device (no weights).

Two activation counts (docs/definitions.md):

- `hook` (the blog's method): sum of the tensor outputs of every module of `model.modules()` (a tensor,
  or the tensors inside a tuple/list output) in a forward of a (B, L) int64 input, eval mode,
  `no_grad`; elements, and bytes = elements x element size of the dtype.
- `saved`: bytes of the distinct storages that autograd saves during the forward of the standard
  training step (train mode, `use_cache=False`, `labels=ids`), the model's parameters and buffers
  excluded.

Forwards run on the meta device (`forward=meta`). When a forward needs a value that meta tensors do
not have (`Tensor.item()` in a data-dependent branch), it runs again with the values that follow
from the input ids computed for real on the CPU beside the meta tensors (`forward=meta-fallback`):
position ids, masks and packed-sequence checks get their true values, weights stay absent. What
still fails (branches on weight-derived values, e.g. MoE routing read with `.tolist()`) runs on the
CPU with real buffers and weights that take no memory (`forward=cpu`) when its activations fit,
else the row is an error with its reason.

Repeated layers are counted once (`replay.replayed_layers`).

Attention: meta tensors take the math kernel of scaled_dot_product_attention, which saves the
attention probabilities (B x heads x L x L per layer) for backward; CUDA's flash and
memory-efficient kernels save a log-sum-exp instead. The `saved` counts therefore grow with L^2
where CUDA's may not (bf16, and fp32 without grouped-query attention, use those kernels there).

Modules: `points` (point sets, precisions, limits), `counts` (the two counts, one model's
forwards and their fallback paths), `dispatch` (the meta and CPU dispatch modes; torch),
`replay` (layer replay; the amp-bf16 forward uses CUDA's autocast policy of `pipeline.training.autocast`),
`table` (one model's rows), `stage` (every registry model, worker processes), `one_model`
(`count()`), `cli`. Importing this package imports no torch.
"""

from pipeline.activations.cli import add_cli
from pipeline.activations.counts import Measurement, ModelCounter, hook_elements, saved_storages
from pipeline.activations.one_model import count
from pipeline.activations.points import DEFAULT_POINTS, POINT_SETS, PointSet
from pipeline.activations.replay import Tally, replayed_layers
from pipeline.activations.stage import count_all, read_jobs, write_activations
from pipeline.activations.table import ACTIVATION_COLUMNS, MODEL_COLUMNS, ModelJob, count_model

__all__ = [
    "ACTIVATION_COLUMNS", "DEFAULT_POINTS", "MODEL_COLUMNS", "POINT_SETS", "Measurement", "ModelCounter", "ModelJob",
    "PointSet", "Tally", "add_cli", "count", "count_all", "count_model", "hook_elements", "read_jobs",
    "replayed_layers", "saved_storages", "write_activations",
]
