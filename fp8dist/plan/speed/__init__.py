"""The FP8 speed model: how much faster (or slower) a Linear or a step's GEMMs run in FP8 than in bf16 on a named GPU,
under a recipe. A prediction, calibrated on torchao's published H100 and B200 tables and scaled to other GPUs by their
datasheets; ``benchmarks/speed_model/README.md`` gives the model, its sources and its accuracy."""

from .model import LinearPrediction, predict_fp8_speedup, predict_linear, resolve_gpu
from .recipes import RECIPES, Recipe
from ...config.options import DEFAULT_MARGIN
from .step import Gemm, LayerChoice, StepPrediction, compare_recipes, predict_gemms, recipes_for

__all__ = ["predict_fp8_speedup", "predict_linear", "LinearPrediction", "predict_gemms", "compare_recipes",
           "recipes_for", "StepPrediction", "LayerChoice", "Gemm", "DEFAULT_MARGIN", "RECIPES", "Recipe", "resolve_gpu"]
