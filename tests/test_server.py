"""The OpenAI-compatible server: its answers equal the engine's, streamed or not; bad requests get a 400 that names
the problem; one request decodes at a time; a client that leaves mid-stream frees the engine."""
from __future__ import annotations

import http.client
import json
import re
import threading

import pytest

from spd_fast.server import make_server

CHAT = [{"role": "user", "content": "Name three primary colours."}]


@pytest.fixture(scope="module")
def served(default_target):
    from spd_fast.api import Engine, shipped_head
    from spd_fast.pdm import load_draft

    tg = default_target
    head = load_draft(shipped_head(tg, 3), tg.model, tg.fingerprint, 3)
    eng = Engine(tg, head, head.dcfg.boundaries, 1024, "shipped")
    httpd = make_server(eng, "smollm2", port=0, quiet=True)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield eng, httpd.server_address[1], httpd
    httpd.shutdown()
    httpd.server_close()


def request(port: int, method: str, path: str, body=None, raw: bytes | None = None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    c.request(method, path, body=data, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    return r.status, r.getheader("Content-Type"), text


def events(text: str) -> list:
    out = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert out[-1] == "[DONE]"
    return [json.loads(x) for x in out[:-1]]


def test_completions_and_chat_equal_the_engine(served):
    eng, port, _ = served
    want = eng.generate("The capital of France is", 12, temperature=0.0)
    status, ctype, text = request(port, "POST", "/v1/completions",
                                  {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 12,
                                   "temperature": 0})
    r = json.loads(text)
    assert status == 200 and ctype == "application/json", text
    assert r["object"] == "text_completion" and r["model"] == "smollm2" and r["id"].startswith("cmpl-")
    assert r["choices"][0]["text"] == want.text and r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == len(want.token_ids) == 12
    assert r["usage"]["prompt_tokens"] == want.prompt_tokens
    assert r["usage"]["total_tokens"] == 12 + want.prompt_tokens
    assert 0.0 <= r["spd"]["acceptance_rate"] <= 1.0 and r["spd"]["verifications"] > 0
    want = eng.generate(CHAT, 40, temperature=0.7, seed=5, stop=["blue"])
    status, _, text = request(port, "POST", "/v1/chat/completions",
                              {"messages": CHAT, "max_tokens": 40, "temperature": 0.7, "seed": 5, "stop": "blue"})
    r = json.loads(text)
    assert status == 200 and r["object"] == "chat.completion"
    assert r["choices"][0]["message"] == {"role": "assistant", "content": want.text}
    assert r["choices"][0]["finish_reason"] == ("length" if want.finish_reason == "length" else "stop")
    # text parts, and the chat default max_tokens (the room left in the cache) ends at the model's end of turn
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three primary "},
                                          {"type": "text", "text": "colours."}]}]
    status, _, text = request(port, "POST", "/v1/chat/completions", {"messages": parts, "temperature": 0})
    r = json.loads(text)
    assert status == 200 and r["choices"][0]["message"]["content"] == eng.generate(CHAT, 400).text
    assert r["choices"][0]["finish_reason"] == "stop"


