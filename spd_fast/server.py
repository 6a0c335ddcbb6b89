"""`spd-fast serve`: an OpenAI-compatible HTTP server over one engine, on the standard library alone.

    POST /v1/completions        {"prompt": str | [token ids], "max_tokens", "temperature", "top_p", "top_k",
                                 "seed", "stop", "stream"}
    POST /v1/chat/completions   {"messages": [{"role", "content"}], ...the same settings}
    GET  /v1/models, GET /health

SPD is a single-sequence latency method: one request decodes at a time and the others wait for the
lock (no batching). With "stream": true the verified text goes out as server-sent events as it is
committed, then `data: [DONE]`. Responses carry the usual `usage` and, beside it, `spd`: the decode's
metrics (acceptance_rate, tokens_per_cycle, ...). Bad requests get HTTP 400 with an OpenAI-style
`{"error": {"message", "type", "param", "code"}}` whose message names the problem and the fix.

Defaults follow the OpenAI API: temperature 1.0, top_p 1.0, max_tokens 16 for /v1/completions and the
room left in the KV cache for chat; top_k -1 is off, as in vLLM. `n` > 1, `logprobs`, `best_of`, penalties,
`logit_bias` and the other endpoint's prompt field are refused by name rather than ignored.
"""
from __future__ import annotations

import errno
import json
import select
import socket
import sys
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

from .config import SpdConfigError

# request fields this server refuses by name unless they hold a value that asks for nothing (silently ignoring
# them would return something else than asked)
_UNSUPPORTED: dict[str, tuple] = {
    "n": (1,), "best_of": (1,), "logprobs": (False, 0), "top_logprobs": (0,), "echo": (False,), "suffix": ("",),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "tools": ([],), "response_format": ({"type": "text"},), "min_tokens": (0,), "ignore_eos": (False,)}


def _asks_nothing(v: Any, neutral: tuple) -> bool:
    """Whether a value of a field in _UNSUPPORTED asks for nothing: a number by its value (a client may send
    `presence_penalty: 0.0`), but a bool only as a bool (True is not the 1 of `n`)."""
    def same(x: Any) -> bool:
        if isinstance(v, bool) or isinstance(x, bool):
            return type(v) is type(x) and v == x
        if isinstance(v, (int, float)) and isinstance(x, (int, float)):
            return v == x
        return type(v) is type(x) and v == x
    return any(same(x) for x in neutral)


MAX_BODY = 8 << 20  # bytes of one request body (a longer one is refused with 413 before it is read)
# stop strings of one request: each committed token is checked against every one, over a window as long as the
# longest, while the engine is held (OpenAI takes 4)
MAX_STOPS, MAX_STOP_CHARS = 16, 256
_KNOWN = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stream", "stream_options", "user"} | set(_UNSUPPORTED)
_OTHER_ENDPOINT = {True: "prompt", False: "messages"}  # chat -> the field of /v1/completions it must not take
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # ours -> OpenAI's


