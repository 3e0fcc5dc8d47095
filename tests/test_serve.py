"""`edgefl serve`, the board's inference service (issue #6), as a real process: HTTP on its
Unix socket and on TCP, READY while it waits for the first model and STATUS once it serves
it, atomic model swaps while requests run (no request fails, every answer comes from one
whole model), bad requests answered with the cause, SIGTERM -> STOPPING and exit 0.
"""
from __future__ import annotations

import hashlib
import http.client
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

from edgefl.cli import main
from edgefl.export import export_onnx
from edgefl.export.onnx import raw_inputs
from edgefl.infer import Predictor
from edgefl.io import atomic_write
from edgefl.models import build_model
from edgefl.serve import UnixHTTPConnection
from helpers import NotifySocket, onnx_that_loads_but_cannot_run, wait_for



def request(conn, method, path, body=None, content_type="application/json"):
    headers = {"Content-Type": content_type} if body is not None else {}
    conn.request(method, path, body=body, headers=headers)
    response = conn.getresponse()
    return response.status, json.loads(response.read()), response


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export(path, digits, seed: int):
    model = build_model({"name": "mlp", "hidden": [16]}, digits.input_shape, 10)
    tmp = Path(str(path) + f".{seed}.src")
    export_onnx(model, model.init(seed), tmp, norm_mean=digits.norm_mean,
                norm_std=digits.norm_std)
    data = tmp.read_bytes()
    tmp.unlink()
    return data