def test_streamed_answers_equal_the_whole_answer(served):
    eng, port, _ = served
    want = eng.generate(CHAT, 24, temperature=0.0)
    status, ctype, text = request(port, "POST", "/v1/chat/completions",
                                  {"messages": CHAT, "max_tokens": 24, "temperature": 0, "stream": True,
                                   "stream_options": {"include_usage": True}})
    evs = events(text)
    assert status == 200 and ctype == "text/event-stream"
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all(e["object"] == "chat.completion.chunk" for e in evs)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in evs if e["choices"]) == want.text
    assert evs[-2]["choices"][0]["finish_reason"] == "length"
    assert evs[-1]["choices"] == [] and evs[-1]["usage"]["completion_tokens"] == 24
    status, _, text = request(port, "POST", "/v1/completions",
                              {"prompt": [1, 2, 3, 4], "max_tokens": 6, "temperature": 0, "stream": True})
    evs = events(text)
    assert "".join(e["choices"][0]["text"] for e in evs) == eng.generate([1, 2, 3, 4], 6).text
    assert evs[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body, status, message", [
    ({"prompt": "hi", "n": 2}, 400, r"n=2 is not supported by spd_fast .* leave n out"),
    ({"prompt": "hi", "logprobs": 3}, 400, "logprobs=3 is not supported"),
    ({"prompt": "hi", "frequency_penalty": 0.5}, 400, "frequency_penalty=0.5 is not supported"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature must be a number, got 'hot'"),
    ({"prompt": "hi", "temperature": -1}, 400, r"temperature must be a finite number >= 0"),
    ({"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens must be an integer, got 1.5"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "^max_tokens must be an integer >= 1, got 0"),
    ({"prompt": "hi", "max_tokens": 9000}, 400, r"\+ max_tokens \(9000\).* exceeds the KV cache length 1024; .*"
                                                 r"restart the server with a larger --max-len"),
    ({"prompt": [[1, 2], [3]]}, 400, "one prompt per request"),
    ({"prompt": [{"role": "user", "content": "hi"}]}, 400, r"prompt must be a string or a list of token ids"),
    ({"prompt": ""}, 400, "the prompt is empty"),
    ({"prompt": "hi", "stream": "false"}, 400, "stream must be true or false, got 'false'"),
    ({"prompt": "hi", "stop": 0}, 400, "stop must be a string or a list of strings, got 0"),
    ({"prompt": "hi", "tools": [{"type": "function"}]}, 400, "tools=.* is not supported"),
    ({"prompt": ["a", "b"]}, 400, "one prompt per request"),
    ({"prompt": 5}, 400, "prompt must be a string or a list of token ids"),
    ({"prompt": [1, 99999]}, 400, "prompt token 99999 at position 1 is not a token id of this model"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, r"the model 'gpt-4' does not exist; this server serves 'smollm2'"),
    ({"prompt": "hi", "temprature": 0}, 400, r"unknown field\(s\) temprature for /v1/completions; it takes"),
    # the other endpoint's prompt field was silently dropped
    ({"prompt": "hi", "messages": CHAT}, 400, r"unknown field\(s\) messages for /v1/completions; it takes"),
    ({"prompt": "hi", "stream": False, "stream_options": {"include_usage": True}}, 400,
     r"^stream_options is only allowed with \"stream\": true$"),
    ({"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     r"^stream_options.continuous_usage_stats is not supported"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop must be a non-empty string or a list of non-empty strings"),
    ({"prompt": "hi", "stream_options": "usage"}, 400, "stream_options must be an object"),
    ({"prompt": "hi", "stop": ["a"] * 17}, 400, "^stop takes at most 16 strings, got 17; send fewer$"),
    ({"prompt": "hi", "stop": "a" * 257}, 400, "^a stop string may have at most 256 characters, got one of 257; "),
    ({"prompt": "hi", "temperature": 10 ** 400}, 400, "^temperature is out of range, got a 401-digit number$"),
    ({"prompt": "hi", "top_p": -10 ** 400}, 400, "^top_p is out of range, got a 401-digit number$"),
])
def test_bad_requests_name_the_problem(served, body, status, message):
    import re

    _, port, _ = served
    got, _, text = request(port, "POST", "/v1/completions", body)
    err = json.loads(text)["error"]
    assert got == status and err["code"] == status and re.search(message, err["message"]), (got, text)
    assert err["type"] == "invalid_request_error"
    if "stream" not in body:  # the same request streamed is refused before the stream starts
        got, _, text = request(port, "POST", "/v1/completions", {**body, "stream": True})
        assert got == status and re.search(message, json.loads(text)["error"]["message"])


def test_engine_errors_name_their_field_and_vllm_top_k_minus_one(served):
    """The engine's own refusals came back with "param": null, and named max_tokens to a client that had sent
    max_completion_tokens; top_k -1 (vLLM's and SGLang's "off") was refused; chat choices lacked "logprobs"."""
    eng, port, _ = served
    for body, param in (({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "hi", "max_completion_tokens": 0}, "max_completion_tokens"),
                        ({"prompt": "hi", "temperature": -1}, "temperature"),
                        ({"prompt": "hi", "top_p": 0}, "top_p"), ({"prompt": "hi", "stop": [""]}, "stop")):
        status, _, text = request(port, "POST", "/v1/completions", body)
        assert status == 400 and json.loads(text)["error"]["param"] == param, (body, text)
    # the prompt's own refusals name the endpoint's prompt field (they had "param": null)
    for route, body, param in (("/v1/completions", {"prompt": [99999999], "max_tokens": 2}, "prompt"),
                               ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}],
                                                         "max_tokens": 2}, "messages")):
        status, _, text = request(port, "POST", route, body)
        assert status == 400 and json.loads(text)["error"]["param"] == param, (body, text)
    got = [json.loads(request(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 5, "temperature": 0.8,
                                                               "seed": 4, "top_k": k})[2]) for k in (-1, 0)]
    assert got[0]["choices"][0]["text"] == got[1]["choices"][0]["text"]
    status, _, text = request(port, "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})
    assert status == 200 and json.loads(text)["choices"][0]["logprobs"] is None


def test_routes_and_malformed_bodies(served):
    _, port, _ = served
    status, _, text = request(port, "GET", "/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["id"] == "smollm2"
    assert request(port, "GET", "/health")[0] == 200
    status, _, text = request(port, "POST", "/v1/embeddings", {"input": "x"})
    assert status == 404 and "use /v1/completions or /v1/chat/completions" in json.loads(text)["error"]["message"]
    status, _, text = request(port, "POST", "/v1/completions", raw=b"{not json")
    assert status == 400 and "the request body is not valid JSON" in json.loads(text)["error"]["message"]
    status, _, text = request(port, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]})
    assert status == 400 and "messages[0].content must be a string" in json.loads(text)["error"]["message"]
    status, _, text = request(port, "POST", "/v1/chat/completions", {"messages": []})
    assert status == 400 and "messages must be a non-empty list" in json.loads(text)["error"]["message"]
    status, _, text = request(port, "POST", "/v1/completions", raw=b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}")
    assert status == 400 and json.loads(text)["error"]["message"] == (
        "the request body is not valid JSON (a number with more digits than Python reads); send a JSON object")
    # a chat request without max_tokens gets the room left after its prompt; a prompt that leaves none is refused
    # with the fix that applies (not "lower max_tokens", which the client never sent)
    long = {"messages": [{"role": "user", "content": "word " * 1100}]}
    status, _, text = request(port, "POST", "/v1/chat/completions", long)
    msg = json.loads(text)["error"]["message"]
    assert status == 400 and re.fullmatch(r"the prompt \(\d+ tokens\) leaves no room for an answer in the KV cache "
                                          r"and the model's context; shorten the messages, or restart the server "
                                          r"with a larger --max-len", msg), msg
    assert json.loads(text)["error"]["param"] == "messages"