def _api_words(message: str) -> str:
    """The engine's messages speak the Python API; a client of this server sends max_tokens, and the operator
    starts it with --max-len."""
    return (message.replace("max_new_tokens", "max_tokens")
            .replace("load with a larger max_len", "restart the server with a larger --max-len"))


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class ServerStopping(Exception):
    """The server was asked to stop (Ctrl-C) while this request decoded: it ends at its next piece."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down; send the request again once it is back")


def _too_big(size: int) -> RequestError:
    return RequestError(413, f"the request body has {size} bytes, more than this server takes ({MAX_BODY}); send a "
                             "shorter prompt")


_ENGINE_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")


def _param_of(message: str, body: Any) -> str | None:
    """The request field an engine error is about (its messages start with the field's name), as the client
    spelled it."""
    for key in _ENGINE_PARAMS:
        if message.startswith(key):
            if key == "max_tokens" and isinstance(body, dict) and body.get("max_completion_tokens") is not None:
                return "max_completion_tokens"
            return key
    if message.startswith(("prompt", "the prompt", "the content of")):  # the endpoint's prompt field
        return "messages" if isinstance(body, dict) and "messages" in body else "prompt"
    return None


def _number(body: dict, key: str, default: Any, kind: type) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and isinstance(v, float)):
        raise RequestError(400, f"{key} must be {'an integer' if kind is int else 'a number'}, got {v!r}", key)
    try:
        return kind(v)
    except OverflowError:  # an integer too large for a float
        raise RequestError(400, f"{key} is out of range, got a {len(str(abs(v)))}-digit number", key) from None


def _chat_prompt(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, f"messages[{i}] must be an object with a string \"role\"", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(400, f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": "
                                   "...}) are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": m["role"], "content": content})
    return out


class SpdServer:
    """The request logic, apart from HTTP (tests call `complete` directly too)."""

    def __init__(self, engine: Any, model_name: str, method: str = "spd"):
        self.engine, self.model_name, self.method = engine, model_name, method
        self.lock = threading.Lock()  # one sequence at a time: the engine has one KV cache
        self.created = int(time.time())
        self.stopping = threading.Event()  # set by stop(): the decode in flight ends at its next piece

    def stop(self, timeout: float) -> bool:
        """Ask the decode in flight (if any) to end, and wait up to `timeout` s for it to let go of the engine;
        False if it did not (a process must not exit while a request thread is inside torch)."""
        self.stopping.set()
        if self.lock.acquire(timeout=timeout):
            self.lock.release()
            return True
        return False

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "spd_fast"}]}

    def _settings(self, body: dict, chat: bool) -> tuple[Any, dict]:
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        known = _KNOWN - {_OTHER_ENDPOINT[chat]}
        unknown = sorted(set(body) - known)
        if unknown:
            raise RequestError(400, f"unknown field(s) {', '.join(unknown)} for /v1/{'chat/' if chat else ''}"
                                    f"completions; it takes {', '.join(sorted(known - set(_UNSUPPORTED)))}",
                               unknown[0])
        for key, neutral in _UNSUPPORTED.items():
            v = body.get(key)
            if v is not None and not _asks_nothing(v, neutral):
                raise RequestError(400, f"{key}={v!r} is not supported by spd_fast (one sequence, no "
                                        f"penalties or log-probabilities); leave {key} out", key)
        if body.get("stream") is not None and not isinstance(body["stream"], bool):
            raise RequestError(400, f"stream must be true or false, got {body['stream']!r}", "stream")
        if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
            raise RequestError(400, "stream_options must be an object like {\"include_usage\": true}, got "
                                    f"{body['stream_options']!r}", "stream_options")
        if body.get("stream_options") is not None and body.get("stream") is not True:
            raise RequestError(400, "stream_options is only allowed with \"stream\": true", "stream_options")
        extra = sorted(set(body.get("stream_options") or {}) - {"include_usage"})
        if extra:
            raise RequestError(400, f"stream_options.{extra[0]} is not supported; this server takes "
                                    "stream_options.include_usage", "stream_options")
        usage = (body.get("stream_options") or {}).get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise RequestError(400, f"stream_options.include_usage must be true or false, got {usage!r}",
                               "stream_options")
        if body.get("model") is not None and not isinstance(body["model"], str):
            raise RequestError(400, f"model must be a string, the served model's name ({self.model_name!r}), got "
                                    f"{body['model']!r}", "model")
        if body.get("model") not in (None, self.model_name):
            raise RequestError(404, f"the model {body['model']!r} does not exist; this server serves "
                                    f"{self.model_name!r} (GET /v1/models)", "model")
        if chat:
            prompt: Any = _chat_prompt(body.get("messages"))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
                if len(prompt) > 1:  # several prompts (strings or token-id lists)
                    raise RequestError(400, "one prompt per request: this server decodes a single sequence; send "
                                            "the prompts as separate requests", "prompt")
                prompt = prompt[0]
            if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
                raise RequestError(400, "prompt must be a string or a list of token ids (integers)", "prompt")
            if not prompt:
                raise RequestError(400, "the prompt is empty; send at least one character or token id", "prompt")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _number(body, key, None, int)
        stop = body.get("stop")
        if not (stop is None or isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str)
                                                                                         for x in stop))):
            raise RequestError(400, f"stop must be a string or a list of strings, got {stop!r}", "stop")
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise RequestError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}; send fewer", "stop")
        if any(len(x) > MAX_STOP_CHARS for x in stops):
            raise RequestError(400, f"a stop string may have at most {MAX_STOP_CHARS} characters, got one of "
                                    f"{max(map(len, stops))}; send a shorter one", "stop")
        top_k = _number(body, "top_k", 0, int)
        kw = dict(temperature=_number(body, "temperature", 1.0, float), top_p=_number(body, "top_p", 1.0, float),
                  top_k=0 if top_k == -1 else top_k,  # -1: vLLM's and SGLang's "no top-k", our 0
                  seed=_number(body, "seed", None, int), stop=stops or None, method=self.method)
        # tokenized here, outside the lock: a long prompt does not hold up the request that is decoding
        ids = self.engine.target.encode(prompt)
        if max_tokens is None:  # chat: what is left of the KV cache and the context after the prompt
            room = self.engine.room(len(ids), self.method)
            if chat and room < 1:
                raise RequestError(400, f"the prompt ({len(ids)} tokens) leaves no room for an answer in the KV cache "
                                        f"and the model's context; shorten the messages, or restart the server with "
                                        f"a larger --max-len", "messages")
            max_tokens = room if chat else 16
        kw["max_new_tokens"] = max_tokens
        return ids, kw

    def _usage(self, ids: list[int], completion_tokens: int, metrics: dict) -> dict:
        p = len(ids)
        spd = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        return {"usage": {"prompt_tokens": p, "completion_tokens": completion_tokens,
                          "total_tokens": p + completion_tokens}, "spd": spd}

    def complete(self, body: dict, chat: bool, gone: Callable[[], bool] | None = None) -> dict:
        """The whole answer. `gone` (asked after every verified piece) says the client has hung up: the decode then
        stops and frees the engine, as a streamed request's does, and ClientGone is raised."""
        ids, kw = self._settings(body, chat)
        eng = self.engine
        with self.lock:
            if gone is not None and gone():  # it gave up while waiting for the engine: no decode for nobody
                raise ClientGone
            chunks = eng.stream(ids, **kw)  # the same decode and text as generate(), piece by piece
            try:
                parts = []
                for piece in chunks:
                    parts.append(piece)
                    if gone is not None and gone():
                        raise ClientGone
                    if self.stopping.is_set():
                        raise ServerStopping
            finally:
                chunks.close()
            text, token_ids, metrics = "".join(parts), list(eng.last_token_ids), eng.last_metrics
            reason = _FINISH[eng.last_finish_reason]
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": reason}
                  if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": reason})
        return {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice], **self._usage(ids, len(token_ids), metrics)}

    def stream(self, body: dict, chat: bool, gone: Callable[[], bool] | None = None) -> "EventStream":
        """Checks the request before the first event (errors are plain 400 replies), then holds the engine until
        the returned stream is exhausted or closed. `gone`: asked once the engine is ours (a client that gave up
        while it waited gets no decode: ClientGone)."""
        ids, kw = self._settings(body, chat)
        opts = body.get("stream_options") or {}
        self.lock.acquire()
        try:
            if gone is not None and gone():
                raise ClientGone
            chunks = self.engine.stream(ids, **kw)
        except BaseException:
            self.lock.release()
            raise
        usage = bool(opts.get("include_usage"))
        return EventStream(self._events(ids, chunks, chat, usage), chunks, self.lock)

    def _events(self, ids: list[int], chunks: Iterator[str], chat: bool, usage: bool) -> Iterator[dict]:
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}

        def event(delta: str | None, reason: str | None = None, role: bool = False) -> dict:
            if chat:
                d: dict = {"role": "assistant"} if role else {}
                if delta is not None:
                    d["content"] = delta
                return {**head, "choices": [{"index": 0, "delta": d, "finish_reason": reason}]}
            return {**head, "choices": [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}]}
        if chat:
            yield event(None, role=True)
        for piece in chunks:
            yield event(piece)
            if self.stopping.is_set():
                raise ServerStopping
        eng = self.engine
        yield event(None if chat else "", _FINISH[eng.last_finish_reason])
        if usage:
            yield {**head, "choices": [], **self._usage(ids, len(eng.last_token_ids), eng.last_metrics)}


