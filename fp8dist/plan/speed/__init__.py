"""The FP8 speed model: is a Linear faster in FP8 than in bf16 on a given GPU, at this run's tokens, under this
recipe, and by how much. A prediction, calibrated on torchao's published H100 measurements (and, for the block-scaled
GEMMs and casts, its B200 forward table) and scaled to other GPUs by their datasheets (:mod:`fp8dist.plan.gpus`);
``benchmarks/speed_model/README.md`` gives the model, its sources, its accuracy and what it does not see.

    >>> from fp8dist.plan.speed import predict_linear
    >>> predict_linear(8192, 2048, 5632, target="h100", recipe="rowwise").describe()
    'predicted 0.83x on H100 at 8,192 tokens (rowwise)'
"""

from .model import LinearPrediction, predict_fp8_speedup, predict_linear, resolve_gpu
from .recipes import RECIPES, Recipe
from .step import DEFAULT_MARGIN, Gemm, LayerChoice, StepPrediction, compare_recipes, predict_gemms, recipes_for

__all__ = ["predict_fp8_speedup", "predict_linear", "LinearPrediction", "predict_gemms", "compare_recipes",
           "recipes_for", "StepPrediction", "LayerChoice", "Gemm", "DEFAULT_MARGIN", "RECIPES", "Recipe", "resolve_gpu"]
