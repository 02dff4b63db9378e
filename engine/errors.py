"""What the engine raises for a request it cannot serve; the API turns each into its status code."""


class RequestError(ValueError):
    """A request the engine cannot serve (bad prompt, too long, duplicate id), named in the message."""


class GrammarError(RequestError):
    """A request's structured output that cannot be compiled (or allows no answer)."""


class Overloaded(RuntimeError):
    """The server cannot take the request now; the client should retry after `retry_after_s`."""

    def __init__(self, message: str = "the server is overloaded; retry later", retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        return (Overloaded, (str(self), self.retry_after_s))


class ContextLengthError(RequestError):
    """The prompt does not fit the context (with room for one output token)."""

    code = "context_length_exceeded"
