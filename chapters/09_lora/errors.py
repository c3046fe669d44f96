"""OpenAI error objects: every error this server answers is one, whatever raised it.

{"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import BaseModel


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error response (and what /openapi.json documents for them)."""

    error: ErrorObject


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param=None,
        code=None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def internal_error(e: BaseException) -> APIError:
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")