def test_one_request_at_a_time_and_a_client_leaving_mid_stream_frees_the_engine(served):
    eng, port, _ = served
    want = eng.generate(CHAT, 16, temperature=0.0).text
    results = []

    def ask():
        results.append(json.loads(request(port, "POST", "/v1/chat/completions",
                                          {"messages": CHAT, "max_tokens": 16, "temperature": 0})[2]))
    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [r["choices"][0]["message"]["content"] for r in results] == [want] * 3
    # a streaming client that reads one event and hangs up
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/chat/completions", body=json.dumps({"messages": CHAT, "max_tokens": 200,
                                                                "temperature": 0, "stream": True}))
    r = c.getresponse()
    assert r.fp.readline().startswith(b"data: ")
    c.close()
    status, _, text = request(port, "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 16,
                                                                     "temperature": 0})
    assert status == 200 and json.loads(text)["choices"][0]["message"]["content"] == want


def test_serve_command(tmp_path):
    """`spd-fast serve` loads the model, says where it listens, answers, and stops on Ctrl-C; a taken port is one
    line before any model loads."""
    import os
    import re
    import signal
    import socket
    import subprocess
    import sys
    import time

    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "spd_fast", "serve", "--port", "0", "--threads", "1", "--quiet"],
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        deadline = time.time() + 300
        while "serving" not in line and time.time() < deadline and p.poll() is None:
            line = p.stderr.readline()
        m = re.search(r"serving 'SmolLM2-135M-Instruct' \(method spd, n=3, draft shipped:smollm2-135m-instruct-n3\) "
                      r"on http://127\.0\.0\.1:(\d+)/v1", line)
        assert m, line
        status, _, text = request(int(m.group(1)), "POST", "/v1/chat/completions",
                                  {"messages": CHAT, "max_tokens": 4, "temperature": 0})
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 4
        # Ctrl-C while a stream decodes: it ends with an error event, and the process exits 130 (it aborted with
        # SIGABRT, "terminate called without an active exception", a request thread still inside torch)
        c = http.client.HTTPConnection("127.0.0.1", int(m.group(1)), timeout=120)
        c.request("POST", "/v1/chat/completions", body=json.dumps({"messages": CHAT, "max_tokens": 1000,
                                                                    "temperature": 0, "stream": True}))
        r = c.getresponse()
        assert r.fp.readline().startswith(b"data: ")
    finally:
        p.send_signal(signal.SIGINT)
        rc = p.wait(60)
    tail = r.read().decode()
    c.close()
    err = p.stderr.read()
    assert rc == 130 and "spd-fast: interrupted" in err and "terminate called" not in err, (rc, err[-2000:])
    assert "the server is shutting down" in tail, tail[-500:]
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        # a model path that does not exist: had the model loaded first, that would be the error
        r = subprocess.run([sys.executable, "-m", "spd_fast", "serve", "--port", str(port), "--model",
                            "/nonexistent/dir"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert re.fullmatch(rf"spd-fast: error: cannot listen on 127\.0\.0\.1:{port} \(.+\); pick another --port, or stop "
                        r"the process using it\n", r.stderr), r.stderr


def test_neutral_openai_values_token_id_batches_and_max_completion_tokens(served):
    eng, port, _ = served
    neutral = {"n": 1, "logprobs": False, "top_logprobs": 0, "tools": [], "response_format": {"type": "text"},
               "stream": False, "stream_options": None, "frequency_penalty": 0, "user": "u1"}
    status, _, text = request(port, "POST", "/v1/chat/completions",
                              {"messages": CHAT, "max_completion_tokens": None, "max_tokens": 3, "temperature": 0,
                               **neutral})
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3, text
    status, _, text = request(port, "POST", "/v1/completions", {"prompt": [[1, 2, 3]], "max_tokens": 4,
                                                                "temperature": 0, "suffix": "", "echo": False})
    assert status == 200 and json.loads(text)["choices"][0]["text"] == eng.generate([1, 2, 3], 4).text


def test_neutral_values_as_floats_are_taken_and_odd_types_refused(served):
    eng, port, _ = served
    floats = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0.0,
              "top_logprobs": 0.0, "n": 1.0, "best_of": 1.0, "logprobs": 0}
    status, _, text = request(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **floats})
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2, text
    for body, param, message in (
            ({"n": True}, "n", "n=True is not supported by spd_fast"),
            ({"presence_penalty": 0.5}, "presence_penalty", "presence_penalty=0.5 is not supported"),
            ({"stream": True, "stream_options": {"include_usage": "false"}}, "stream_options",
             "stream_options.include_usage must be true or false, got 'false'"),
            ({"model": ["smollm2"]}, "model", "model must be a string, the served model's name \\('smollm2'\\), "
                                              "got \\['smollm2'\\]")):
        status, _, text = request(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **body})
        err = json.loads(text)["error"]
        assert status == 400 and err["param"] == param and re.search(message, err["message"]), text