def test_serve_process_waits_serves_swaps_and_stops_on_sigterm(tmp_path, digits):
    short = Path(tempfile.mkdtemp(prefix="efs-", dir="/tmp"))   # Unix socket paths are short
    model = tmp_path / "state" / "model.onnx"
    model.parent.mkdir()
    port = free_port()
    site = tmp_path / "infer.yaml"
    site.write_text(yaml.safe_dump({
        "profile": "generic-x86", "state_dir": str(tmp_path / "infer-state"),
        "log": {"level": "info"},
        "infer": {"model": str(model), "socket": str(short / "predict.sock"),
                  "listen": f"127.0.0.1:{port}", "check_interval": 0.1,
                  "max_request_bytes": 200_000}}))
    notify = NotifySocket(str(short / "notify"))
    env = dict(os.environ, NOTIFY_SOCKET=notify.path, WATCHDOG_USEC="2000000")
    env.pop("WATCHDOG_PID", None)
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "edgefl.cli", "serve", "--config", str(site)],
                            env=env, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT)
    log.close()

    def logged():
        return (tmp_path / "serve.log").read_text()

    sock = str(short / "predict.sock")
    try:
        ready = wait_for(lambda: notify.find("READY", "1"), what="READY=1", poll=0.05)
        assert ready["STATUS"].startswith(f"waiting for {model}"), ready
        conn = UnixHTTPConnection(sock)
        status, doc, _ = request(conn, "GET", "/health")
        assert (status, doc["status"]) == (503, "waiting")
        x = raw_inputs(digits, digits.x_test[:5])
        body = json.dumps({"inputs": x.tolist()})
        status, doc, _ = request(conn, "POST", "/predict", body)
        assert status == 503 and "waiting for" in doc["error"]

        # the first model appears (atomically, as the client installs it)
        model_a, model_b = export(tmp_path / "a", digits, 0), export(tmp_path / "b", digits, 1)
        atomic_write(model, model_a)
        wait_for(lambda: request(conn, "GET", "/health")[0] == 200, what="the first model",
                 poll=0.05)
        sha_a = Predictor(model).sha256
        health = request(conn, "GET", "/health")[1]["model"]
        assert health["threads"] == 2             # infer.threads of the generic-x86 profile
        assert health["sha256"] == sha_a and health["input_shape"] == [1, 8, 8]
        assert wait_for(lambda: notify.find("STATUS", "serving"), what="STATUS serving",
                        poll=0.05)
        status, doc, response = request(conn, "POST", "/predict", body)
        assert status == 200 and doc["model"]["sha256"] == sha_a
        assert response.getheader("X-Model-Sha256") == sha_a
        want_classes, want_probs = Predictor(model).predict(x)
        assert doc["classes"] == want_classes.tolist()
        np.testing.assert_allclose(doc["probabilities"], want_probs, atol=1e-6)
        assert doc["names"] == [str(c) for c in want_classes]

        # the same over TCP, and a .npy body
        tcp = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        buf = io.BytesIO()
        np.save(buf, x[:2].reshape(2, -1))                       # flattened samples
        status, doc, _ = request(tcp, "POST", "/predict", buf.getvalue(), "application/x-npy")
        assert status == 200 and doc["classes"] == want_classes[:2].tolist()

        # bad requests: the answer names the cause; the service keeps serving
        status, doc, _ = request(conn, "POST", "/predict", json.dumps({"inputs": [[1, 2, 3]]}))
        assert status == 400 and "shape (1, 3) does not fit model input (1, 8, 8)" in doc["error"]
        assert doc["expected_shape"] == ["n", 1, 8, 8]
        status, doc, _ = request(conn, "POST", "/predict", "{not json")
        assert status == 400 and "not JSON" in doc["error"]
        status, doc, _ = request(conn, "POST", "/predict",
                                 json.dumps({"inputs": [[float("nan")] * 64]}))   # NaN literal
        assert status == 400 and "non-finite" in doc["error"]
        big = UnixHTTPConnection(sock)
        status, doc, _ = request(big, "POST", "/predict", b"[" + b"0," * 150_000 + b"0]")
        assert status == 413 and "exceeds the limit of 200000" in doc["error"]
        status, doc, _ = request(conn, "GET", "/nothing")
        assert status == 404

        # swap models atomically while four threads keep asking: no request fails, and each
        # answer is exactly the answer of the model it names
        expected = {sha_a: want_classes.tolist()}
        errors, seen = [], set()
        stop = threading.Event()

        def hammer():
            c = UnixHTTPConnection(sock)
            while not stop.is_set():
                try:
                    status, doc, _ = request(c, "POST", "/predict", body)
                except Exception as exc:   # noqa: BLE001 -- recorded, asserted below
                    errors.append(repr(exc))
                    return
                if status != 200:
                    errors.append((status, doc))
                    return
                seen.add(doc["model"]["sha256"])
                if doc["classes"] != expected.get(doc["model"]["sha256"], doc["classes"]):
                    errors.append(("mixed answer", doc))

        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for t in threads:
            t.start()
        tmp_b = tmp_path / "b.onnx"
        atomic_write(tmp_b, model_b)
        sha_b = Predictor(tmp_b).sha256
        expected[sha_b] = Predictor(tmp_b).predict(x)[0].tolist()
        for i in range(6):
            atomic_write(model, model_b if i % 2 == 0 else model_a)
            time.sleep(0.3)
        atomic_write(model, model_b)
        wait_for(lambda: request(conn, "GET", "/health")[1]["model"]["sha256"] == sha_b,
                 what="model B to be served", poll=0.05)
        # a corrupt replacement is never served
        atomic_write(model, b"\x08\x07 not a model")
        wait_for(lambda: request(conn, "GET", "/health")[1]["model"]["last_error"],
                 what="the corrupt file to be noticed", poll=0.05)
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join(10)
        assert not errors, errors[:3]
        assert seen == {sha_a, sha_b}
        status, doc, _ = request(conn, "GET", "/health")
        assert doc["model"]["sha256"] == sha_b and "not a loadable ONNX model" in \
            doc["model"]["last_error"]
        assert doc["model"]["reloads"] >= 7 and doc["failures"] >= 5   # the bad requests
        conn.close()
        tcp.close()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, logged()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        notify.close()
    assert notify.find("STOPPING", "1"), notify.poll()
    assert notify.find("WATCHDOG", "1"), "no watchdog ping in the whole run"
    assert not os.path.exists(sock), "the socket file was left behind"
    assert "stopped (SIGTERM)" in logged()


def test_serve_refuses_what_it_cannot_serve_and_names_it(tmp_path, capsys):
    plain = tmp_path / "not-a-socket"
    plain.write_text("keep me")
    base = ["serve", "--profile", "generic-x86", "--set", f"state_dir={tmp_path}"]
    assert main(base + ["--set", f"infer.model={tmp_path / 'm.onnx'}",
                        "--set", f"infer.socket={plain}"]) == 1
    assert f"infer.socket {plain}: exists and is not a socket" in capsys.readouterr().err
    assert plain.read_text() == "keep me"
    assert main(base + ["--set", f"infer.model={tmp_path / 'm.onnx'}",
                        "--set", f"infer.socket={tmp_path / 'no' / 'dir.sock'}"]) == 1
    assert "directory" in capsys.readouterr().err
    assert main(base + ["--set", f"infer.model={tmp_path / 'm.onnx'}",
                        "--set", "infer.listen=127.0.0.1:99999"]) == 1
    assert "infer.listen: '127.0.0.1:99999': need HOST:PORT" in capsys.readouterr().err
    assert main(["serve", "--profile", "generic-x86"]) == 1
    assert "infer.model: not set, and the inference service needs it" in \
        capsys.readouterr().err


