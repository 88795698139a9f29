"""A real S3-protocol server for the tests: moto's server mode (the `test` extra), started on 127.0.0.1 on a free
port and stopped with the test module. It implements conditional writes (If-None-Match, If-Match), which the
output's commit protocol needs. Its credentials are planted in the environment of the processes the tests start,
so that a test can look for them where they must never appear."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Planted, never real: a test greps every output file and log line for them.
ACCESS_KEY = "AKIAPLANTEDTESTKEY7Q"
SECRET_KEY = "planted+Secret/Key/Never/In/Output/9f3a"


@dataclass
class S3Server:
    endpoint: str
    process: subprocess.Popen

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a batchgen process using this server through the standard variables."""
        return {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint, **extra}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3_server(port: int | None = None, env: dict[str, str] | None = None) -> S3Server:
    """moto's server on `port` (a free one by default), with `env` added to its environment."""
    port = port or free_port()
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return S3Server(f"http://127.0.0.1:{port}", process)
        except OSError:
            if process.poll() is not None:
                raise RuntimeError("moto's S3 server exited at start")
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("moto's S3 server did not start within 60 s")


def start_s3_server_holding(files: dict[str, Path], buckets: tuple[str, ...] = ()) -> S3Server:
    """A server whose buckets hold `files` ("bucket/key": local file), plus the empty `buckets`."""
    server = start_s3_server()
    client = server.client()
    for bucket in dict.fromkeys([*(where.split("/", 1)[0] for where in files), *buckets]):
        client.create_bucket(Bucket=bucket)
    for where, path in files.items():
        bucket, key = where.split("/", 1)
        client.upload_file(str(path), bucket, key)
    return server


class ThrottlingProxy:
    """An HTTP proxy in front of an S3 server that answers the first `throttled` requests (every one: None) with
    503 SlowDown, as S3 does under load, and forwards the rest. Stopped, it is a store that cannot be reached (whose
    objects are kept: another proxy on the same port brings it back). A PUT whose key contains one of `slow_puts`
    waits `put_delay_s` before it is forwarded: a write that lasts long enough for a test to act in it. A request
    that arrives before `stall_until` (time.monotonic()) hangs until then and gets a 503: a store that stalls."""

    def __init__(self, upstream: str, throttled: int | None, port: int = 0, slow_puts: tuple[str, ...] = (),
                 put_delay_s: float = 0.0) -> None:
        import http.client
        import threading
        import time
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        proxy = self
        self.throttled, self.requests = throttled, 0
        self.stall_until = 0.0
        self.access_keys: set[str] = set()  # the access key ids requests were signed with
        host, upstream_port = upstream.removeprefix("http://").split(":")

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def handle_one(self) -> None:
                proxy.requests += 1
                signed = self.headers.get("Authorization", "").partition("Credential=")[2].partition("/")[0]
                proxy.access_keys.add(signed)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "PUT" and any(mark in self.path for mark in slow_puts):
                    time.sleep(put_delay_s)
                stalled = proxy.stall_until - time.monotonic()
                if stalled > 0:
                    time.sleep(stalled)
                if stalled > 0 or proxy.throttled is None or proxy.requests <= proxy.throttled:
                    reply = (b"<?xml version=\"1.0\"?><Error><Code>SlowDown</Code>"
                             b"<Message>Please reduce your request rate.</Message></Error>")
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                    return
                connection = http.client.HTTPConnection(host, int(upstream_port), timeout=60)
                connection.request(self.command, self.path, body=body, headers=dict(self.headers))
                answer = connection.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                head = self.command == "HEAD"  # its Content-Length is the object's, with no body
                for name, value in answer.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection") and (
                            head or name.lower() != "content-length"):
                        self.send_header(name, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = handle_one

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()  # the port is free again: a proxy started on it is the store coming back