def test_a_client_gone_before_its_body_or_answer_is_not_a_server_error(served, capsys):
    import socket
    import sys

    from spd_fast.server import ClientGone, _Server

    _, port, _ = served
    # a body shorter than its Content-Length, then the end of the stream: no answer to a truncated request
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n" + b'{"prompt": 5}')
    s.shutdown(socket.SHUT_WR)
    assert s.recv(4096) == b""
    s.close()
    # no traceback for a client that left; other errors are reported as socketserver does
    srv = _Server.__new__(_Server)
    for exc in (BrokenPipeError(), ConnectionResetError(), ConnectionAbortedError(), ClientGone()):
        try:
            raise exc
        except Exception:
            srv.handle_error(None, ("127.0.0.1", 1))
    assert "Traceback" not in capsys.readouterr().err
    try:
        raise TimeoutError("boom")  # socket.timeout is TimeoutError: one from the engine is a real error
    except TimeoutError:
        old, sys.stderr = sys.stderr, __import__("io").StringIO()
        try:
            srv.handle_error(None, ("127.0.0.1", 1))
            printed = sys.stderr.getvalue()
        finally:
            sys.stderr = old
    assert "TimeoutError: boom" in printed


@pytest.mark.parametrize("exc", [TimeoutError("the C++ build lock is held"), ConnectionError("a peer rank left"),
                                 RuntimeError("boom")])
