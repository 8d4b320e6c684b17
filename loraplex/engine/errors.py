"""Errors the engine raises for bad requests. The control plane maps them to HTTP 400/404/503."""


class EngineError(Exception):
    """Base class for engine errors."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is malformed (empty prompt, too long, bad sampling parameters)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """A prompt refused before it was tokenized: its size alone shows that it holds at least `min_tokens`
    tokens, which leaves no room in the context (`max_model_len`) for a generated one."""

    def __init__(self, message: str, param: str | None = None, *, min_tokens: int, max_model_len: int):
        super().__init__(message, param)
        self.min_tokens = min_tokens
        self.max_model_len = max_model_len


class ModelLoadError(EngineError):
    """A model directory, GGUF file or Hub id could not be loaded."""


class AdapterLoadError(EngineError):
    """An adapter could not be loaded into the engine (missing, corrupt, incompatible)."""


class AdapterMissingError(AdapterLoadError):
    """The adapter's weights are gone from where the request said they were: its version was deleted (and
    its store entry removed) after the request was accepted, before the request got to load it."""


class EngineOverloadedError(EngineError):
    """The engine cannot accept more work right now (queue full or shutting down)."""


class EngineUnreachableError(EngineOverloadedError):
    """An engine process could not be reached, or went away before the request's first output: nothing of
    the request was served, so another engine may take it."""
