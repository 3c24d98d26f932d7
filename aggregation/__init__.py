"""fedpar.aggregation: strategies and the math of federated aggregation (streaming, sharded), compression, DP."""

from fedpar.aggregation.accumulator import FoldConfig, ShapesAndDtypes, WeightedSum
from fedpar.aggregation.compression import Compressor, Encoded, decode, encode, encode_update
from fedpar.aggregation.errors import NoUpdatesError
from fedpar.aggregation.fedavg_strategies import FedAvg, FedAvgM
from fedpar.aggregation.fedopt import FedAdagrad, FedAdam, FedOpt, FedYogi
from fedpar.aggregation.fedprox import FedProx, proximal_term
from fedpar.aggregation.privacy import DPStrategy
from fedpar.aggregation.registry import (build_strategy, parse_strategy_options, strategy_names,
                                         strategy_options_help)
from fedpar.aggregation.robust import Krum, Median, MultiKrum, TrimmedMean
from fedpar.aggregation.strategy import FoldItem, Strategy, StreamingStrategy
from fedpar.aggregation.weighted_mean import fedavg
from fedpar.protocol.compressed_wire import CompressionConfig

__all__ = [
    "FoldConfig", "WeightedSum", "ShapesAndDtypes", "fedavg", "NoUpdatesError",
    "Strategy", "StreamingStrategy", "FoldItem", "FedAvg", "FedAvgM", "FedProx", "proximal_term",
    "FedOpt", "FedAdam", "FedYogi", "FedAdagrad", "Median", "TrimmedMean", "Krum", "MultiKrum",
    "build_strategy", "strategy_names", "parse_strategy_options", "strategy_options_help", "DPStrategy",
    "CompressionConfig", "Compressor", "Encoded", "encode", "decode", "encode_update",
]
