"""One raw paho-mqtt client process for tools/bench_transport.py's `round` benchmark with
--topology processes: the byte-moving baseline of one board, without edgefl.

    python tools/_raw_paho_client.py HOST PORT TAG INDEX PAYLOADS_FILE

PAYLOADS_FILE holds the messages of one frame (a JSON list of their sizes, a newline, then
their bytes back to back). The client subscribes to raw/TAG/model (QoS 1), prints "ready",
and then, every time it has received as many messages as the file holds, publishes the
same messages to raw/TAG/update/cINDEX (QoS 1): what an edgefl client moves in a round
(the model in, its update out), with the same TCP_NODELAY and in-flight window as
edgefl's transport. It exits when stdin closes.
"""
from __future__ import annotations

import json
import socket
import sys
import threading

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

MAX_INFLIGHT = 16     # edgefl.transport.mqtt.MqttSettings.max_inflight


def main() -> int:
    host, port, tag, index, path = sys.argv[1:6]
    with open(path, "rb") as f:
        sizes = json.loads(f.readline())
        blob = f.read()
    payloads, at = [], 0
    for n in sizes:
        payloads.append(blob[at:at + n])
        at += n
    received = [0]
    subscribed = threading.Event()
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"raw-{tag}-c{index}",
                         clean_session=True)
    client.max_inflight_messages_set(MAX_INFLIGHT)
    client.on_socket_open = lambda c, u, sock: sock.setsockopt(socket.IPPROTO_TCP,
                                                               socket.TCP_NODELAY, 1)
    up = f"raw/{tag}/update/c{index}"

    def on_message(c, u, msg):
        received[0] += 1
        if received[0] == len(payloads):      # the whole model is here: send the update
            received[0] = 0
            for p in payloads:
                c.publish(up, p, qos=1)

    client.on_message = on_message
    client.on_subscribe = lambda *a: subscribed.set()
    # subscribed on every connect, as edgefl's transport does: amqtt can drop a connection
    # while many clients subscribe at once (its subscription table changes under iteration)
    client.on_connect = lambda c, u, flags, rc, props: c.subscribe(f"raw/{tag}/model", qos=1)
    client.reconnect_delay_set(0.1, 1.0)
    client.connect(host, int(port), keepalive=60)
    client.loop_start()
    if not subscribed.wait(30):
        print("no SUBACK", flush=True)
        return 1
    print("ready", flush=True)
    sys.stdin.read()                           # until the benchmark closes our stdin
    client.disconnect()
    client.loop_stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