@pytest.mark.parametrize("when", ["at the call", "after a piece"])
def test_an_engine_failure_is_answered_not_taken_for_a_client_that_left(served, monkeypatch, exc, when):
    # socket.timeout is TimeoutError: an engine's TimeoutError (or ConnectionError) once closed the connection
    # without a word, as if the client had stalled or left
    eng, port, _ = served

    def failing(ids, **kw):
        if when == "at the call":
            raise exc

        def pieces():
            yield "Hello"
            raise exc
        return pieces()

    monkeypatch.setattr(eng, "stream", failing)
    want = f"{type(exc).__name__}: {exc}"
    status, ctype, text = request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4})
    err = json.loads(text)["error"]
    assert (status, ctype) == (500, "application/json") and err["message"] == want and err["code"] == 500, text
    status, _, text = request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True})
    if when == "at the call":  # before the headers: a plain 500 reply
        assert status == 500 and json.loads(text)["error"]["message"] == want, text
    else:  # the headers are out: the pieces so far, then the error as an event, then [DONE]
        evs = events(text)
        assert status == 200 and evs[0]["choices"][0]["text"] == "Hello", text
        assert evs[-1]["error"]["message"] == want and evs[-1]["error"]["code"] == 500, text
    monkeypatch.undo()  # the engine was freed: the next request decodes
    status, _, text = request(port, "POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3,
                                                          "temperature": 0})
    assert status == 200 and json.loads(text)["choices"][0]["text"] == eng.generate([1, 2, 3], 3).text


