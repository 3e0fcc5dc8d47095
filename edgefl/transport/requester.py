"""`RequesterTransport`: an MqttTransport for a requester (`edgefl ctl`) that also keeps the
broker's refusals of its publishes.

Over MQTT 5 a broker that will not take a publish says so in its PUBACK (a reason code
>= 0x80, e.g. 135 Not authorized: the ACL lets only the operator account publish on the ctl
topic). MqttTransport only logs it; a requester needs it to fail a command at once instead
of waiting for a reply that cannot come (roles/control.py's ControlClient reads `refused`).
"""
from __future__ import annotations

from .mqtt import MqttTransport

__all__ = ["RequesterTransport"]


class RequesterTransport(MqttTransport):
    """An MqttTransport that also keeps the reason codes of the publishes the broker refused
    (MQTT 5 PUBACK >= 0x80), which MqttTransport only logs: `refused` lists
    (reason code, its name) in arrival order. A requester publishes nothing but its
    commands, so a refusal after a command is that command's. The code is recorded before
    the delivery completes, so after `Delivery.wait()` returns it is there."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.refused: list[tuple[int, str]] = []

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        if reason_code.is_failure:
            self.refused.append((reason_code.value, str(reason_code)))
        super()._on_publish(client, userdata, mid, reason_code, properties)
