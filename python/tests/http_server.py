"""A local HTTP server for download tests (127.0.0.1 only): byte ranges, a connection cut on demand, a log."""

from __future__ import annotations

import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Served:
    path: str
    range: str | None
    status: int
    bytes_sent: int


@dataclass
class FileServer:
    """Serves `files` (URL path -> bytes). `cut_after[path] = n`: the next GET of path stops after n bytes of
    its body and the connection is closed (once). `ignore_range`: answer every request in full (200)."""

    files: dict[str, bytes] = field(default_factory=dict)
    content_types: dict[str, str] = field(default_factory=dict)
    cut_after: dict[str, int] = field(default_factory=dict)
    ignore_range: bool = False
    log: list[Served] = field(default_factory=list)
    base_url: str = ""

    def handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                data = server.files.get(self.path)
                wanted = self.headers.get("Range")
                if data is None:
                    self.send_error(404)
                    server.log.append(Served(self.path, wanted, 404, 0))
                    return
                start, status = 0, 200
                match = re.fullmatch(r"bytes=(\d+)-", wanted or "")
                if match and not server.ignore_range:
                    start = int(match.group(1))
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        server.log.append(Served(self.path, wanted, 416, 0))
                        return
                    status = 206
                body = data[start:]
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Content-Type", server.content_types.get(self.path, "application/octet-stream"))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                cut = server.cut_after.pop(self.path, None)
                sent = body if cut is None else body[:cut]
                self.wfile.write(sent)
                self.wfile.flush()
                server.log.append(Served(self.path, wanted, status, len(sent)))
                if cut is not None:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)

        return Handler


class Running:
    def __init__(self, httpd: ThreadingHTTPServer) -> None:
        self.httpd = httpd
        self.thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        self.thread.start()
        host, port = httpd.server_address[:2]
        self.base_url = f"http://{host}:{port}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def serve_files(server: FileServer) -> Running:
    running = Running(ThreadingHTTPServer(("127.0.0.1", 0), server.handler()))
    server.base_url = running.base_url
    return running


def serve_directory(directory: Path) -> Running:
    """A plain static server of a directory, as a fleet mirror would be (what git's dumb HTTP reads)."""

    class Quiet(SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(directory), **kwargs)

        def log_message(self, *args):
            pass

    return Running(ThreadingHTTPServer(("127.0.0.1", 0), Quiet))
