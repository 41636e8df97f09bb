"""Configs in one place: the training run (`TrainConfig` and its sections), the task table
(`TaskSection`, `task.py`), the learner and its objectives (`LearnerConfig`, `LossConfig`), and
TOML in and out with dotted overrides.

The `rl` package imports these; nothing here imports `rl`.
"""

from .learner import LOSS_NAMES, LearnerConfig, LossConfig
from .loading import (
    config_from_dict,
    config_to_dict,
    load_config,
    parse_override,
    read_toml,
    revalidated,
    set_dotted,
    to_toml,
    with_overrides,
)
from .task import TASK_NAMES, TaskSection
from .train import (
    BASE_CHECKPOINTS,
    ModelSection,
    RaySection,
    RolloutSection,
    TrainConfig,
)

__all__ = ["BASE_CHECKPOINTS", "LOSS_NAMES", "TASK_NAMES", "LearnerConfig", "LossConfig", "ModelSection",
           "RaySection", "RolloutSection", "TaskSection", "TrainConfig", "config_from_dict", "config_to_dict",
           "load_config", "parse_override", "read_toml", "revalidated", "set_dotted", "to_toml",
           "with_overrides"]
