"""OpenAI's error body, and the field paths its messages name."""

from __future__ import annotations

from typing import Any

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error the API answers with: its HTTP status and OpenAI's error body (vLLM's style:
    ``{"error": {"message", "type", "param", "code"}}``, ``code`` the status)."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        param: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.type = error_type or _ERROR_TYPES.get(status_code, "APIError")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status_code,
            }
        }


def loc_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """A pydantic error location as a field path: ('messages', 0, 'role') -> messages[0].role."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def short_repr(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
