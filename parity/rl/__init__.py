"""Training side: trajectories, objectives, and the learner."""

from .learner import Learner, LearnerConfig
from .losses import LOSSES, LossConfig, get_loss, group_advantages
from .trajectory import Trajectory, TrajectoryBatch

__all__ = ["LOSSES", "Learner", "LearnerConfig", "LossConfig", "Trajectory", "TrajectoryBatch",
           "get_loss", "group_advantages"]
