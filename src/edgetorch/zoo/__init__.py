"""Small reference models, their pretraining recipes (the zoo's, the layer-reduction paper's networks), MiniLM-L6 as a
text classifier with its fine-tuning recipe, and model-spec resolution."""

from .minilm import MiniLMClassifier, minilm_optimizer, minilm_path, text_accuracy
from .models import MLP, BasicBlock, PlainCNN, SmallResNet
from .paper import PAPER_HIDDEN, PAPER_RECIPES, PaperRecipe, paper_mlp
from .pretrain import (
    RECIPES,
    PretrainConfig,
    build_zoo_model,
    checkpoint_paths,
    default_config,
    load_pretrained,
    pretrain,
    pretrained,
)
from .registry import ZOO_MODELS, build_model, input_channels, redraw_batchnorm, redraw_zero_weights, torchvision_classification_models
from ..training import evaluate_accuracy
from ..weights import CheckpointError, load_weights, read_weights, save_weights

__all__ = [
    "MLP",
    "MiniLMClassifier",
    "PAPER_HIDDEN",
    "PAPER_RECIPES",
    "RECIPES",
    "ZOO_MODELS",
    "BasicBlock",
    "CheckpointError",
    "PaperRecipe",
    "PlainCNN",
    "PretrainConfig",
    "SmallResNet",
    "build_model",
    "build_zoo_model",
    "checkpoint_paths",
    "default_config",
    "evaluate_accuracy",
    "input_channels",
    "load_pretrained",
    "load_weights",
    "minilm_optimizer",
    "minilm_path",
    "paper_mlp",
    "pretrain",
    "pretrained",
    "read_weights",
    "redraw_batchnorm",
    "redraw_zero_weights",
    "save_weights",
    "text_accuracy",
    "torchvision_classification_models",
]
