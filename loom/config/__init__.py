from loom.config.errors import ConfigError, UserError
from loom.config.load import build_config, parse_overrides, to_toml
from loom.config.sections import (
    CheckpointConfig,
    Config,
    DataConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainingConfig",
    "UserError",
    "build_config",
    "parse_overrides",
    "to_toml",
]
