"""Training side: trajectories, objectives, the learner, the rollout worker and the controller."""

from ..config.learner import LearnerConfig, LossConfig
from .learner import Learner
from .losses import LOSSES, get_loss, group_advantages
from .trajectory import RolloutBatch, Trajectory, TrajectoryBatch

__all__ = ["LOSSES", "Learner", "LearnerConfig", "LossConfig", "RolloutBatch", "Trajectory",
           "TrajectoryBatch", "get_loss", "group_advantages"]
