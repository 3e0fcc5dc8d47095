"""Device profiles and the layered service configuration (issue #6 items 4 and 5): the
shipped profiles, the order defaults -> profile -> site file -> command line, the source of
every value, `edgefl config show`, and errors that name the file, line, key and valid values."""
import json
import os
import re

import numpy as np
import pytest
import yaml

from edgefl import kernels
from edgefl.cli import main
from edgefl.config import ConfigError
from edgefl.models import build_model
from edgefl.service import profiles
from edgefl.service.layered import KEYS, ROLES, defaults_path, load_service_config

BOARDS = ["generic-x86", "jetson-nano", "rpi-zero2w", "rpi3", "rpi4", "rpi5"]
NO_SITE = "/nonexistent/edgefl-test"          # etc_dir without site files


def write(path, text):
    path.write_text(text)
    return str(path)


def client(site=None, **kw):
    kw.setdefault("etc_dir", NO_SITE)
    return load_service_config("client", site, **kw)


# ---------------------------------------------------------------------------------------
# the shipped profiles
# ---------------------------------------------------------------------------------------

def test_the_six_boards_are_shipped():
    assert profiles.profile_names() == BOARDS


def test_devices_profiles_are_copies_of_the_packaged_ones():
    """devices/profiles/ is where a board owner looks; edgefl/profiles/ is what the installed
    package reads (package data). Like the units, the two must not drift."""
    devices = os.path.join(os.path.dirname(__file__), "..", "devices", "profiles")
    assert sorted(f[:-5] for f in os.listdir(devices) if f.endswith(".yaml")) == BOARDS
    for name in BOARDS:
        with open(os.path.join(devices, f"{name}.yaml"), "rb") as copy, \
                open(profiles.profile_path(name), "rb") as packaged:
            assert copy.read() == packaged.read(), \
                f"devices/profiles/{name}.yaml differs from edgefl/profiles/{name}.yaml: copy it"


@pytest.mark.parametrize("name", BOARDS)
def test_profile_opens_with_its_board_and_sets_every_board_key(name):
    path = profiles.profile_path(name)
    with open(path) as f:
        first = f.readline()
        data = yaml.safe_load(first + f.read())
    assert first.startswith("# "), f"{path} must open with a comment on the board"
    board = profiles.board_summary(name)         # the first sentence: CPU, cores, RAM
    assert board.endswith(".") and board in profiles.board_comment(name)
    assert re.search(r"\dx Arm Cortex-A\d+|x86-64 .*\d+ cores", board), board
    assert re.search(r"\d+ (MB|GB)", board), board
    flat = {name if name == "suggested_model" else f"{name}.{key}"
            for name, section in data.items()
            for key in ([None] if name == "suggested_model" else section)}
    assert flat == set(profiles.PROFILE_KEYS), f"{path}: sets {sorted(flat)}"
    assert data["transport"]["compression"] in ("none", "f16", "int8")
    assert data["compute"]["memory_budget_mb"] >= 64


@pytest.mark.parametrize("name", BOARDS)
def test_every_profile_resolves_for_every_role(name, tmp_path):
    model = tmp_path / "model.onnx"
    for role, extra in [("client", ["node.id=a", "data.name=digits"]),
                        ("aggregator", ["node.id=agg", "run=quickstart"]),
                        ("infer", [f"infer.model={model}"])]:
        config = load_service_config(role, None, profile=name, etc_dir=NO_SITE,
                                     overrides=[f"--set {x}"[6:] for x in extra])
        assert config.profile == name
        for key in profiles.PROFILE_KEYS:
            if key in config:
                assert config.source(key).file == profiles.profile_path(name), key


@pytest.mark.parametrize("name", BOARDS)
def test_suggested_model_builds_and_its_comment_is_right(name):
    config = client(profile=name, overrides=["node.id=a", "data.name=digits"])
    model = build_model(config["suggested_model"], (1, 28, 28), 10)
    with open(profiles.profile_path(name)) as f:
        line = next(line for line in f if line.startswith("suggested_model:"))
    stated = re.search(r"#.*?([\d,]+) parameters", line)
    assert stated, f"{name}: say the suggested model's size in a comment"
    assert int(stated.group(1).replace(",", "")) == model.n_params
    x = np.random.default_rng(0).standard_normal((2, 1, 28, 28)).astype(np.float32)
    assert kernels.forward(model, model.init(0), x).shape == (2, 10)
    assert config["train.batch_size"] >= 1