class EngineFailure(Exception):
    """The engine raised something other than a request's own error (a bug, a C++ build lock held too long). It
    wraps the engine's exception because socket.timeout is TimeoutError: the server must not take an engine's
    TimeoutError (or ConnectionError) for a client that stalled or left, and answer nothing."""


def _engine_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except (RequestError, SpdConfigError, ClientGone, ServerStopping):
        raise
    except Exception as e:
        raise EngineFailure(f"{type(e).__name__}: {e}") from e


class ClientGone(Exception):
    """The client of a non-streamed request closed its connection before the answer was ready."""


def client_gone(sock: socket.socket) -> bool:
    """True when the peer has closed the connection: the socket reads as ready and a peek finds the end of the
    stream (bytes waiting, e.g. a pipelined next request, mean the client is still there)."""
    try:
        if hasattr(select, "poll"):  # select.select refuses descriptors >= 1024 (FD_SETSIZE), which a busy server reaches
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            ready = bool(poller.poll(0))
        else:
            ready = bool(select.select([sock], [], [], 0)[0])
        return ready and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):  # reset, or already closed
        return True


class EventStream:
    """The chunks of one streamed request; close() (always called, also when the client left before the first
    event) ends the decode and frees the engine for the next request."""

    def __init__(self, events: Iterator[dict], chunks: Iterator[str], lock: threading.Lock):
        self.events, self.chunks, self.lock, self.closed = events, chunks, lock, False

    def __iter__(self) -> Iterator[dict]:
        return self.events

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.events.close()
                self.chunks.close()
            finally:
                self.lock.release()


