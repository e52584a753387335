"""Errors a user can cause, raised once, at the boundary, with the offending value named; and
EngineDeadError, the one that is not theirs."""


class MoeloraError(Exception):
    """Base class of every user-facing error."""


class InvalidRequestError(MoeloraError, ValueError):
    """A request or its sampling parameters cannot be served (HTTP 400)."""


class ConfigError(MoeloraError, ValueError):
    """The engine's configuration is invalid or cannot be met on this machine."""


class ModelConfigError(MoeloraError, ValueError):
    """The model folder holds something this engine does not support."""


class AdapterError(MoeloraError, ValueError):
    """An adapter folder is refused: the message names the adapter, the key and the mismatch."""


class AdapterNotFoundError(MoeloraError, KeyError):
    """No adapter is registered under that name (HTTP 404)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class AdapterExistsError(MoeloraError, ValueError):
    """An adapter of that name is already registered (HTTP 400)."""


class AdapterBusyError(MoeloraError, RuntimeError):
    """The adapter has requests in flight and cannot be unloaded now (HTTP 409)."""


class EngineDeadError(MoeloraError, RuntimeError):
    """The engine cannot go on: a rank of a tensor-parallel engine died or stopped answering, or
    the server's engine thread has stopped (HTTP 503). Not the user's doing, but a MoeloraError
    all the same, so that the command line says it in one line; the server maps it first."""