def test_defaults_file_declares_every_key_once():
    needs = {"client": ["node.id=a", "data.name=digits"], "infer": ["infer.model=/m.onnx"],
             "aggregator": ["node.id=a", "run=quickstart"]}
    config = {role: load_service_config(role, None, profile="rpi4", etc_dir=NO_SITE,
                                        overrides=needs[role])
              for role in ROLES}
    seen = set()
    for role, c in config.items():
        assert set(c.values) == {k for k, key in KEYS.items() if role in key.roles}
        seen |= set(c.values)
    assert seen == set(KEYS)


# ---------------------------------------------------------------------------------------
# layers and sources
# ---------------------------------------------------------------------------------------

def test_each_layer_overrides_the_one_below_and_is_named_as_the_source(tmp_path):
    site = write(tmp_path / "client-07.yaml", """\
profile: rpi4
node:
  id: "07"
data: {name: digits}
train:
  batch_size: 8
log:
  level: warning
""")
    config = client(site, overrides=["log.level=debug"])
    rpi4 = profiles.profile_path("rpi4")
    # package default (no layer above sets it)
    assert config["broker.url"] == "mqtt://localhost:1883"
    assert config.source("broker.url").file == defaults_path()
    assert str(config.source("broker.url")).startswith(f"{defaults_path()}:")
    # profile over default
    assert config["compute.threads"] == yaml.safe_load(open(rpi4))["compute"]["threads"]
    assert config.source("compute.threads").layer == "device profile"
    assert config.source("compute.threads").file == rpi4
    # site over profile, with line and key
    assert config["train.batch_size"] == 8
    source = config.source("train.batch_size")
    assert (source.layer, source.file, source.line, source.key) == ("site file", site, 6,
                                                                    "train.batch_size")
    assert str(source) == f"{site}:6: train.batch_size"
    # command line over site
    assert config["log.level"] == "debug"
    assert str(config.source("log.level")) == "--set log.level=debug"
    assert config["node.id"] == "07"


def test_profile_choice_command_line_then_site_then_auto(tmp_path):
    site = write(tmp_path / "s.yaml", 'profile: rpi3\nnode: {id: a}\ndata: {name: digits}\n')
    assert client(site).profile == "rpi3"
    assert client(site, profile="rpi5").profile == "rpi5"
    assert client(site, overrides=["profile=jetson-nano"]).profile == "jetson-nano"
    model = write(tmp_path / "model", "Raspberry Pi Zero 2 W Rev 1.0\0")
    auto = client(None, overrides=["node.id=a", "data.name=digits"], device_tree_model=model)
    assert auto.profile == "rpi-zero2w"
    assert "Raspberry Pi Zero 2 W" in auto.source("profile").note
    assert auto["train.batch_size"] == 16          # rpi-zero2w.yaml's value


def test_site_file_and_set_read_exponent_floats_as_numbers(tmp_path):
    # as run configs do (edgefl.config.load_yaml): `deadline: 1e2` is 100 s, not a string
    site = write(tmp_path / "s.yaml", "node: {id: a}\nround: {deadline: 1e2}\n")
    config = load_service_config("aggregator", str(site), overrides=["round.quorum=5e-1"])
    assert config["round.deadline"] == 100.0 and config["round.quorum"] == 0.5


def test_site_file_default_path_is_used_when_present(tmp_path):
    write(tmp_path / "client.yaml", "node: {id: from-etc}\ndata: {name: digits}\nprofile: rpi4\n")
    config = load_service_config("client", None, etc_dir=str(tmp_path))
    assert config["node.id"] == "from-etc"
    assert config.source("node.id").file == str(tmp_path / "client.yaml")


def test_set_on_a_dataset_option_keeps_the_site_dataset(tmp_path):
    site = write(tmp_path / "s.yaml",
                 "profile: rpi4\nnode: {id: a}\ndata: {name: npz, path: shard.npz, "
                 "test_fraction: 0.2}\n")
    config = client(site, overrides=["data.limit_train=100"])
    assert config["data"] == {"name": "npz", "path": str(tmp_path / "shard.npz"),
                              "test_fraction": 0.2, "limit_train": 100}
    assert "over " + site in str(config.source("data"))
    # a different dataset replaces the section (npz's options would not fit digits)
    assert client(site, overrides=["data.name=digits"])["data"] == {"name": "digits"}



