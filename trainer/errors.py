"""The errors a run ends with on purpose; train.py maps each to one message and an exit code."""


class ConfigError(Exception):
    """A bad setting. The message names the setting to change; rank 0 prints it once."""


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or Inf; the last checkpoint (written before it) is kept."""