def serving_in_process(model_path, **options):
    """(service, socket path, stop) of `serve` running in a thread of this process: the real
    HTTP server and Predictor, for requests whose answer is checked without a process.
    `options`: InferenceService's."""
    from edgefl.serve import InferenceService, serve

    short = Path(tempfile.mkdtemp(prefix="efs-", dir="/tmp"))
    sock = str(short / "p.sock")
    service = InferenceService(str(model_path), check_interval=0.2, **options)
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(service, sock), kwargs={"stop": stop},
                              daemon=True)
    thread.start()
    wait_for(lambda: os.path.exists(sock) and service.predictor is not None, 10)
    return service, sock, stop, thread


def test_numbers_beyond_float_range_are_a_bad_request_not_a_server_error(tmp_path, digits):
    """JSON allows integers of any length: one beyond float64 raised OverflowError in the
    service, answered 500 "prediction failed" with a traceback logged."""
    path = tmp_path / "m.onnx"
    atomic_write(path, export(path, digits, 1))
    service, sock, stop, thread = serving_in_process(path)
    try:
        conn = UnixHTTPConnection(sock)
        row = [0] * 64
        row[5] = 10 ** 400
        status, doc, _ = request(conn, "POST", "/predict", json.dumps({"inputs": [row]}))
        assert status == 400, doc
        assert "inputs: a number too large for float64" in doc["error"]
        assert doc["expected_shape"] == ["n", 1, 8, 8]
        good = raw_inputs(digits, digits.x_test[:2]).reshape(2, 64).tolist()
        status, doc, _ = request(conn, "POST", "/predict", json.dumps({"inputs": good}))
        assert status == 200 and len(doc["classes"]) == 2      # and the service goes on
        conn.close()
    finally:
        stop.set()
        thread.join(10)


def test_a_npy_header_declaring_more_than_the_body_holds_is_a_bad_request(tmp_path, digits):
    """np.load allocates the shape a .npy header declares before it reads any data: a
    20-byte body declaring 10^6 x 10^6 float32 (4 TB) was a MemoryError, answered 500
    "prediction failed". The header is checked against the body first: 400 naming both."""
    path = tmp_path / "m.onnx"
    atomic_write(path, export(path, digits, 1))
    service, sock, stop, thread = serving_in_process(path)
    try:
        conn = UnixHTTPConnection(sock)
        head = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            head, {"descr": "<f4", "fortran_order": False, "shape": (10 ** 6, 10 ** 6)})
        body = head.getvalue() + b"\0" * 20
        status, doc, _ = request(conn, "POST", "/predict", body,
                                 "application/x-npy")
        assert status == 400, doc
        assert "declares shape (1000000, 1000000) of float32 (4000000000000 bytes)" \
            in doc["error"] and "holds 20" in doc["error"], doc
        good = io.BytesIO()
        np.save(good, raw_inputs(digits, digits.x_test[:2]))
        status, doc, _ = request(conn, "POST", "/predict", good.getvalue(),
                                 "application/x-npy")
        assert status == 200 and len(doc["classes"]) == 2      # and the service goes on
        conn.close()
    finally:
        stop.set()
        thread.join(10)


def test_a_model_that_loads_but_cannot_run_is_not_swapped_in(tmp_path, digits):
    """A replacement model that onnxruntime loads but cannot run (its Reshape does not fit
    the declared input) was swapped in, and every /predict then answered 500. It is refused
    at load: the service keeps answering with the model before, and /health names the file
    and onnxruntime's error. As the first model, it leaves the service waiting."""
    path = tmp_path / "m.onnx"
    good = export(path, digits, 1)
    atomic_write(path, good)
    service, sock, stop, thread = serving_in_process(path)
    try:
        atomic_write(path, onnx_that_loads_but_cannot_run())
        wait_for(lambda: service.last_error is not None
                 or service.predictor.sha256 != hashlib.sha256(good).hexdigest(), 10,
                 "the service to look at the replaced file")
        conn = UnixHTTPConnection(sock)
        status, doc, _ = request(conn, "GET", "/health")
        assert status == 200 and doc["model"]["sha256"] == hashlib.sha256(good).hexdigest()
        error = doc["model"]["last_error"]
        assert error.startswith(f"{path}: loads but does not run"), error
        assert "cannot be reshaped" in error and "still serving the previous model" in error
        row = raw_inputs(digits, digits.x_test[:1]).reshape(1, 64).tolist()
        status, doc, _ = request(conn, "POST", "/predict", json.dumps({"inputs": row}))
        assert status == 200 and len(doc["classes"]) == 1, doc
        conn.close()
    finally:
        stop.set()
        thread.join(10)

    from edgefl.serve import InferenceService
    first = tmp_path / "first.onnx"
    atomic_write(first, onnx_that_loads_but_cannot_run())
    waiting = InferenceService(str(first))
    assert waiting.refresh() is False and waiting.predictor is None
    status, doc = waiting.health()
    assert status == 503 and doc["status"] == "waiting"
    assert doc["last_error"].startswith(f"{first}: loads but does not run")


