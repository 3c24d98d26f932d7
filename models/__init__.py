"""fedpar.models: the model zoo (MLP, FedAvg CNN, small GPT) and numpy weight exchange helpers."""

from fedpar.models.cnn import FedAvgCNN
from fedpar.models.for_data import build_model_for_data
from fedpar.models.gpt import GPT, GPTConfig
from fedpar.models.mlp import MLP
from fedpar.models.registry import build_model, model_names
from fedpar.models.weights import get_weights, set_weights, weight_specs

__all__ = [
    "FedAvgCNN",
    "GPT",
    "GPTConfig",
    "MLP",
    "build_model",
    "build_model_for_data",
    "get_weights",
    "model_names",
    "set_weights",
    "weight_specs",
]
