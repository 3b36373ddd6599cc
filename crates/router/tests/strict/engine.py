"""A stand-in engine on h11, the strict HTTP/1.1 parser uvicorn runs on.

It serves /health, /metrics and /v1/completions, refuses what h11 refuses (a request without
Host) and, as uvicorn's routing would, any request target that is not origin-form. Prints its
port on the first line of stdout.
"""

import json
import socket
import threading

import h11


def answer(request, body):
    if not request.target.startswith(b"/"):
        return 400, b"request target must be origin-form, got " + request.target
    if request.target == b"/health":
        return 200, b"ok"
    if request.target == b"/metrics":
        return 200, b""
    if request.target == b"/v1/completions" and request.method == b"POST":
        prompt = json.loads(body).get("prompt", "")
        return 200, json.dumps({
            "id": "cmpl-strict", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(str(prompt)), "completion_tokens": 1,
                      "total_tokens": len(str(prompt)) + 1},
        }).encode()
    return 404, b"not found"


def refuse(sock, reason):
    body = ("strict HTTP/1.1: %s" % reason).encode()
    head = "HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
    sock.sendall((head % len(body)).encode() + body)


def serve(sock):
    conn = h11.Connection(h11.SERVER)
    request, body = None, b""
    with sock:
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as e:
                refuse(sock, e)
                return
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(65536))
            elif isinstance(event, h11.Request):
                request, body = event, b""
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                status, payload = answer(request, body)
                headers = [("content-type", "application/json"),
                           ("content-length", str(len(payload)))]
                sock.sendall(conn.send(h11.Response(status_code=status, headers=headers)))
                sock.sendall(conn.send(h11.Data(data=payload)))
                sock.sendall(conn.send(h11.EndOfMessage()))
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                return


def main():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    print(listener.getsockname()[1], flush=True)
    while True:
        sock, _ = listener.accept()
        threading.Thread(target=serve, args=(sock,), daemon=True).start()


main()
