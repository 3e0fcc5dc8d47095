"""The simulated fleet of a run config's `sim_fleet:` section (`fleet:` before, still read with
a warning): which device profile each client is, and how fast it computes and talks.
`edgefl simulate` turns it into a virtual clock (`edgefl/sim/clock.py`) that times every
local round, so synchronous and asynchronous runs
report simulated seconds of the fleet they model.

    sim_fleet:
      mix: {rpi-zero2w: 0.3, rpi4: 0.5, rpi5: 0.2}   # shares of the clients, by profile
      gflops: {rpi4: 8}          # optional: a board's training rate (GFLOP/s), over BOARDS
      bandwidth_mbps: 50         # optional: every link's rate, or {profile: Mbit/s}
      deadline_s: 30             # optional, synchronous rounds: a round closes then at the
                                 # latest, and a client not done by then is stopped
      jitter: 0.3                # optional: each task's time times a log-normal factor of
                                 # mean 1 and this sigma, drawn per task (0: constant speeds)
    sim_fleet: {rpi-zero2w: 0.3, rpi4: 0.5, rpi5: 0.2}   # shorthand: shares beside the keys
    sim_fleet: {profile: rpi4}                           # every client the same board

The profile names are the device profiles of edgefl/profiles/ (`service.profiles`); a
profile's `transport.compression` sets how many bytes a float32 buffer takes on its link
(int8 a quarter, f16 a half). BOARDS holds each profile's rates. They are estimates, not
measurements on boards: one core's sustained float32 multiply-add rate from the CPU's SIMD
width and clock, and the usual application throughput of the board's network (docs/async.md
says how they were chosen). What a comparison needs from them is the ratio between boards;
override them with `gflops` and `bandwidth_mbps` when a board's own measurement is known.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

from .config import check_number, load_yaml
from .errors import ConfigError
from .service import profiles

__all__ = ["BOARDS", "Board", "COMPRESSION_RATIO", "FLEET_KEYS", "FLEET_KEY", "OLD_FLEET_KEY",
           "fleet_in", "fleet_section", "boards_of", "assign_profiles", "refuse_over_broker"]


@dataclass(frozen=True)
class Board:
    """A profile's rates in the simulation: training GFLOP/s (one core, float32) and the
    link's Mbit/s, the same up and down."""
    gflops: float
    bandwidth_mbps: float


# Estimates (see the module docstring): Cortex-A53 1 GHz (64-bit NEON datapath), A53 1.2-1.4
# GHz, A72 1.5-1.8 GHz and A57 1.43 GHz (128-bit NEON), A76 2.4 GHz (two 128-bit FMA pipes);
# generic-x86 is this project's x86-64 VM rounded down (docs/deployment.md's footprint table:
# mlp [64], 6,000 images, 0.021 s per epoch, 87 GFLOP/s by the clock's count of 6 FLOPs per
# parameter and sample); links: 2.4 GHz 802.11n (Zero 2 W, Pi 3), 5 GHz Wi-Fi or Ethernet
# (Pi 4, Pi 5), Gigabit Ethernet (Jetson, x86).
BOARDS = {
    "rpi-zero2w": Board(1.5, 20.0),
    "rpi3": Board(2.0, 30.0),
    "rpi4": Board(6.0, 100.0),
    "rpi5": Board(18.0, 200.0),
    "jetson-nano": Board(5.0, 300.0),
    "generic-x86": Board(80.0, 500.0),
}

COMPRESSION_RATIO = {"none": 1.0, "f16": 0.5, "int8": 0.25}
FLEET_KEYS = ("mix", "profile", "gflops", "bandwidth_mbps", "deadline_s", "jitter")
FLEET_KEY, OLD_FLEET_KEY = "sim_fleet", "fleet"   # the run config's key, and its old name


def fleet_in(data: Mapping, fail: Callable[[str, str], None], where: str):
    """The simulated fleet section of the run config mapping `data`: `sim_fleet:`, or its
    old name `fleet:` (it read like the `edgefl fleet` command, which runs real processes),
    still accepted with a FutureWarning naming the new one; both at once is refused."""
    if OLD_FLEET_KEY in data:
        if FLEET_KEY in data:
            fail(OLD_FLEET_KEY, f"give {FLEET_KEY} only ({OLD_FLEET_KEY} is its old name)")
        warnings.warn(f"{where}: {OLD_FLEET_KEY}: is deprecated, rename it {FLEET_KEY}: (the "
                      f"simulated fleet of the virtual clock; `edgefl fleet` is another "
                      f"thing)", FutureWarning, stacklevel=3)
        return data[OLD_FLEET_KEY]
    return data.get(FLEET_KEY)


