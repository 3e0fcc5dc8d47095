"""`edgefl serve`: a board's inference service. It answers prediction requests with the
latest global model, and follows the model file as the client replaces it after each
exported round, so a board keeps predicting while the next model trains (docs/onnx.md,
"`edgefl serve`: the inference service"; issue #6).

The API is small HTTP/1.1 with JSON, stdlib only (http.server), on a Unix socket:
`$RUNTIME_DIRECTORY/predict.sock` under systemd (the unit has no network at all), and
optionally on TCP (`infer.listen`, e.g. 127.0.0.1:8080) for a board whose own programs
prefer a port. Any local program can call it with curl or ten lines of code:

    curl --unix-socket /run/edgefl-infer/predict.sock http://localhost/health
    curl --unix-socket /run/edgefl-infer/predict.sock http://localhost/predict \\
         -H 'Content-Type: application/json' -d '{"inputs": [[0, 0, 5, 13, ...]]}'

GET  /health    200 {"status": "ok", "model": {path, sha256, round, algorithm,
                input_shape, class_names, reloads, ...}}; 503 {"status": "waiting"} before
                the first model exists (or loads)
POST /predict   raw samples as the dataset stores them (pixels 0..255, digits 0..16):
                JSON {"inputs": array} (application/json) or a .npy file
                (application/x-npy); an array of (n, *input_shape), one sample, or
                (n, prod(input_shape)). 200 {"classes", "names", "probabilities", "model"}
                ({"values"} for a regression model). 400 names what is wrong (the
                expected shape for a wrong one), 411 without Content-Length, 413 beyond
                infer.max_request_bytes, 503 while waiting for the first model.

edgefl.infer.Predictor does the work: one onnxruntime session with infer.threads threads
(the device profile sets it), reloaded when the file is atomically replaced, never a
half-written file. The main thread checks the file every infer.check_interval seconds,
also with no requests coming, so /health and the unit's STATUS name the model in use.

As a systemd service (Type=notify): READY=1 once the socket listens, whether a model is
loaded or the service waits for the first one (STATUS says which); WATCHDOG=1 while the
main loop runs; STOPPING=1 and exit 0 on SIGTERM, the socket file removed.
"""
from __future__ import annotations

import errno
import http.client
import io
import json
import logging
import math
import os
import socket
import socketserver
import stat
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from .infer import InputError, ModelFileError, Predictor

__all__ = ["InferenceService", "ServeError", "serve", "socket_path_for"]

log = logging.getLogger("edgefl.serve")

SOCKET_NAME = "predict.sock"
MAX_UNIX_PATH = 107          # sun_path is 108 bytes with the terminating NUL
DRAIN_BYTES = 64 << 20      # an oversized body up to this is read (and dropped) before the 413
BUSY_WAIT_S = 10.0          # a request waits this long for a free slot, then 503
BODY_DEADLINE_S = 30.0      # the whole body must arrive within this, else 408
NPY_TYPES = ("application/x-npy", "application/octet-stream")


class UnixHTTPConnection(http.client.HTTPConnection):
    """An http.client connection to the service's Unix socket, for scripts on the board
    (and the tests and tools/bench_onnx.py): `UnixHTTPConnection(path)`, then the usual
    request()/getresponse()."""

    def __init__(self, path: str, timeout: float = 10.0):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


class ServeError(ValueError):
    """The service cannot start as configured; the message names the file or setting."""


def socket_path_for(configured: str | None, state_dir_of) -> str:
    """infer.socket, else $RUNTIME_DIRECTORY/predict.sock (the unit's RuntimeDirectory=),
    else <state_dir>/predict.sock. `state_dir_of` is called only in the last case."""
    if configured:
        return configured
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if runtime:
        return os.path.join(runtime, SOCKET_NAME)
    return os.path.join(state_dir_of(), SOCKET_NAME)