def test_bodies_routes_and_methods_keep_the_connection_usable(served):
    _, port, _ = served
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def ask(method, path, body=b"", headers=None):
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read().decode()
    # an answer that did not need the body still reads it: the next request on the connection works
    status, _ = ask("POST", "/v1/embeddings", json.dumps({"input": "x" * 1000}))
    assert status == 404
    status, text = ask("GET", "/nope", b"{}")
    assert status == 404 and "no route GET /nope" in text
    status, text = ask("POST", "/v1/completions?api-version=1", json.dumps({"prompt": "hi", "max_tokens": 2}))
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2
    status, text = ask("GET", "/v1/models/smollm2")
    assert status == 200 and json.loads(text)["id"] == "smollm2"
    status, text = ask("GET", "/v1/models/smoll%6D2")  # percent-encoded, as clients quote a name with "/"
    assert status == 200 and json.loads(text)["id"] == "smollm2"
    status, text = ask("GET", "/v1/models/other")
    assert status == 404 and "the model 'other' does not exist" in text
    # HEAD answers as GET would, without a body, and reads a body sent with it
    assert [ask("HEAD", p, b"{}")[0] for p in ("/v1/models/smollm2", "/v1/models/other", "/health")] == [200, 404, 200]
    status, text = ask("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1}))
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 1
    status, text = ask("OPTIONS", "/v1/completions")
    assert status == 405 and json.loads(text)["error"]["message"] == "/v1/completions takes POST, not OPTIONS"
    # a known route asked with another method is 405 with Allow (RFC 9110), not 404
    for method, path, allow in (("GET", "/v1/chat/completions", "POST"), ("POST", "/v1/models", "GET, HEAD"),
                                ("HEAD", "/v1/completions", "POST"), ("DELETE", "/health", "GET, HEAD"),
                                ("OPTIONS", "/nope", "GET, HEAD, POST")):
        c.request(method, path, body=b"")
        r = c.getresponse()
        r.read()
        assert (r.status, r.getheader("Allow")) == (405, allow), (method, path, r.status)
    status, text = ask("POST", "/v1/completions", "[" * 100000 + "]" * 100000)
    assert status == 400 and "not valid JSON (nested too deeply)" in text
    c.close()
    for headers, code, message in [({"Content-Length": "abc"}, 400, "Content-Length must be a number of bytes"),
                                   ({"Content-Length": str(64 << 20)}, 413, "more than this server takes"),
                                   ({"Transfer-Encoding": "chunked"}, 411, "chunked request bodies")]:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.putrequest("POST", "/v1/completions")
        for k, v in headers.items():
            c.putheader(k, v)
        c.endheaders()
        r = c.getresponse()
        assert r.status == code and message in r.read().decode()
        c.close()


def test_client_gone_reads_sockets_past_descriptor_1024():
    """select.select refuses descriptors >= 1024; a busy server's sockets get there, and a client still connected
    must not count as gone (its request would stop after the first piece)."""
    import os
    import resource
    import socket

    from spd_fast.server import client_gone

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    high = 1500
    if soft <= high:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    a, b = socket.socketpair()
    try:
        s = socket.socket(fileno=os.dup2(a.fileno(), high))
        assert s.fileno() == high
        assert not client_gone(s)           # connected, nothing sent
        b.sendall(b"x")
        assert not client_gone(s)           # bytes waiting: still there
        s.recv(1)
        b.close()
        assert client_gone(s)               # the peer closed
        s.close()
    finally:
        a.close()
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_bind_errors_name_the_right_fix():
    import errno

    from spd_fast.server import bind_hint

    assert bind_hint(OSError(errno.EADDRINUSE, "in use")).startswith("pick another --port")
    assert bind_hint(OSError(errno.EADDRNOTAVAIL, "not here")).startswith("check --host")


def test_a_client_leaving_before_a_whole_answer_stops_its_decode(served):
    """A non-streamed request whose client hangs up stops decoding at its next verified piece and frees the
    engine (as a streamed one does), instead of decoding all of max_tokens for nobody."""
    import socket
    import time

    eng = served[0]

    class Spy:  # the served engine, counting the pieces the server takes from its decodes
        def __init__(self):
            self.pieces = 0

        def __getattr__(self, name):
            return getattr(eng, name)

        def stream(self, *args, **kwargs):
            chunks = eng.stream(*args, **kwargs)

            def counted():
                try:
                    for piece in chunks:
                        self.pieces += 1
                        yield piece
                finally:
                    chunks.close()
            return counted()

    spy = Spy()
    httpd = make_server(spy, "smollm2", port=0, quiet=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    try:
        body = json.dumps({"prompt": "Count from 1 to 1000: 1, 2, 3,", "max_tokens": 400, "temperature": 0}).encode()
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.time() + 120
        while spy.pieces == 0 and time.time() < deadline:  # decoding has begun
            time.sleep(0.01)
        s.close()
        time.sleep(0.5)
        deadline = time.time() + 120
        while httpd.spd.lock.locked() and time.time() < deadline:
            time.sleep(0.05)
        assert not httpd.spd.lock.locked() and 0 < spy.pieces < 200, spy.pieces
        left_at = spy.pieces
        status, _, text = request(port, "POST", "/v1/completions", {"prompt": "The capital of France is",
                                                                     "max_tokens": 8, "temperature": 0})
        assert status == 200 and json.loads(text)["choices"][0]["text"] == eng.generate(
            "The capital of France is", 8).text
        assert spy.pieces > left_at  # the next request decoded through the same path
    finally:
        httpd.shutdown()
        httpd.server_close()


class _SlowEngine:
    """Stands in for an Engine: a stream of one piece every 20 ms until closed (or `pieces` of them)."""

    def __init__(self, pieces: int = 10 ** 6):
        self.pieces, self.started = pieces, 0
        self.target = type("T", (), {"encode": staticmethod(lambda p: [1, 2, 3])})()
        self.last_token_ids, self.last_metrics, self.last_finish_reason = [], {}, "length"

    def room(self, n: int, method: str) -> int:
        return 100

    def stream(self, ids, **kw):
        import time

        self.started += 1
        for i in range(self.pieces):
            time.sleep(0.02)
            self.last_token_ids = [0] * (i + 1)
            yield "x"


def test_a_client_that_left_while_queued_gets_no_decode_and_stop_ends_the_decode_in_flight():
    """Requests whose clients gave up while they waited for the engine were still decoded (each a full prefill
    here, 2.4 s for a long prompt); Ctrl-C during a decode left a request thread inside torch while the interpreter
    exited (SIGABRT). stop() now ends the decode in flight at its next piece and waits for the engine."""
    from spd_fast.server import ClientGone, ServerStopping, SpdServer

    eng = _SlowEngine()
    srv = SpdServer(eng, "m")
    body = {"prompt": "hi", "max_tokens": 5}
    for call in (lambda: srv.complete(body, False, gone=lambda: True),
                 lambda: srv.stream(dict(body, stream=True), False, gone=lambda: True)):
        with pytest.raises(ClientGone):
            call()
        assert eng.started == 0 and not srv.lock.locked()
    outcome = {}

    def decode_forever(kind):
        try:
            if kind == "complete":
                srv.complete(body, False, gone=lambda: False)
            else:
                events = srv.stream(dict(body, stream=True), False)
                try:
                    for _ in events:
                        pass
                finally:
                    events.close()
        except ServerStopping as e:
            outcome[kind] = str(e)

    for kind in ("complete", "stream"):
        srv.stopping.clear()
        t = threading.Thread(target=decode_forever, args=(kind,))
        t.start()
        while not srv.lock.locked():
            pass
        assert srv.stop(timeout=10) is True
        t.join(10)
        assert outcome[kind].startswith("the server is shutting down") and not srv.lock.locked()
    srv.stopping.clear()
    srv.lock.acquire()  # a decode that does not end in time: stop() says so instead of hanging
    try:
        assert srv.stop(timeout=0.2) is False
    finally:
        srv.lock.release()


def test_an_oversized_body_is_refused_before_it_is_sent(served):
    """`Expect: 100-continue` with a body over the limit: the 413 comes instead of the 100, so a standard-library
    client sees it (the server had closed the connection unread, and the client's send failed)."""
    import socket

    from spd_fast.server import MAX_BODY

    _, port, _ = served
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {MAX_BODY + 1}\r\nExpect: 100-continue\r\n\r\n".encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413") and b"100 Continue" not in reply, reply[:200]
    assert b"more than this server takes" in reply