def test_json_inputs_that_are_strings_are_a_bad_request_naming_them(tmp_path, digits):
    """The JSON inputs were converted with np.asarray(inputs, float64), which parses strings:
    {"inputs": [["0", "1", ...]]} was answered 200 with a prediction, where a .npy of
    strings is refused naming its dtype (docs/onnx.md, "Bad input": only real numbers). A
    client that sends a CSV's cells as text learns so instead of getting predictions."""
    path = tmp_path / "m.onnx"
    atomic_write(path, export(path, digits, 1))
    service, sock, stop, thread = serving_in_process(path)
    try:
        conn = UnixHTTPConnection(sock)
        row = raw_inputs(digits, digits.x_test[:1]).reshape(64)
        for inputs in ([[str(v) for v in row]], [[*row[:63].tolist(), "1e3"]]):
            status, doc, _ = request(conn, "POST", "/predict", json.dumps({"inputs": inputs}))
            assert status == 400, doc
            assert doc["error"].startswith("inputs: strings are not numbers"), doc
            assert doc["expected_shape"] == ["n", 1, 8, 8]
        status, doc, _ = request(conn, "POST", "/predict",
                                 json.dumps({"inputs": [row.tolist()]}))
        assert status == 200 and len(doc["classes"]) == 1      # numbers: answered
        conn.close()
    finally:
        stop.set()
        thread.join(10)


def _stalled_request(sock: str, body: bytes) -> socket.socket:
    """A client that sends a /predict request's headers and half its body, then stalls (a
    slow or hostile caller)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10)
    conn.connect(sock)
    conn.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:len(body) // 2])
    return conn


def _answer(conn: socket.socket) -> tuple[int, dict, str]:
    """(status, JSON body, raw head) of the one response on a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        rest += conn.recv(65536)
    return int(head.split()[1]), json.loads(rest[:length]), head.decode()


def test_predictions_at_once_are_capped_and_a_request_beyond_them_is_told_to_retry(
        tmp_path, digits):
    """Each request read its body and ran the model in a thread of its own, with no bound:
    on a 512 MB board a few large requests at once (a 16 MiB JSON body peaks at about
    +150 MB) get the service killed for memory. infer.max_concurrent bounds the requests
    being read and run; one beyond them waits for a slot, then gets 503 with Retry-After
    naming the setting, and the service goes on."""
    path = tmp_path / "m.onnx"
    atomic_write(path, export(path, digits, 1))
    service, sock, stop, thread = serving_in_process(path, max_concurrent=1, busy_wait_s=0.5)
    body = json.dumps({"inputs": raw_inputs(digits, digits.x_test[:3]).tolist()}).encode()
    try:
        slow = _stalled_request(sock, body)       # holds the one slot
        time.sleep(0.2)
        conn = UnixHTTPConnection(sock)
        status, doc, response = request(conn, "POST", "/predict", body)
        assert status == 503 and "infer.max_concurrent = 1" in doc["error"], doc
        assert response.getheader("Retry-After") == "1"
        conn.close()
        slow.sendall(body[len(body) // 2:])       # the slow caller is answered in full
        status, doc, _ = _answer(slow)
        assert status == 200 and len(doc["classes"]) == 3, doc
        slow.close()
        conn = UnixHTTPConnection(sock)
        assert request(conn, "POST", "/predict", body)[0] == 200    # the slot is free again
        conn.close()
    finally:
        stop.set()
        thread.join(10)


def test_a_body_that_does_not_arrive_in_time_frees_its_slot(tmp_path, digits):
    """A caller that sends half its body and stalls held its thread (and, now, its slot) as
    long as it kept the connection: each read waited up to 60 s, so a trickle held it for
    ever. The whole body must arrive within infer's body deadline, else 408 and the
    connection closed."""
    path = tmp_path / "m.onnx"
    atomic_write(path, export(path, digits, 1))
    service, sock, stop, thread = serving_in_process(path, max_concurrent=1, busy_wait_s=5.0,
                                                     body_deadline_s=0.5)
    body = json.dumps({"inputs": raw_inputs(digits, digits.x_test[:3]).tolist()}).encode()
    try:
        slow = _stalled_request(sock, body)
        status, doc, _ = _answer(slow)
        assert status == 408 and "0.5 s" in doc["error"], doc
        slow.close()
        conn = UnixHTTPConnection(sock)
        assert request(conn, "POST", "/predict", body)[0] == 200
        conn.close()
    finally:
        stop.set()
        thread.join(10)