class InferenceService:
    """The model being served and the answers to requests; thread-safe (the HTTP server
    handles each connection in its own thread, onnxruntime sessions run concurrently)."""

    def __init__(self, model_path: str, *, threads: int = 1, check_interval: float = 1.0,
                 max_request_bytes: int = 16 << 20, max_concurrent: int = 2,
                 busy_wait_s: float = BUSY_WAIT_S, body_deadline_s: float = BODY_DEADLINE_S):
        self.model_path = os.fspath(model_path)
        self.threads = int(threads)
        self.check_interval = float(check_interval)
        self.max_request_bytes = int(max_request_bytes)
        # requests whose body is being read or whose model is running: each holds its body
        # and onnxruntime's activations, so their number bounds the service's memory
        self.max_concurrent = int(max_concurrent)
        self.slots = threading.BoundedSemaphore(self.max_concurrent)
        self.busy_wait_s, self.body_deadline_s = float(busy_wait_s), float(body_deadline_s)
        self.predictor: Predictor | None = None
        self.last_error: str | None = None
        self.requests = 0
        self.failures = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the model
    def refresh(self) -> bool:
        """Load the first model once it exists, or check the loaded one's file for a
        replacement. True when the served model changed."""
        if self.predictor is None:
            if not os.path.exists(self.model_path):
                return False
            try:
                # the main loop checks the file every check_interval; requests do not stat it
                predictor = Predictor(self.model_path, threads=self.threads, check_interval=None)
            except ModelFileError as exc:
                if str(exc) != self.last_error:
                    log.warning("%s; waiting for a loadable model", exc)
                self.last_error = str(exc)
                return False
            with self._lock:
                self.predictor, self.last_error = predictor, None
            log.info("serving %s (sha256 %s, round %s)", self.model_path,
                     predictor.sha256[:12], predictor.metadata.get("round", "?"))
            return True
        changed = self.predictor.reload()
        self.last_error = self.predictor.last_error
        return changed

    def state_key(self) -> tuple:
        """What STATUS shows, without the request count: (model sha256, last error)."""
        p = self.predictor
        return (p.sha256 if p is not None else None, self.last_error)

    def describe(self) -> str:
        """One line for systemd's STATUS."""
        p = self.predictor
        if p is None:
            why = f" ({self.last_error})" if self.last_error else ""
            return f"waiting for {self.model_path}{why}"
        meta = p.metadata
        return (f"serving {self.model_path}: round {meta.get('round') or '?'}, sha256 "
                f"{p.sha256[:12]}")

    def model_info(self) -> dict | None:
        p = self.predictor
        if p is None:
            return None
        meta = p.metadata
        return {"path": self.model_path, "sha256": p.sha256, "round": _int_or(meta.get("round")),
                "algorithm": meta.get("algorithm") or None, "model_kind": meta.get("model_kind"),
                "input_shape": list(p.input_shape), "class_names": list(p.class_names),
                "decision": meta.get("decision"), "quantization": meta.get("quantization"),
                "accuracy": _float_or(meta.get("accuracy")), "threads": p.threads,
                "reloads": p.reloads,
                "last_error": p.last_error}

    # ------------------------------------------------------------------ requests
    def health(self) -> tuple[int, dict]:
        info = self.model_info()
        if info is None:
            return 503, {"status": "waiting", "model_path": self.model_path,
                         "last_error": self.last_error}
        return 200, {"status": "ok", "model": info, "requests": self.requests,
                     "failures": self.failures}

    def predict(self, body: bytes, content_type: str) -> tuple[int, dict]:
        p = self.predictor
        if p is None:
            return 503, {"error": f"no model yet: waiting for {self.model_path}"}
        try:
            x = _parse_inputs(body, content_type)
            # one call, one model: the answer names the model that computed it, even when
            # the file is replaced meanwhile
            got = p.answer(x)
        except InputError as exc:
            return 400, {"error": str(exc), "expected_shape": ["n", *p.input_shape]}
        if "values" in got:
            out = {"values": got["values"].tolist()}
        else:
            names = got["class_names"]
            out = {"classes": got["classes"].tolist(),
                   "names": [names[c] for c in got["classes"]],
                   "probabilities": got["probabilities"].tolist()}
        out["model"] = {"sha256": got["sha256"], "round": _int_or(got["metadata"].get("round"))}
        return 200, out


def _int_or(text):
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def _float_or(text):
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _check_npy_size(body: bytes) -> None:
    """np.load allocates the array its header declares before reading any data: a header of
    a few bytes declaring 4 TB was a MemoryError (a 500). The declared size must be what the
    body holds after the header."""
    f = io.BytesIO(body)
    read_header = (np.lib.format.read_array_header_1_0 if np.lib.format.read_magic(f) == (1, 0)
                   else np.lib.format.read_array_header_2_0)      # 2.0 and 3.0: the same layout
    shape, _, dtype = read_header(f)
    if dtype.hasobject:
        return                                   # np.load refuses it (allow_pickle=False)
    declared = math.prod(shape) * dtype.itemsize
    if declared != len(body) - f.tell():
        raise InputError(f"request body: the .npy header declares shape {tuple(shape)} of "
                         f"{dtype} ({declared} bytes), the body holds {len(body) - f.tell()} "
                         f"after the header")


