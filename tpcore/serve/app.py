"""The HTTP side: FastAPI routes with the OpenAI API's paths and shapes, errors as OpenAI error bodies.

``POST /v1/completions``, ``/v1/chat/completions`` (``stream: true``: server-sent events, one per text delta,
then ``data: [DONE]``), ``/v1/embeddings``, ``/v1/audio/transcriptions`` (for a speech-to-text model: a multipart
upload); ``GET /v1/models``, ``/health``. Every refusal is a 4xx (5xx for the
server's own failures) with ``{"error": {"message", "type", "param", "code"}}``; with an ``api_key`` every
``/v1`` route asks for ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tpcore.serve.requests import Delta, Finished, ServeError
from tpcore.serve.schemas import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    embedding_response,
    transcription_response,
)
from tpcore.serve.service import Service

__all__ = ["create_app"]


def error_body(
    status: int, message: str, kind: str, param: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status, headers=headers
    )


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """The OpenAI API's error body, as every refusal and failure is answered."""

    error: ErrorDetail


def _declared(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a route that answers ``statuses`` with :class:`ErrorResponse`."""
    return {status: {"model": ErrorResponse, "description": _MEANING[status]} for status in statuses}


#: what each error status of the API means
_MEANING = {
    400: "an invalid request (its body, a parameter, a prompt over the model's length)",
    401: "a missing or wrong API key (when the server has one)",
    404: "a model this server does not serve, or an endpoint it does not serve for this model",
    413: "a request body over the server's limit",
    429: "the queue is full: retry later",
    500: "the generation failed",
    503: "the model's engine is down (a rank died)",
    504: "the request took longer than the server's timeout",
}

#: the errors a POST route may answer
_POST_ERRORS = _declared(400, 401, 404, 413, 429, 500, 503, 504)


class TooLarge(ServeError):
    status = 413


class Unauthorized(ServeError):
    status = 401
    kind = "authentication_error"


def create_app(service: Service, api_key: str | None = None, max_body_bytes: int = 1 << 20) -> FastAPI:
    """The ASGI app serving ``service``; request bodies over ``max_body_bytes`` get 413."""

    def authorized(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if api_key and not hmac.compare_digest(given, f"Bearer {api_key}".encode()):
            raise Unauthorized("missing or wrong API key (Authorization: Bearer <key>)")

    app = FastAPI(title="tpcore serve", dependencies=[])
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    _add_error_handlers(app)
    guarded = [Depends(authorized)]

    @app.get("/health", responses=_declared(503))
    async def health() -> JSONResponse:
        if not service.healthy:
            return error_body(503, "the model's engine is down (a rank died?): restart the server", "unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", dependencies=guarded, responses=_declared(401))
    async def models() -> dict[str, Any]:
        card = {"id": service.name, "object": "model", "created": service.created, "owned_by": "tpcore"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=guarded, responses=_POST_ERRORS)
    async def completions(body: CompletionRequest) -> Any:
        service.check_model(body.model, "generate")
        return await _generate(service, service.completion(body), body.stream, chat=False)

    @app.post("/v1/chat/completions", dependencies=guarded, responses=_POST_ERRORS)
    async def chat_completions(body: ChatRequest) -> Any:
        service.check_model(body.model, "generate")
        generation = await asyncio.to_thread(service.chat, body)  # images are decoded and processed off the loop
        return await _generate(service, generation, body.stream, chat=True)

    @app.post("/v1/embeddings", dependencies=guarded, responses=_POST_ERRORS)
    async def embeddings(body: EmbeddingRequest) -> Any:
        service.check_model(body.model, "embed")
        async for event in service.events(service.embedding_inputs(body.texts())):
            if isinstance(event, Finished):
                return embedding_response(
                    service.name, event.embeddings or [], body.encoding_format, event.prompt_tokens
                )
        raise ServeError("no embeddings came back")

    if service.kind == "transcribe":
        _add_transcriptions(app, service, guarded)
    app.openapi = lambda: _without_unanswered(FastAPI.openapi(app))  # type: ignore[method-assign]
    return app


def _add_transcriptions(app: FastAPI, service: Service, guarded: list) -> None:
    """``POST /v1/audio/transcriptions`` (a multipart upload, as OpenAI's), for a speech-to-text model."""

    @app.post("/v1/audio/transcriptions", dependencies=guarded, responses=_POST_ERRORS)
    async def transcriptions(
        file: Annotated[UploadFile, File(description="the audio: WAV, FLAC, Ogg or MP3")],
        model: Annotated[str, Form()],
        language: Annotated[str | None, Form(min_length=1)] = None,
        prompt: Annotated[str | None, Form()] = None,
        response_format: Annotated[Literal["json", "text", "verbose_json", "srt", "vtt"], Form()] = "json",
        temperature: Annotated[float, Form(ge=0.0, le=1.0)] = 0.0,
    ) -> Any:
        service.check_model(model, "transcribe")
        audio = await file.read()
        timestamps = response_format in ("verbose_json", "srt", "vtt")  # their segments need the model's timestamps
        payload = await asyncio.to_thread(service.transcription, audio, language, temperature, prompt, timestamps)
        async for event in service.events(payload):
            if isinstance(event, Finished) and event.transcript is not None:
                return transcription_response(event.transcript, response_format, temperature)
        raise ServeError("no transcript came back")


def _without_unanswered(document: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI ``document`` without FastAPI's 422 responses: an invalid body is answered 400 (OpenAI's)."""
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    return document


async def _generate(service: Service, generation: Any, stream: bool, chat: bool) -> Any:
    events = service.events(generation)
    first = await anext(events)  # errors before the first token (queue full, a dead rank) are still a status
    if stream:
        return StreamingResponse(_sse(service, events, first, chat), media_type="text/event-stream")
    text, event = "", first
    while not isinstance(event, Finished):
        text += event.text
        event = await anext(events)
    respond = chat_response if chat else completion_response
    return respond(_id(chat), service.name, text, event.reason or "stop", event.prompt_tokens, event.completion_tokens)


async def _sse(service: Service, events: AsyncGenerator, first: Delta | Finished, chat: bool) -> AsyncIterator[str]:
    """Server-sent events, one per event; the generator closed (a client gone) cancels the request."""
    request_id = _id(chat)

    def chunk(text: str | None, reason: str | None) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
            body = chat_chunk(request_id, service.name, delta, reason)
        else:
            body = completion_chunk(request_id, service.name, text or "", reason)
        return f"data: {json.dumps(body)}\n\n"

    try:
        if chat:
            yield chunk(None, None)
        event = first
        while True:
            if isinstance(event, Finished):
                yield chunk("", event.reason)
                break
            yield chunk(event.text, None)
            event = await anext(events)
    except ServeError as error:
        yield f"data: {json.dumps({'error': {'message': str(error), 'type': error.kind, 'code': error.status}})}\n\n"
    finally:
        await events.aclose()
    yield "data: [DONE]\n\n"


_counter = iter(range(1, 1 << 62))


def _id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{next(_counter)}"


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServeError)
    async def serve_error(request: Request, error: ServeError) -> JSONResponse:
        return error_body(error.status, str(error), error.kind, error.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in problems[:5])
        return error_body(400, message or "invalid request", "invalid_request_error", where or None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return error_body(error.status_code, str(error.detail), "invalid_request_error", headers=error.headers)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` (``max_upload_bytes`` for an audio upload), declared or as
    it arrives, is answered 413."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_upload_bytes: int = 25 << 20):
        self.app, self.max_bytes, self.max_upload_bytes = app, max_bytes, max_upload_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_upload_bytes if scope.get("path") in UPLOADS else self.max_bytes
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send, limit)
            return
        received = 0

        async def counting() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise TooLarge(f"the request body is over {limit} bytes")
            return message

        await self.app(scope, counting, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        response = error_body(413, f"the request body is over {limit} bytes", "invalid_request_error")
        await response(scope, receive, send)


#: the routes that take file uploads (a larger body limit: OpenAI's 25 MiB)
UPLOADS = ("/v1/audio/transcriptions",)
