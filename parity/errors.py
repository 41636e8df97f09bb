"""The error types `parity` raises for bad input; the CLI prints them as one line, no traceback."""


class ParityError(Exception):
    """Base class: a user-facing problem with a message that names the culprit."""


class ConfigError(ParityError, ValueError):
    """A configuration field is unknown, of the wrong type, or inconsistent with another."""


class CheckpointError(ParityError):
    """A checkpoint file is missing, corrupt, or does not match its config."""


class InputError(ParityError, ValueError):
    """A token sequence or request is invalid (out-of-vocab id, too long, empty, ...)."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM during training: a checkpoint was saved at `path` (not a ParityError:
    the input was fine; the CLI reports it with exit status 130 or 143)."""

    def __init__(self, path, signal_name: str = "SIGINT"):
        super().__init__(str(path))
        self.path = path
        self.signal_name = signal_name


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command has no handler of its own (training installs one that
    saves a checkpoint): the command unwinds as on Ctrl-C, so its clean-ups run (a half-built
    base policy's directory is removed), instead of dying where it stood."""


class SandboxFailure(OSError):
    """The sandbox could not be set up, before any of the model's code ran: the tool call cannot
    be judged, so its episode must not be scored. The rollout fails (a local worker is restarted
    and its batch sampled again, up to its restart limit; elsewhere the run stops with this line)."""


class WaitInterrupted(Exception):
    """A rollout backend stopped waiting for a batch because the run was asked to stop (Ctrl-C
    or SIGTERM while the learner waited): the controller saves at that step boundary and raises
    `Interrupted` (a wait could outlast a scheduler's grace period)."""