def _parse_inputs(body: bytes, content_type: str) -> np.ndarray:
    kind = content_type.split(";")[0].strip().lower()
    if kind in NPY_TYPES or body[:6] == b"\x93NUMPY":
        try:
            _check_npy_size(body)
            return np.load(io.BytesIO(body), allow_pickle=False)
        except InputError:
            raise
        except (ValueError, OSError, EOFError) as exc:
            raise InputError(f"request body: not a numeric .npy array ({exc})") from None
    # anything else is read as JSON: curl -d sends application/x-www-form-urlencoded
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InputError(f"request body (Content-Type {kind or 'none'}): not JSON ({exc}); "
                         f'send {{"inputs": [...]}} as application/json, or a .npy file as '
                         f"application/x-npy") from None
    inputs = doc.get("inputs") if isinstance(doc, dict) else doc
    if inputs is None:
        raise InputError('request body: a JSON object {"inputs": [...]} (or a bare array) '
                         f"expected, got keys {sorted(doc) if isinstance(doc, dict) else doc!r}")
    # numbers only: np.asarray(..., float64) would parse strings ("1e3") as numbers, where a
    # .npy of strings is refused by its dtype
    try:
        a = np.asarray(inputs)
        strings = a.dtype.kind in "US" or \
            (a.dtype.kind == "O" and any(isinstance(v, str) for v in a.flat))
        if a.dtype.kind == "O" and not strings:   # integers beyond int64, or not numbers
            a = np.asarray(inputs, dtype=np.float64)
    except OverflowError as exc:   # JSON integers have no size limit
        raise InputError(f"inputs: a number too large for float64 ({exc})") from None
    except (ValueError, TypeError, RecursionError) as exc:
        raise InputError(f"inputs: not a rectangular array of numbers ({exc})") from None
    if strings:
        raise InputError('inputs: strings are not numbers; send the values as JSON numbers '
                         '({"inputs": [[0, 5.5, ...]]})')
    return a


# ---------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    server_version = "edgefl-serve"
    protocol_version = "HTTP/1.1"
    timeout = 60                       # an idle keep-alive connection is closed after this
    service: InferenceService          # set on the server

    def address_string(self) -> str:
        # a Unix socket's peer has no address (client_address is '')
        return self.client_address[0] if self.client_address else "unix"

    def log_message(self, fmt, *args) -> None:
        log.debug("%s %s", self.address_string(), fmt % args)

    def _reply(self, code: int, doc: dict, close: bool = False,
               headers: dict | None = None) -> None:
        if self.command == "POST":          # prediction requests, answered or refused
            service = self.server.service
            with service._lock:
                service.requests += 1
                service.failures += code != 200
        body = json.dumps(doc, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        sha = (doc.get("model") or {}).get("sha256") if isinstance(doc.get("model"), dict) \
            else None
        if sha:
            self.send_header("X-Model-Sha256", sha)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path in ("/health", "/"):
            self._reply(*self.server.service.health())
        elif path == "/predict":
            self._reply(405, {"error": "POST the inputs to /predict"})
        else:
            self._reply(404, {"error": f"no such resource {path!r}; GET /health, "
                                       f"POST /predict"})

    def do_POST(self) -> None:
        service = self.server.service
        path = self.path.split("?")[0]
        if path != "/predict":
            self._reply(404, {"error": f"no such resource {path!r}; POST /predict"}, close=True)
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            self._reply(411, {"error": "Content-Length required (a number of bytes)"},
                        close=True)
            return
        n = int(length)
        if n > service.max_request_bytes:
            self._drain(n)
            self._reply(413, {"error": f"request body of {n} bytes exceeds the limit of "
                                       f"{service.max_request_bytes} (infer.max_request_bytes)"},
                        close=True)
            return
        if not service.slots.acquire(timeout=service.busy_wait_s):
            self._drain(n)
            self._reply(503, {"error": f"busy: {service.max_concurrent} prediction(s) in "
                                       f"progress (infer.max_concurrent = "
                                       f"{service.max_concurrent}); retry"},
                        close=True, headers={"Retry-After": "1"})
            return
        try:
            body = self._read_body(n, service.body_deadline_s)
            if body is None:
                return
            try:
                code, doc = service.predict(body, self.headers.get("Content-Type", ""))
            except ModelFileError as exc:
                code, doc = 503, {"error": str(exc)}
            except Exception as exc:   # noqa: BLE001 -- onnxruntime's own errors; keep serving
                log.exception("prediction failed")
                code, doc = 500, {"error": f"prediction failed: {type(exc).__name__}: {exc}"}
            del body
        finally:
            service.slots.release()
        self._reply(code, doc)

    def _drain(self, n: int) -> None:
        """Read and drop a body that is not served, up to DRAIN_BYTES, so a client that sends
        it all before reading gets the answer; a larger one is cut off (the caller's reply
        closes the connection)."""
        left = n if n <= DRAIN_BYTES else 0
        while left > 0:
            piece = self.rfile.read(min(left, 1 << 16))
            if not piece:
                break
            left -= len(piece)

    def _read_body(self, n: int, deadline_s: float) -> bytearray | None:
        """The n-byte body, which must arrive whole within deadline_s (a caller trickling it
        would hold its slot as long as it liked: each read waits up to `timeout`); None
        once the error is answered (the connection closes)."""
        end = time.monotonic() + deadline_s
        body = bytearray(n)                  # read in place: no second copy of a large body
        view, got = memoryview(body), 0
        try:
            while got < n:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.connection.settimeout(min(left, self.timeout))
                count = self.rfile.readinto1(view[got:])
                if not count:
                    break
                got += count
        except (TimeoutError, socket.timeout):
            self._reply(408, {"error": f"request body: {got} of {n} bytes arrived within "
                                       f"{deadline_s:g} s"}, close=True)
            return None
        finally:
            self.connection.settimeout(self.timeout)
        if got != n:
            self._reply(400, {"error": f"request body: {got} of {n} bytes arrived"},
                        close=True)
            return None
        return body


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False


class _TCPHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False


def _bind_unix(path: str, service: InferenceService) -> _UnixHTTPServer:
    if len(os.fsencode(path)) > MAX_UNIX_PATH:
        raise ServeError(f"infer.socket {path}: {len(os.fsencode(path))} bytes, a Unix socket "
                         f"path has at most {MAX_UNIX_PATH}")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ServeError(f"infer.socket {path}: directory {directory} does not exist")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise ServeError(f"infer.socket {path}: exists and is not a socket; not replaced")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)            # left by a process that ended without cleaning up
        else:
            raise ServeError(f"infer.socket {path}: another process is serving on it")
        finally:
            probe.close()
    server = _UnixHTTPServer(path, _Handler)
    os.chmod(path, 0o660)              # the edgefl group's programs may call it
    server.service = service
    return server


