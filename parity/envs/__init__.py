"""Environments: prompts and verifiable rewards."""

from .toy import TargetTokensTask

__all__ = ["TargetTokensTask"]