def fleet_section(section, fail: Callable[[str, str], None]) -> dict | None:
    """The `sim_fleet:` section checked and resolved to {mix: {profile: share}, gflops: {profile:
    rate}, bandwidth_mbps: {profile: rate}, deadline_s, jitter} (None when absent). fail(key,
    problem) raises the caller's ConfigError naming the dotted key."""
    if section is None:
        return None
    if not isinstance(section, Mapping):
        fail("sim_fleet", f"must be a mapping (mix, profile, gflops, bandwidth_mbps, deadline_s) "
                      f"or {{profile: share}}, got {section!r}")
    names = profiles.profile_names()
    section = dict(section)
    shares = {k: section.pop(k) for k in list(section) if k in names}
    if shares:                          # the shorthand: profiles' shares beside the keys
        if "mix" in section:
            fail("sim_fleet.mix", f"give the shares in sim_fleet.mix or beside it, not both "
                              f"({', '.join(shares)} are beside it)")
        section["mix"] = shares
    for key in section:
        if key not in FLEET_KEYS:
            fail(f"sim_fleet.{key}", f"unknown key; valid keys: {', '.join(FLEET_KEYS)} (or a "
                                 f"mapping of profiles: {', '.join(names)})")
    if ("mix" in section) == ("profile" in section):
        fail("sim_fleet", "give sim_fleet.mix (shares by profile) or sim_fleet.profile, one "
                          "of them")
    if "profile" in section:
        name = section["profile"]
        if name not in names:
            fail("sim_fleet.profile", f"unknown profile {name!r}; valid: {', '.join(names)}")
        mix = {name: 1.0}
    else:
        raw = section["mix"]
        if not isinstance(raw, Mapping) or not raw:
            fail("sim_fleet.mix", f"must be a mapping of profile: share, got {raw!r}")
        mix = {}
        for name, share in raw.items():
            if name not in names:
                fail(f"sim_fleet.mix.{name}", f"unknown profile; valid: {', '.join(names)}")
            mix[name] = check_number(share, lambda p, n=name: fail(f"sim_fleet.mix.{n}", p),
                                     minimum=0)
        if not math.isclose(sum(mix.values()), 1.0, abs_tol=1e-6):
            fail("sim_fleet.mix", f"the shares add up to {sum(mix.values()):g}, not 1")
    out = {"mix": mix}
    for key, unit in (("gflops", "GFLOP/s"), ("bandwidth_mbps", "Mbit/s")):
        given = section.get(key, {})
        one = not isinstance(given, Mapping)      # one rate for every board
        rates = {}
        for name, value in ({"": given} if one else given).items():
            where = f"sim_fleet.{key}" if one else f"sim_fleet.{key}.{name}"
            if not one and name not in names:
                fail(where, f"unknown profile; valid: {', '.join(names)}")
            rate = check_number(value, lambda p, w=where: fail(w, p))
            if not rate > 0:
                fail(where, f"{rate} {unit} must be > 0")
            rates[name] = rate
        if one:
            rates = {name: rates[""] for name in mix}
        out[key] = {name: rates.get(name, getattr(BOARDS[name], key)) for name in mix}
    deadline = check_number(section.get("deadline_s", 0),
                            lambda p: fail("sim_fleet.deadline_s", p), minimum=0)
    out["deadline_s"] = deadline
    out["jitter"] = check_number(section.get("jitter", 0), lambda p: fail("sim_fleet.jitter", p),
                                 minimum=0, maximum=2)
    return out


def refuse_over_broker(config) -> None:
    """ConfigError when the run config `config` (a RunConfig) has a simulated fleet and its
    rounds go through a broker (`edgefl simulate --transport mqtt`, `edgefl aggregator`, the
    aggregator service): the boards there are real and their own speeds order the updates,
    so the virtual clock is refused rather than ignored. The one home of that refusal."""
    if config.fleet is not None:
        raise ConfigError(f"{config.path or '<config>'}: sim_fleet: a simulated fleet (the "
                          f"virtual clock) runs in edgefl simulate in process only "
                          f"(--transport inproc); over a broker the boards are real and their "
                          f"own speeds order the updates")


def compression_ratio(profile: str) -> float:
    """Bytes on the wire per float32 byte for a profile (its transport.compression)."""
    with open(profiles.profile_path(profile), encoding="utf-8") as f:
        data = load_yaml(f) or {}
    codec = (data.get("transport") or {}).get("compression", "none")
    if codec not in COMPRESSION_RATIO:
        raise ConfigError(f"{profiles.profile_path(profile)}: transport.compression {codec!r}; "
                          f"valid: {', '.join(COMPRESSION_RATIO)}")
    return COMPRESSION_RATIO[codec]


def assign_profiles(mix: Mapping[str, float], clients, rng) -> dict:
    """{client: profile}: each profile gets round(share * N) clients (largest remainders
    settle the total), dealt to the clients in an order drawn from `rng`."""
    clients = sorted(clients)
    n = len(clients)
    names = sorted(mix)
    exact = {name: mix[name] * n for name in names}
    counts = {name: int(math.floor(exact[name])) for name in names}
    rest = sorted(names, key=lambda name: (-(exact[name] - counts[name]), name))
    for name in rest[:n - sum(counts.values())]:
        counts[name] += 1
    labels = [name for name in names for _ in range(counts[name])]
    order = rng.permutation(n)
    return {clients[int(i)]: labels[j] for j, i in enumerate(order)}


def boards_of(fleet: Mapping) -> dict:
    """{profile: Board} of a resolved fleet section."""
    return {name: Board(fleet["gflops"][name], fleet["bandwidth_mbps"][name])
            for name in fleet["mix"]}