def _bind_tcp(listen: str, service: InferenceService) -> _TCPHTTPServer:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    try:
        server = _TCPHTTPServer((host, int(port)), _Handler)
    except OSError as exc:
        why = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise ServeError(f"infer.listen {listen}: cannot listen ({why})") from None
    server.service = service
    return server


# ---------------------------------------------------------------------------------------
# the service's main loop
# ---------------------------------------------------------------------------------------

def serve(service: InferenceService, socket_path: str, *, listen: str | None = None,
          stop, notifier=None) -> int:
    """Serve until `stop` is set (SIGTERM); returns the exit status (0)."""
    servers = [_bind_unix(socket_path, service)]
    try:
        if listen:
            servers.append(_bind_tcp(listen, service))
    except ServeError:
        servers[0].server_close()
        os.unlink(socket_path)
        raise
    threads = [threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.2},
                                name=f"edgefl-serve-{i}", daemon=True)
               for i, s in enumerate(servers)]
    for t in threads:
        t.start()
    where = [f"unix:{socket_path}"] + ([f"http://{listen}"] if listen else [])
    log.info("listening on %s", ", ".join(where))
    service.refresh()
    tick = max(0.1, min(service.check_interval or 1.0, 1.0))
    heartbeat = [time.monotonic()]
    if notifier is not None:
        notifier.ready(service.describe())
    shown = service.state_key()
    pinger = notifier.watchdog_pinger(
        healthy=lambda: time.monotonic() - heartbeat[0] < 10 * tick + 5) \
        if notifier is not None else None
    if pinger is not None:
        pinger.start()
    try:
        while not stop.wait(tick):
            service.refresh()
            heartbeat[0] = time.monotonic()
            if service.state_key() != shown and notifier is not None:
                notifier.status(service.describe())
            shown = service.state_key()
    finally:
        if pinger is not None:
            pinger.stop()
        if notifier is not None:
            notifier.stopping(f"stopping ({getattr(stop, 'name', None) or 'stop requested'})")
        for s in servers:
            s.shutdown()
            s.server_close()
        for t in threads:
            t.join(5)
        try:
            os.unlink(socket_path)
        except FileNotFoundError:
            pass
    log.info("stopped after %d requests", service.requests)
    return 0
