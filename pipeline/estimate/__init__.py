"""Stage: estimate the peak memory of a training step (blog / heuristic / exact).

One estimator object per method (`ESTIMATORS`), each with `predict(target, run) -> Estimate`:

- `BlogEstimator`: the blog's formula and coefficients exactly as published (`pipeline.formulas.components`:
  every term N*P, activations A*B*L*P with A in fp32 bytes). Its flaws are kept on purpose and
  listed in `BLOG_NOTES` (and in the JSON's "notes").
- `HeuristicEstimator(coefficients)`: the same components with our refit coefficients
  (results/coefficients.json) in consistent units, combined as the measured peaks show
  (`heuristic_peak`: gradients count in both branches), with the activations multiplier and the
  gradient-checkpointing factor measured from the peak table; precision-aware (amp-bf16) and
  optimizer-aware (SGD: one momentum buffer, no weight-sized temporaries).
- `ExactEstimator`: the simulator `pipeline.simulate.simulate` on the model's config.

Every estimator also predicts the allocator's reserved bytes (`torch.cuda.max_memory_reserved()`):
the exact one by replaying the caching allocator's segments, the closed forms as their peak times
the measured reserved/allocated ratio of the coefficient file. The fit verdict is judged on them:
reserved + the memory outside PyTorch (`pipeline.formulas.gpus`) <= the device's nvidia-smi total.

`max_batch_size` and `max_seq_len` give the largest batch (or sequence length) that fits a GPU (the
peak grows with both): a doubling search for the closed forms, a headroom-guided one for the
simulator (`search`); a question's own simulations are remembered for its length (`memo`), so that
the answer at the value found is not simulated again.

Modules: `values` (Run, Target, Estimate), `estimators` (the classes and `ESTIMATORS`), `targets`
(what is estimated, from a model id, a config or a parameter count), `verdict` (the fit verdict and
the device), `search` (the largest batch or sequence that fits), `memo` (one question's simulations),
`api` (the public functions), `cli` (the `estimate` command). Importing the package imports neither torch nor transformers.
"""

from pipeline.estimate.api import answer, estimate, layouts, max_batch_size, max_seq_len, prepare
from pipeline.estimate.cli import add_cli, human_summary
from pipeline.estimate.estimators import (ESTIMATORS, BlogEstimator, ClosedFormEstimator, Estimator, ExactEstimator,
                                          FormulaEstimator, HeuristicEstimator)
from pipeline.estimate.search import largest, largest_batch, largest_seq
from pipeline.estimate.targets import resolve_target
from pipeline.training.values import GIB, Estimate, Run, Target
from pipeline.estimate.verdict import Verdict, judge, gpu_of

__all__ = ["layouts", "ESTIMATORS", "GIB", "BlogEstimator", "ClosedFormEstimator", "Estimate", "Estimator", "ExactEstimator",
           "FormulaEstimator", "HeuristicEstimator", "Run", "Target", "Verdict", "add_cli", "answer", "estimate",
           "human_summary", "judge", "largest", "largest_batch", "largest_seq", "max_batch_size", "max_seq_len",
           "prepare", "gpu_of", "resolve_target"]
