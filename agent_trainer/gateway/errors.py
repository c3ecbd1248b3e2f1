"""The gateway's refusals, in OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations


class GatewayError(Exception):
    """A request the gateway refuses: the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        """The JSON body OpenAI's clients parse (``openai.APIStatusError.body``)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    """A 400 ``invalid_request_error``."""
    return GatewayError(400, message, param=param, code=code)