def test_successive_set_items_of_one_section_build_it(tmp_path, capsys):
    # `--set data.name=X --set data.OPTION=V` is how a board without a site file (or one
    # changing its data set) names its data on one command line; the second item used to
    # replace the first, leaving a section without a name (or npz without its path)
    bare = write(tmp_path / "bare.yaml", "profile: rpi4\n")     # a site file without data
    assert main(["config", "show", "--role", "client", "--config", bare, "--set", "node.id=a",
                 "--set", "data.name=digits", "--set", "data.limit_train=100", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert json.loads(out)["values"]["data"] == {"name": "digits", "limit_train": 100}
    # over a site file's data section: the named section built on the command line
    # replaces the site's (npz's path is checked with its name, not before it comes)
    site = write(tmp_path / "c0.yaml", "profile: rpi4\nnode: {id: c0}\n"
                                       "data: {name: digits, limit_train: 50}\n")
    shard = str(tmp_path / "x.npz")
    config = client(site, overrides=["data.name=npz", f"data.path={shard}"])
    assert config["data"] == {"name": "npz", "path": shard}
    assert str(config.source("data")) == f"--set data.name=npz --set data.path={shard}"
    # nameless items still update the site's section, all of them
    config = client(site, overrides=["data.limit_train=100", "data.limit_test=20"])
    assert config["data"] == {"name": "digits", "limit_train": 100, "limit_test": 20}
    # a whole section given later replaces what the earlier items built
    assert client(site, overrides=["data.limit_train=100", "data={name: mnist}"]
                  )["data"] == {"name": "mnist"}
    # and a bad option of the built section is named with the items that built it
    with pytest.raises(ConfigError, match=r"^--set data.name=digits --set data.colour=red: "
                                          r"data: unknown option 'colour'"):
        client(site, overrides=["data.name=digits", "data.colour=red"])

def test_state_dir_falls_back_to_systemd_state_directory(tmp_path, monkeypatch):
    config = client(None, profile="rpi4", overrides=["node.id=a", "data.name=digits"])
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/edgefl/client-a:/var/lib/other")
    assert config.state_dir == "/var/lib/edgefl/client-a"
    monkeypatch.delenv("STATE_DIRECTORY")
    with pytest.raises(ConfigError, match=r"state_dir is not set .*STATE_DIRECTORY"):
        _ = config.state_dir
    explicit = client(None, profile="rpi4",
                      overrides=["node.id=a", "data.name=digits", f"state_dir={tmp_path}"])
    assert explicit.state_dir == str(tmp_path)


def test_values_cannot_be_changed_through_the_config():
    config = client(None, profile="rpi4", overrides=["node.id=a", "data.name=digits"])
    config["data"]["name"] = "changed"
    assert config["data"] == {"name": "digits"}
    with pytest.raises(TypeError):
        config.values["node.id"] = "b"


# ---------------------------------------------------------------------------------------
# errors: file, line, key, valid values
# ---------------------------------------------------------------------------------------

def test_unknown_profile_lists_the_valid_ones(tmp_path):
    site = write(tmp_path / "s.yaml", "profile: rpi9\n")
    with pytest.raises(ConfigError) as exc:
        client(site)
    assert str(exc.value) == (f"{site}:1: profile: unknown profile 'rpi9'; valid profiles: "
                              f"{', '.join(BOARDS)}, auto")
    with pytest.raises(ConfigError, match=r"^--profile pi4: unknown profile 'pi4'; valid"):
        client(None, profile="pi4")


@pytest.mark.parametrize("text, message", [
    ("transport:\n  compression: gzip\n",
     r":2: transport.compression: 'gzip' is not valid; valid: none, f16, int8$"),
    ("compute:\n  thread: 2\n",
     r":2: compute.thread: unknown key \(did you mean compute.threads\?\); valid keys in "
     r"compute: max_batch_size, max_params, memory_budget_mb, threads$"),
    ("brokr:\n  url: x\n", r":1: brokr: unknown key \(did you mean broker\?\); valid top-level"),
    ("compute:\n  threads: -1\n", r":2: compute.threads: -1 is below the minimum 0$"),
    ("compute:\n  threads: two\n", r":2: compute.threads: must be an integer, got 'two'$"),
    ("transport: 3\n", r":1: transport: transport is a section \(keys: compression, chunk_size\)"),
    ("node:\n  id: 07\n", r":2: node.id: must be a string, but YAML reads 07 as the number 7; "
                          r"quote it: '07' -> '\"07\"'$"),
    ("node:\n  id: a/b\n", r":2: node.id: 'a/b' contains '/' \(a topic separator or "
                          r"wildcard\); an id is one MQTT topic level$"),
    # the transport's rule: a C1 control character is refused here, not first by the role
    ('node:\n  id: "a\\x85b"\n', r":2: node.id: 'a\\x85b' contains control character "
                                r"U\+0085; an id is one MQTT topic level$"),
    ("run: quickstart\n", r":1: run: not a setting of the client \(read by the aggregator\); "
                          r"valid keys for the client: profile, "),
    ("data: {name: imagenet}\n", r":1: data: unknown dataset 'imagenet'; valid: digits, mnist"),
    ("data: {name: digits, colour: red}\n",
     r":1: data: unknown option 'colour' of dataset 'digits'; valid: name"),
    ("suggested_model: {name: mlp, width: 3}\n",
     r":1: suggested_model: model mlp: width: unknown option of model mlp; valid: name, hidden"),
    ("compute: [1, 2\n", r":2: invalid YAML: expected ',' or ']'"),
    ("- a\n- b\n", r": the top level must be a mapping of settings, got list$"),
])
def test_site_file_errors_name_file_line_key_and_valid_values(tmp_path, text, message):
    # checked where written: --set node.id and data.name win, the file's values still fail
    site = write(tmp_path / "site.yaml", text)
    with pytest.raises(ConfigError) as exc:
        client(site, profile="rpi4", overrides=["node.id=a", "data.name=digits"])
    assert str(exc.value).startswith(site), str(exc.value)
    assert re.search(message, str(exc.value)), str(exc.value)


def test_a_site_file_not_in_utf8_is_named(tmp_path, capsys):
    """A site file saved as UTF-16 (an editor's "Unicode") or Latin-1: every command that
    reads it said only "'utf-8' codec can't decode byte 0xff in position 0", naming no
    file, where a run config's error names it."""
    site = tmp_path / "aggregator.yaml"
    for data, byte, offset in (("node: {id: a}\n".encode("utf-16"), 0xff, 0),
                               ("node: {id: caf\u00e9}\n".encode("latin-1"), 0xe9, 14)):
        site.write_bytes(data)
        assert main(["config", "show", "--role", "aggregator", "--config", str(site)]) == 1
        err = capsys.readouterr().err
        assert err == (f"edgefl config: error: {site}: not UTF-8 text (byte 0x{byte:02x} at "
                       f"offset {offset}); a site file is a YAML file in UTF-8\n"), err


def test_command_line_errors_name_the_set_item():
    with pytest.raises(ConfigError, match=r"^--set infer.threads=2: infer.threads is not a "
                                          r"setting of the client \(read by the inference "
                                          r"service\)"):
        client(None, profile="rpi4", overrides=["infer.threads=2"])
    with pytest.raises(ConfigError, match=r"^--set log.level=loud: log.level: 'loud' is not "
                                          r"valid; valid: debug, info, warning, error, critical"):
        client(None, profile="rpi4", overrides=["log.level=loud"])
    with pytest.raises(ConfigError, match=r"^--set nokey: expected dotted.key=value"):
        client(None, profile="rpi4", overrides=["nokey"])


def test_missing_required_setting_names_key_and_where_to_set_it(tmp_path):
    site = write(tmp_path / "s.yaml", "profile: rpi4\nnode: {id: a}\n")
    with pytest.raises(ConfigError) as exc:
        client(site)
    assert str(exc.value) == (f"data: not set, and the client needs it (the client's training "
                              f"data: a dataset section (docs/data.md)); set it in the site file "
                              f"{site} or with --set data=...")
    with pytest.raises(ConfigError, match=r"^infer.model: not set, and the inference service"):
        load_service_config("infer", None, profile="rpi4", etc_dir=NO_SITE)
    # with no site file at all, the message says none was read (not "set it in the site
    # file", as if one were there)
    with pytest.raises(ConfigError) as exc:
        load_service_config("aggregator", None, profile="rpi4", etc_dir=NO_SITE)
    assert str(exc.value) == (f"node.id: not set, and the aggregator needs it (this node's id "
                              f"(one MQTT topic level)); no site file was read "
                              f"({NO_SITE}/aggregator.yaml does not exist): write one there or "
                              f"name one with --config FILE, or set node.id with --set "
                              f"node.id=...")
    # the aggregator needs no run: it waits for runs started on the control topic
    assert load_service_config("aggregator", None, profile="rpi4", etc_dir=NO_SITE,
                               overrides=["node.id=agg"])["run"] is None


def test_aggregator_run_config_must_exist(tmp_path):
    site = write(tmp_path / "aggregator.yaml", "profile: generic-x86\nnode: {id: agg}\n"
                                               "run: runs/missing.yaml\n")
    with pytest.raises(ConfigError, match=r"aggregator.yaml:3: run: .*missing.yaml: config file "
                                          r"does not exist, and it is not a built-in config"):
        load_service_config("aggregator", site)
    run = tmp_path / "fed.yaml"
    run.write_text("rounds: 2\n")
    write(tmp_path / "aggregator.yaml", "profile: generic-x86\nnode: {id: agg}\nrun: fed.yaml\n")
    assert load_service_config("aggregator", site)["run"] == str(run)


def test_profile_may_set_only_board_keys(tmp_path, monkeypatch):
    fake = tmp_path / "edgefl-profiles"
    fake.mkdir()
    (fake / "bad-board.yaml").write_text("# A board\nbroker:\n  url: mqtt://x\n")
    monkeypatch.setattr(profiles, "_profile_dir", lambda: fake)
    with pytest.raises(ConfigError, match=r"bad-board.yaml:3: broker.url: a device profile may "
                                          r"set only the board-dependent keys \(compute.threads"):
        client(None, profile="bad-board", overrides=["node.id=a", "data.name=digits"])


def test_unknown_board_under_auto_asks_for_a_profile(tmp_path, monkeypatch):
    model = write(tmp_path / "model", "Raspberry Pi Model B Rev 2\0")
    monkeypatch.setattr(profiles.platform, "machine", lambda: "armv6l")
    with pytest.raises(ConfigError) as exc:
        client(None, overrides=["node.id=a", "data.name=digits"], device_tree_model=model)
    assert "profile auto: board 'Raspberry Pi Model B Rev 2'" in str(exc.value)
    assert str(exc.value).endswith("set profile to one of " + ", ".join(BOARDS))


# ---------------------------------------------------------------------------------------
# board detection, threads, memory
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("model, machine, expected", [
    ("Raspberry Pi Zero 2 W Rev 1.0", "aarch64", "rpi-zero2w"),
    ("Raspberry Pi 3 Model B Plus Rev 1.3", "aarch64", "rpi3"),
    ("Raspberry Pi 4 Model B Rev 1.4", "aarch64", "rpi4"),
    ("Raspberry Pi 400 Rev 1.0", "aarch64", "rpi4"),
    ("Raspberry Pi Compute Module 4 Rev 1.0", "armv7l", "rpi4"),
    ("Raspberry Pi 5 Model B Rev 1.0", "aarch64", "rpi5"),
    ("NVIDIA Jetson Nano Developer Kit", "aarch64", "jetson-nano"),
    (None, "x86_64", "generic-x86"),
    ("Raspberry Pi Zero W Rev 1.1", "armv6l", None),     # ARMv6: no wheels, no profile
    (None, "riscv64", None),
])
def test_detect_profile(tmp_path, model, machine, expected):
    path = tmp_path / "model"
    if model is not None:
        path.write_bytes(model.encode() + b"\0")
    name, how = profiles.detect_profile(str(path), machine)
    assert name == expected, how
    if model is not None:
        assert model in how


def test_apply_threads():
    have_blas = getattr(kernels.impl, "have_blas", lambda: False)()
    n = len(os.sched_getaffinity(0))
    try:
        assert profiles.apply_threads(0) == (n if have_blas else 1)
        assert profiles.apply_threads(2) == (2 if have_blas else 1)
    finally:
        if have_blas:
            kernels.impl.blas_set_threads(1)    # what kernels.py sets at import
    with pytest.raises(ValueError, match=r"compute.threads = -1: need an integer >= 0"):
        profiles.apply_threads(-1)


def test_memory_budget():
    import gc

    # The process's resident memory moves by itself when something else frees memory
    # meanwhile: garbage of earlier tests collected (a memory-mapped data set unmapped), a
    # leftover thread's buffers. Seen once in CI: 64 MiB touched, VmRSS only 40 MiB up. So
    # the garbage goes first, and a block is allowed three tries to show.
    gc.collect()
    for _ in range(3):
        rss = profiles.resident_mb()
        assert 16 < rss <= profiles.resident_mb(peak=True)   # Python + NumPy exceed 16 MiB
        block = np.ones(16 << 20, dtype=np.float32)           # 64 MiB, touched: resident
        grown = profiles.resident_mb() - rss
        if grown > 48:
            break
        del block
    assert grown > 48, f"VmRSS grew {grown:.1f} MiB for a 64 MiB block touched"
    budget = int(profiles.resident_mb()) + 256
    assert profiles.check_memory_budget(budget, "now") < budget
    with pytest.raises(profiles.MemoryBudgetError,
                       match=r"^\d+ MiB resident after loading data, over "
                             r"compute.memory_budget_mb = 16: train on fewer samples"):
        profiles.check_memory_budget(16, "after loading data")


# ---------------------------------------------------------------------------------------
# edgefl config show
# ---------------------------------------------------------------------------------------

def test_config_show_prints_values_and_sources(tmp_path, capsys):
    site = write(tmp_path / "client-07.yaml",
                 'profile: rpi4\nnode:\n  id: "07"\ndata: {name: digits}\n')
    assert main(["config", "show", "--config", site, "--set", "train.batch_size=8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("edgefl client: profile rpi4\n  board: Raspberry Pi 4 Model B")
    rows = {line.split()[0]: line for line in out.splitlines()[8:] if line.strip()}
    assert re.match(r"node.id +07 +" + re.escape(f"{site}:3: node.id") + "$", rows["node.id"])
    assert rows["train.batch_size"].endswith("--set train.batch_size=8")
    assert rows["compute.threads"].endswith(f"{profiles.profile_path('rpi4')}:5: compute.threads")
    assert "infer.threads" not in rows            # not a client setting


def test_config_show_takes_config_like_every_command_and_site_as_its_alias(tmp_path, capsys):
    site = write(tmp_path / "client.yaml",
                 'profile: rpi4\nnode:\n  id: "07"\ndata: {name: digits}\n')
    shown = []
    for option in ("--config", "--site"):
        assert main(["config", "show", option, site, "--json"]) == 0
        shown.append(json.loads(capsys.readouterr().out))
    assert shown[0] == shown[1] and shown[0]["sources"]["node.id"]["file"] == site


def test_config_show_json_and_roles(tmp_path, capsys):
    assert main(["config", "show", "--role", "infer", "--profile", "rpi5", "--site",
                 write(tmp_path / "infer.yaml", "infer: {model: m.onnx}\n"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["role"] == "infer" and doc["profile"] == "rpi5"
    assert doc["values"]["infer"]["model"] == str(tmp_path / "m.onnx")
    assert doc["sources"]["infer.model"]["line"] == 1
    assert doc["sources"]["profile"]["file"] == "--profile rpi5"
    assert [layer["layer"] for layer in doc["layers"]] == [
        "package defaults", "device profile", "site file", "command line"]


def test_config_show_error_is_one_line_naming_the_cause(tmp_path, capsys):
    site = write(tmp_path / "s.yaml", "profile: rpi4\ntrain:\n  batch_size: 0\n")
    assert main(["config", "show", "--config", site]) == 1
    err = capsys.readouterr().err
    assert err == (f"edgefl config: error: {site}:3: train.batch_size: 0 is below the "
                   f"minimum 1\n")


# ---------------------------------------------------------------------------------------
# the role settings classes: one source of defaults and checks with the site files
# ---------------------------------------------------------------------------------------

def test_role_settings_take_the_services_defaults_and_keys():
    from edgefl.roles.aggregator import AGGREGATOR_KEYS, AggregatorSettings
    from edgefl.roles.client import CLIENT_KEYS, ClientSettings
    from edgefl.service.layered import default

    with open(defaults_path()) as f:
        shipped = yaml.safe_load(f)

    def written(key):             # the value as defaults.yaml writes it
        node = shipped
        for part in key.split("."):
            node = node[part]
        return node

    for cls, keys, role in ((AggregatorSettings, AGGREGATOR_KEYS, "aggregator"),
                            (ClientSettings, CLIENT_KEYS, "client")):
        settings = cls() if cls is AggregatorSettings else cls("c-1")
        for name, key in keys.items():
            assert role in KEYS[key].roles, f"{cls.__name__}.{name}: {key} is not read by {role}"
            if name in ("max_params", "max_batch_size", "memory_budget_mb"):
                assert getattr(settings, name) is None        # a simulation's: no limit
                continue
            assert getattr(settings, name) == default(key) == written(key), \
                f"{cls.__name__}.{name} vs {key}"


def test_role_settings_from_a_site_file_and_their_checks(tmp_path):
    from edgefl.roles import AggregatorSettings, ClientSettings

    site = write(tmp_path / "client.yaml",
                 "profile: rpi4\nnode: {id: pi-07, federation: lab}\ndata: {name: digits}\n"
                 "transport: {compression: f16, chunk_size: 4096}\n"
                 "limits: {reassembly_mb: 3, chunks_per_sender: 40}\n"
                 "compute: {max_params: 5000}\n")
    settings = ClientSettings.from_service_config(client(site), exit_when_finished=True)
    assert (settings.node_id, settings.federation, settings.compression, settings.max_payload,
            settings.reassembly_bytes, settings.chunks_per_sender, settings.max_params,
            settings.memory_budget_mb, settings.profile, settings.exit_when_finished) == \
        ("pi-07", "lab", "f16", 4096, 3 << 20, 40, 5000,
         client(site)["compute.memory_budget_mb"], "rpi4", True)
    # a field is checked by its key's rule, and the error names both
    for make, message in [
            (lambda: AggregatorSettings(round_timeout_s=0.05),
             r"^AggregatorSettings.round_timeout_s \(round.deadline\): 0.05 is below the "
             r"minimum 0.1$"),
            (lambda: AggregatorSettings(quorum=1.5),
             r"^AggregatorSettings.quorum \(round.quorum\): 1.5 is above the maximum 1$"),
            (lambda: AggregatorSettings(min_updates=True),
             r"^AggregatorSettings.min_updates \(round.min_updates\): must be an integer"),
            (lambda: AggregatorSettings(compression="zstd"),
             r"^AggregatorSettings.compression \(transport.compression\): 'zstd' is not "
             r"valid; valid: none, f16, int8$"),
            (lambda: ClientSettings("c", memory_budget_mb=8),
             r"^ClientSettings.memory_budget_mb \(compute.memory_budget_mb\): 8 is below the "
             r"minimum 16$"),
            (lambda: ClientSettings("c", max_payload=512),
             r"^ClientSettings.max_payload \(transport.chunk_size\): 512 is below the "
             r"minimum 1024$")]:
        with pytest.raises(ConfigError, match=message):
            make()


def test_aggregator_options_are_command_line_settings(tmp_path, capsys):
    """--deadline / --quorum / --min-updates / --clients of `edgefl aggregator` are the top
    layer of round.* and clients: shown as their source, checked as the keys are."""
    site = write(tmp_path / "aggregator.yaml",
                 "profile: generic-x86\nnode: {id: agg}\nround: {deadline: 45}\n")
    config = load_service_config("aggregator", site, flags={
        "round.deadline": ("--deadline 60.0", 60.0), "clients": ("--clients a,b", "a,b")})
    assert (config["round.deadline"], config["clients"]) == (60.0, ["a", "b"])
    assert str(config.source("round.deadline")) == "--deadline 60.0"
    assert config["round.quorum"] == 1.0 and config.source("round.quorum").layer == \
        "package defaults"
    code = main(["aggregator", "--config", site, "--deadline", "0", "--set",
                 f"state_dir={tmp_path}"])
    assert code == 1
    assert capsys.readouterr().err.strip() == \
        "edgefl aggregator: error: --deadline 0.0: round.deadline: 0.0 is below the minimum 0.1"
