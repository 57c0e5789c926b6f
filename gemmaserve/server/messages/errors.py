"""Errors on the Messages routes in Anthropic's shape: {"type": "error", "error": {"type", "message"}}.

The server raises one `ApiError` everywhere (OpenAI's shape); app.py's handlers render it this way when the path
is a Messages route, so authentication, readiness, body and validation errors all read as Anthropic's."""

from __future__ import annotations

from ..protocol import ApiError

PREFIX = "/v1/messages"

# Anthropic's error types by status (its 529 "overloaded" is our 503: the server loads, drains or stopped)
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 409: "invalid_request_error",
          413: "request_too_large", 429: "rate_limit_error", 499: "invalid_request_error",
          503: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_body(err: ApiError) -> dict:
    return {"type": "error", "error": {"type": _TYPES.get(err.status, "api_error"), "message": err.message}}


_SCHEMA = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"},
    "error": {"type": "object", "required": ["type", "message"],
              "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}

# the routes' documented error responses (the OpenAPI document's, read by fuzzers and client generators)
ERROR_RESPONSES = {status: {"description": text, "content": {"application/json": {"schema": _SCHEMA}}}
                   for status, text in ((400, "invalid request"), (401, "missing or wrong API key"),
                                        (404, "unknown model"), (408, "past the request's deadline"),
                                        (413, "body too large"), (429, "queue full"),
                                        (499, "client closed the request"), (503, "loading, draining or stopped"))}