_POST_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat


def _is_get_route(path: str) -> bool:
    return path in ("/health", "/v1/models") or path.startswith("/v1/models/")


def _handler(server: SpdServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 120  # seconds a client may leave a request half sent (a short body, a stalled upload)

        def log_message(self, fmt: str, *args: Any) -> None:  # one line per request on stderr, as http.server does
            if not getattr(self.server, "quiet", False):
                super().log_message(fmt, *args)

        def _send(self, status: int, obj: dict, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _event(self, obj: dict) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        def _error(self, status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> None:
            kind = "invalid_request_error" if status < 500 else "server_error"
            self._send(status, {"error": {"message": message, "type": kind, "param": param, "code": status}},
                       headers)

        def _body(self) -> bytes:
            """The whole request body, read before anything is answered, so the connection stays usable for the
            next request; a body that cannot be read whole closes the connection after the error."""
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                self.close_connection = True
                raise RequestError(411, "chunked request bodies are not supported; send a Content-Length")
            text = self.headers.get("Content-Length")
            try:
                size = int(text) if text is not None else 0
                if size < 0:
                    raise ValueError
            except ValueError:
                self.close_connection = True
                raise RequestError(400, f"Content-Length must be a number of bytes >= 0, got {text!r}") from None
            if size > MAX_BODY:
                self.close_connection = True
                raise _too_big(size)
            data = self.rfile.read(size) if size else b""
            if len(data) < size:  # the client closed the connection before it sent the body it announced
                self.close_connection = True
                raise ClientGone
            return data

        def handle_expect_100(self) -> bool:
            """A body over MAX_BODY announced with `Expect: 100-continue` is refused before the client sends it
            (a client that sends it unasked meets a closed connection, the 413 already written)."""
            try:
                size = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                size = 0
            if size > MAX_BODY:
                self.close_connection = True
                self._error(413, str(_too_big(size)))
                return False
            return super().handle_expect_100()

        def _route(self) -> str:
            # percent-decoded: clients quote a model name with "/" or spaces in GET /v1/models/{name}
            return urllib.parse.unquote(self.path.split("?", 1)[0]).rstrip("/") or "/"

        def do_GET(self) -> None:
            try:
                self._body()
            except RequestError as e:
                self._error(e.status, str(e))
                return
            path = self._route()
            if path == "/v1/models":
                self._send(200, server.models())
            elif path.startswith("/v1/models/"):
                name = path[len("/v1/models/"):]
                if name == server.model_name:
                    self._send(200, server.models()["data"][0])
                else:
                    self._error(404, f"the model {name!r} does not exist; this server serves {server.model_name!r}",
                                "model")
            elif path == "/health":
                self._send(200, {"status": "ok"})
            elif path in _POST_ROUTES:
                self._wrong_method(path)
            else:
                self._error(404, f"no route GET {path}; try GET /v1/models or POST /v1/chat/completions")

        def _wrong_method(self, path: str) -> None:
            allow = "POST" if path in _POST_ROUTES else "GET, HEAD"
            self._error(405, f"{path} takes {allow}, not {self.command}", headers={"Allow": allow})

        def _not_allowed(self) -> None:
            try:
                self._body()
            except RequestError:
                pass
            path = self._route()
            if path in _POST_ROUTES or _is_get_route(path):
                self._wrong_method(path)
                return
            self._error(405, f"method {self.command} is not supported; use GET /v1/models or POST "
                             "/v1/completions, /v1/chat/completions", headers={"Allow": "GET, HEAD, POST"})

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

        def do_HEAD(self) -> None:
            try:
                self._body()  # read (and drop) any body, so the next request on this connection starts clean
            except RequestError:
                self.close_connection = True
            path = self._route()
            ok = path in ("/health", "/v1/models", f"/v1/models/{server.model_name}")
            self.send_response(200 if ok else 405 if path in _POST_ROUTES else 404)
            if path in _POST_ROUTES:
                self.send_header("Allow", "POST")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:
            routes = _POST_ROUTES
            body: Any = None
            try:
                raw = self._body()
                path = self._route()
                if _is_get_route(path):
                    self._wrong_method(path)
                    return
                if path not in routes:
                    raise RequestError(404, f"no route POST {path}; use /v1/completions or /v1/chat/completions")
                try:
                    body = json.loads(raw or b"null")
                # ValueError also covers JSONDecodeError, UnicodeDecodeError and an integer past Python's digit limit
                except (ValueError, RecursionError) as e:
                    reason = ("nested too deeply" if isinstance(e, RecursionError) else str(e)
                              if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)) else
                              "a number with more digits than Python reads")
                    raise RequestError(400, f"the request body is not valid JSON ({reason}); send a JSON object") \
                        from None
                chat = routes[path]
                if isinstance(body, dict) and body.get("stream") is True:
                    events = _engine_call(server.stream, body, chat, gone=lambda: client_gone(self.connection))
                    try:
                        self.send_response(200)
                        self.send_header("Content-Type", "text/event-stream")
                        self.send_header("Cache-Control", "no-cache")
                        self.send_header("Connection", "close")
                        self.end_headers()
                        self.close_connection = True
                        it = iter(events)
                        while True:
                            try:
                                ev = next(it)
                            except StopIteration:
                                break
                            except Exception as e:  # headers are out: the error goes as an event, as OpenAI's does
                                status = 400 if isinstance(e, SpdConfigError) else 500
                                message = _api_words(str(e)) if status == 400 else f"{type(e).__name__}: {e}"
                                self._event({"error": {"message": message, "type": "server_error" if status == 500
                                                       else "invalid_request_error",
                                                       "param": _param_of(message, body) if status == 400 else None,
                                                       "code": status}})
                                break
                            self._event(ev)  # a client that left or stalled raises here, to the handlers below
                        self.wfile.write(b"data: [DONE]\n\n")
                        self.wfile.flush()
                    finally:
                        events.close()  # a client that left releases the engine at its next chunk
                    return
                self._send(200, _engine_call(server.complete, body, chat,
                                             gone=lambda: client_gone(self.connection)))
            except RequestError as e:
                self._error(e.status, _api_words(str(e)), e.param)
            except SpdConfigError as e:  # the engine's own checks (temperature, prompt length, stop strings, ...)
                message = _api_words(str(e))
                self._error(400, message, _param_of(message, body))
            except ServerStopping as e:
                self._error(503, str(e))
            except EngineFailure as e:  # before the socket errors: an engine's TimeoutError is not a stalled client
                self._error(500, str(e))
            except (ConnectionError, socket.timeout, ClientGone):  # the client left or stalled (its body, or our reply)
                self.close_connection = True
            except Exception as e:  # a bug: say so instead of dropping the connection
                self._error(500, f"{type(e).__name__}: {e}")

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that left before its answer (or its own body) was through is not a server error: no traceback
        for it; anything else is reported as socketserver does."""
        if isinstance(sys.exc_info()[1], (ConnectionError, ClientGone)):  # ConnectionError: reset, broken, aborted
            return
        super().handle_error(request, client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


def make_server(engine: Any, model_name: str, host: str = "127.0.0.1", port: int = 8000, method: str = "spd",
                quiet: bool = False) -> ThreadingHTTPServer:
    """A ThreadingHTTPServer bound to (host, port) (port 0 picks a free one: `server_address[1]`; an IPv6 host
    such as "::" binds IPv6); call serve_forever()."""
    cls = _Server6 if ":" in host else _Server
    spd = SpdServer(engine, model_name, method)
    httpd = cls((host, port), _handler(spd))
    httpd.quiet = quiet  # type: ignore[attr-defined]
    httpd.spd = spd  # type: ignore[attr-defined]  # its engine lock: held while a request decodes
    return httpd


def bind_hint(e: OSError) -> str:
    """The fix for a failed bind: another port when this one is taken, else another --host."""
    if e.errno == errno.EADDRINUSE:
        return "pick another --port, or stop the process using it"
    return "check --host (an address of this machine, e.g. 127.0.0.1, 0.0.0.0 or ::)"
