"""Partitioners (disjoint, complete, seeded, and each one's defining property), the config
sections that describe a run's data, and `edgefl partition`."""
import os
import re

import numpy as np
import pytest
import yaml

from edgefl.cli import main
from edgefl.config import ConfigError, dataset_from_config, load_config, partition_from_config
from edgefl.data import PARTITIONERS, load_dataset, partition
from edgefl.data.partition import dirichlet, label_noise, mod, quantity, shards


@pytest.fixture(scope="module")
def synthetic():
    return load_dataset("synthetic", alpha=1.0, beta=1.0, clients=12, samples_per_client=60)


# name -> (options, n_clients, dataset fixture); each is split on a real dataset's labels
CASES = {
    "iid": ({}, 10, "digits"),
    "shards": ({"classes_per_client": 2}, 10, "digits"),
    "dirichlet": ({"alpha": 0.3}, 10, "digits"),
    "quantity": ({"sigma": 0.8}, 10, "digits"),
    "label-noise": ({"max_rate": 0.4}, 10, "digits"),
    "mod": ({}, 20, "digits"),   # N > classes: the randomised FedVeca spread
    "natural": ({}, 12, "synthetic"),
}


def test_every_partitioner_is_covered():
    assert set(CASES) == set(PARTITIONERS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_partition_is_disjoint_complete_sorted_and_nonempty(name, request):
    options, n_clients, fixture = CASES[name]
    ds = request.getfixturevalue(fixture)
    split = partition(ds, name, n_clients, seed=0, **options)
    assert len(split.indices) == n_clients
    everything = np.concatenate(split.indices)
    assert len(everything) == len(np.unique(everything)), "a sample went to two clients"
    np.testing.assert_array_equal(np.sort(everything), np.arange(len(ds.y_train)))
    for idx in split.indices:
        assert idx.dtype == np.int64 and len(idx) >= 1
        assert np.all(np.diff(idx) > 0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_seed_same_split_and_another_seed_another(name, request):
    options, n_clients, fixture = CASES[name]
    ds = request.getfixturevalue(fixture)
    a = partition(ds, name, n_clients, seed=7, **options)
    b = partition(ds, name, n_clients, seed=7, **options)
    for x, y in zip(a.indices, b.indices):
        np.testing.assert_array_equal(x, y)
    if a.labels is not None:
        for x, y in zip(a.labels, b.labels):
            np.testing.assert_array_equal(x, y)
    if name == "natural":
        return   # the owners fix the split; no randomness to vary
    c = partition(ds, name, n_clients, seed=8, **options)
    differs = any(not np.array_equal(x, y) for x, y in zip(a.indices, c.indices))
    if a.labels is not None:
        differs |= any(not np.array_equal(x, y) for x, y in zip(a.labels, c.labels))
    assert differs


def label_mixes(labels, split, n_classes):
    return np.array([np.bincount(labels[idx], minlength=n_classes) / len(idx)
                     for idx in split.indices])


def test_dirichlet_small_alpha_is_more_skewed_than_large_alpha(digits):
    def skew(alpha):
        # mean over clients and seeds of the largest class share; 0.1 is perfectly balanced
        splits = [partition(digits, "dirichlet", 10, s, alpha=alpha) for s in range(5)]
        return np.mean([label_mixes(digits.y_train, split, 10).max(axis=1).mean()
                        for split in splits])
    small, large = skew(0.1), skew(100.0)
    assert small > 0.45 and large < 0.2 and small > 2.5 * large


def test_dirichlet_redraws_until_every_client_has_min_size(digits):
    # one draw alone leaves some client below 40 samples most of the time (~84% here)
    single = [dirichlet(digits.y_train, 20, np.random.default_rng(s), alpha=0.5, min_size=1,
                        max_draws=1).sizes.min() for s in range(5)]
    assert min(single) < 40
    for seed in range(5):
        split = dirichlet(digits.y_train, 20, np.random.default_rng(seed), alpha=0.5, min_size=40)
        assert split.sizes.min() >= 40


def test_dirichlet_gives_a_client_at_its_share_no_further_class(digits):
    # FedMR's separate_data: classes are split in label order, and a client already holding
    # n/N samples or more gets p_j = 0 for every later class, so no client piles up classes
    # far past its share (small alpha sends most of a class to one client). The cuts are
    # truncated cumulative sums, so the last client may get one sample of the remainder.
    y = digits.y_train
    cap = len(y) / 10
    for seed in range(5):
        split = dirichlet(y, 10, np.random.default_rng(seed), alpha=0.1, min_size=1)
        for idx in split.indices:
            counts = np.bincount(y[idx], minlength=10)
            held_before = np.concatenate([[0], np.cumsum(counts)[:-1]])
            assert counts[held_before >= cap].max(initial=0) <= 1, (seed, counts.tolist())


def test_dirichlet_impossible_minimum_is_a_clear_error(digits):
    with pytest.raises(ValueError,
                       match="min_size=200 for 10 clients needs 2000 samples, but there are 1438"):
        partition(digits, "dirichlet", 10, 0, min_size=200)
    with pytest.raises(ValueError,
                       match="none of 3 draws gave every one of 10 clients at least min_size=140"):
        partition(digits, "dirichlet", 10, 0, alpha=0.01, min_size=140, max_draws=3)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_shards_give_at_most_k_classes_and_near_equal_sizes(digits, k):
    split = partition(digits, "shards", 10, 3, classes_per_client=k)
    for idx in split.indices:
        assert len(np.unique(digits.y_train[idx])) <= k
    assert split.sizes.max() - split.sizes.min() <= 0.1 * split.sizes.mean() + k
    # with k = 1 and one class per client, every client is pure and all classes are used
    if k == 1:
        pure = sorted(int(np.unique(digits.y_train[i])[0]) for i in split.indices)
        assert pure == list(range(10))


def test_shards_are_not_all_pure_single_class_splits(digits):
    # k = 2 over 20 shards: some client must mix two classes, or the assignment is not random
    split = partition(digits, "shards", 10, 0, classes_per_client=2)
    assert max(len(np.unique(digits.y_train[i])) for i in split.indices) == 2


def test_shards_too_few_for_the_classes_is_a_clear_error(digits):
    with pytest.raises(ValueError, match=r"2 x 3 = 6 shards cannot cover 10 classes"):
        shards(digits.y_train, 3, np.random.default_rng(0), classes_per_client=2)


def test_quantity_sizes_vary_and_sigma_zero_is_equal(digits):
    sizes = partition(digits, "quantity", 20, 0, sigma=1.0).sizes
    assert sizes.sum() == len(digits.y_train)
    assert sizes.std() / sizes.mean() > 0.4 and sizes.min() >= 1
    equal = quantity(digits.y_train, 20, np.random.default_rng(0), sigma=0.0).sizes
    assert equal.max() - equal.min() <= 1


def test_label_noise_flips_the_requested_share_to_other_classes(digits):
    rates = [0.0, 0.1, 0.25, 0.5, 1.0]
    split = partition(digits, "label-noise", 5, 0, rate=rates)
    for idx, noisy, r in zip(split.indices, split.labels, rates):
        clean = digits.y_train[idx]
        flipped = noisy != clean
        assert flipped.sum() == np.floor(r * len(idx) + 0.5)
        assert noisy.min() >= 0 and noisy.max() < 10
    # flips land on every other class, roughly uniformly
    idx, noisy = split.indices[4], split.labels[4]
    changes = (noisy - digits.y_train[idx]) % 10
    assert set(np.unique(changes)) == set(range(1, 10))


def test_label_noise_max_rate_spreads_rates_linearly(digits):
    split = label_noise(digits.y_train, 5, np.random.default_rng(1), max_rate=0.8)
    realised = [np.mean(n != digits.y_train[i]) for i, n in zip(split.indices, split.labels)]
    np.testing.assert_allclose(realised, [0.0, 0.2, 0.4, 0.6, 0.8], atol=0.005)


@pytest.mark.parametrize("options, message", [
    ({}, "set exactly one of rate"),
    ({"rate": 0.1, "max_rate": 0.2}, "set exactly one of rate"),
    ({"rate": [0.1, 0.2]}, "2 rates for 4 clients"),
    ({"rate": 1.5}, r"rates must be in \[0, 1\]"),
])
def test_label_noise_bad_rates(digits, options, message):
    with pytest.raises(ValueError, match=message):
        partition(digits, "label-noise", 4, 0, **options)


def test_mod_gives_each_client_exactly_the_labels_congruent_to_it(digits):
    split = mod(digits.y_train, 4, np.random.default_rng(0))
    expected = [{0, 4, 8}, {1, 5, 9}, {2, 6}, {3, 7}]   # MFL's Case 2 (Liu et al. 2020, Sec. 7.2), N = 4
    for i, idx in enumerate(split.indices):
        assert set(np.unique(digits.y_train[idx]).tolist()) == expected[i]
        np.testing.assert_array_equal(idx, np.flatnonzero(digits.y_train % 4 == i))


def test_mod_with_more_clients_than_classes_spreads_each_class(digits):
    split = partition(digits, "mod", 25, 0)
    for n, idx in enumerate(split.indices):
        assert set(np.unique(digits.y_train[idx]).tolist()) == {n % 10}
    class0 = [len(split.indices[n]) for n in (0, 10, 20)]
    assert max(class0) - min(class0) <= 1


def test_mod_on_even_odd_labels_splits_by_the_original_digit():
    ds = load_dataset("digits", binary="even-odd")
    split = partition(ds, "mod", 4, 0)
    for i, idx in enumerate(split.indices):
        assert np.all(ds.y_train_original[idx] % 4 == i)
        assert len(np.unique(ds.y_train[idx])) == 1   # each node pure in even/odd (MFL's Case 2)


def test_natural_follows_client_ids(synthetic):
    split = partition(synthetic, "natural", 12, 0)
    for i, idx in enumerate(split.indices):
        np.testing.assert_array_equal(idx, np.flatnonzero(synthetic.client_ids == i))
    with pytest.raises(ValueError, match="has 12 natural clients but 5 were requested"):
        partition(synthetic, "natural", 5, 0)


@pytest.mark.parametrize("owners", [[0, 1, -2, 0, 1, 1], [0, 1, 0.5, 0, 1, 1],
                                    [0, 1, float("nan"), 0, 1, 1]])   # NaN: said sample 0
def test_natural_owners_that_are_no_client_are_named(owners):
    # a sample owned by -2 or 0.5 was left out of every client, in silence
    with pytest.raises(ValueError, match=r"natural: owners must be client ids 0, 1, \.\.\. "
                                         r"or -1 \(held by no client\) \(sample 2 has"):
        partition(np.zeros(6, dtype=np.int64), "natural", 2, 0, owners=np.array(owners))


def test_natural_owners_of_a_type_that_is_no_number_are_named():
    # an object array (ids read from a text column, None for a gap) crashed the message
    # itself: AttributeError: 'int' object has no attribute 'item'
    owners = np.array([0, 1, None, 0, 1, 1], dtype=object)
    with pytest.raises(ValueError, match=r"natural: owners must be client ids .*; they are "
                                         r"of dtype object \(sample 2 has None\)"):
        partition(np.zeros(6, dtype=np.int64), "natural", 2, 0, owners=owners)


def test_natural_owner_minus_one_is_a_sample_no_client_holds():
    # tools/reproduce.py's label-set environments (DUW's Env II) leave samples unused so
    split = partition(np.zeros(6, dtype=np.int64), "natural", 2, 0,
                      owners=np.array([0, 1, -1, 0, 1, -1]))
    assert [idx.tolist() for idx in split.indices] == [[0, 3], [1, 4]]


@pytest.mark.parametrize("tile", [1, 2])
def test_a_negative_seed_is_named(tile):
    # NumPy's "expected non-negative integer" named no option
    with pytest.raises(ValueError, match=r"partition: seed must be an integer >= 0, got -1"):
        partition(np.arange(20) % 2, "iid", 4, -1, tile=tile)


def test_natural_needs_a_dataset_with_owners(digits):
    with pytest.raises(ValueError, match="no natural clients"):
        partition(digits, "natural", 3, 0)


@pytest.mark.parametrize("name", sorted(set(CASES) - {"natural"}))
def test_more_clients_than_samples_names_both_counts(name):
    labels = np.arange(6) % 3
    options = {"rate": 0.1} if name == "label-noise" else {}
    with pytest.raises(ValueError, match=f"{name}: 7 clients but only 6 training samples"):
        partition(labels, name, 7, 0, **options)


def test_a_client_left_empty_is_named():
    labels = np.array([0, 0, 0, 2, 2, 2])   # no label 1: mod 3 leaves client 1 empty
    with pytest.raises(ValueError, match=r"mod: client\(s\) \[1\] got no samples"):
        partition(labels, "mod", 3, 0)


def test_regression_targets_only_split_by_size():
    targets = np.linspace(0, 1, 50).astype(np.float32)
    assert len(partition(targets, "iid", 5, 0).indices) == 5
    with pytest.raises(ValueError, match="shards: needs integer class labels"):
        partition(targets, "shards", 5, 0)


def test_unknown_partitioner_and_option_are_named(digits):
    with pytest.raises(ValueError, match="unknown partition 'pathological'; valid: iid, shards"):
        partition(digits, "pathological", 4, 0)
    with pytest.raises(ValueError, match="partition 'dirichlet': unknown option 'beta'; valid "
                                         "options: alpha, min_size, max_draws"):
        partition(digits, "dirichlet", 4, 0, beta=1.0)


# ---------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------

CONFIG = """\
seed: 3
dataset:
  name: digits
  limit_train: 600
partition:
  name: shards
  clients: 6
  classes_per_client: 2
"""


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_config_sections_build_the_dataset_and_the_split(tmp_path):
    config = load_config(write(tmp_path, CONFIG))
    ds = dataset_from_config(config)
    split = partition_from_config(config, ds)
    assert len(ds.y_train) == 600 and len(split.indices) == 6
    expected = partition(ds, "shards", 6, 3, classes_per_client=2)
    for a, b in zip(split.indices, expected.indices):
        np.testing.assert_array_equal(a, b)


def test_overrides_are_parsed_as_yaml_and_create_sections(tmp_path):
    config = load_config(write(tmp_path, CONFIG), ["partition.clients=4", "dataset.binary=even-odd",
                                                   "train.lr=0.05", "partition.name=label-noise",
                                                   "partition.rate=[0, 0.5, 0, 0.5]"])
    assert config["partition"]["clients"] == 4 and config["train"] == {"lr": 0.05}
    assert config["partition"]["rate"] == [0, 0.5, 0, 0.5]
    removed = load_config(write(tmp_path, CONFIG), ["partition.classes_per_client=",
                                                    "partition.name=iid"])
    assert removed["partition"] == {"name": "iid", "clients": 6}
    with pytest.raises(ConfigError, match="seed is int, not a section"):
        load_config(write(tmp_path, CONFIG), ["seed.value=1"])
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(write(tmp_path, CONFIG), ["partition.clients"])


def test_exponent_floats_are_numbers_in_files_and_overrides(tmp_path):
    # YAML 1.1 (PyYAML) needs a dot in a float: 1e-3, as papers and docs write a rate, was
    # the string '1e-3' and refused as not a number; edgefl reads it as YAML 1.2 does
    config = load_config(write(tmp_path, CONFIG + "train: {lr: 1e-3, momentum: 9E-1}\n"),
                         ["strategy.tau=1e-9", "strategy.eta=-2.5e+1", "partition.clients=6"])
    assert config["train"] == {"lr": 0.001, "momentum": 0.9}
    assert config["strategy"] == {"tau": 1e-9, "eta": -25.0}
    assert type(config["partition"]["clients"]) is int       # ints stay ints
    words = load_config(write(tmp_path, "tag: e5\nversion: 1.2.3\nid: '1e3'\n"))
    assert words == {"tag": "e5", "version": "1.2.3", "id": "1e3"}   # quoted: a string
    assert yaml.safe_load("x: 1e-3") == {"x": "1e-3"}      # yaml's own loader is unchanged


def test_dumped_yaml_reads_back_as_written():
    # what edgefl writes (install-service's config, config show) is read back by the loaders
    # above: yaml's safe_dump left the string '1e5' (an id, a path) unquoted, read back as
    # 100000.0
    from edgefl.config import dump_yaml, load_yaml
    value = {"ids": ["1e5", "2E-3", "07", "on", "e5", "x"], "lr": 1e-3, "n": 7, "id": "1e5"}
    for flow in (True, False):
        text = dump_yaml(value, default_flow_style=flow, sort_keys=False)
        assert load_yaml(text) == value
    assert "'1e5'" in dump_yaml("1e5") and "e5" == dump_yaml("e5").split()[0]
    assert yaml.safe_dump("1e5").startswith("1e5")         # yaml's own dumper is unchanged


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "seed: 0\ndataset:\n  name: digits\n  limit_train: [1, 2\n")
    with pytest.raises(ConfigError, match=r"run.yaml, line \d+: invalid YAML"):
        load_config(path)


@pytest.mark.parametrize("edit, message", [
    (("limit_train: 600", "limit_tran: 600"),
     "run.yaml: unknown key dataset.limit_tran; valid keys: name, limit_train, limit_test, binary"),
    (("classes_per_client: 2", "alpha: 2"),
     "run.yaml: unknown key partition.alpha; valid keys: name, clients, classes_per_client"),
    (("  clients: 6\n", ""), r"run.yaml: partition.clients \(the number of clients\) is missing"),
    (("name: digits", "name: emnist"),
     "run.yaml: dataset.name: unknown dataset 'emnist'; valid: digits"),
    (("clients: 6", "clients: 400"),
     r"run.yaml: partition: shards: 800 shards \(2 per client x 400 clients\) but only 600"),
    (("seed: 3", "seed: three"), "run.yaml: seed must be an integer"),
])
def test_config_errors_name_the_file_and_key(tmp_path, edit, message):
    config = load_config(write(tmp_path, CONFIG.replace(*edit)))
    with pytest.raises(ConfigError, match=message):
        partition_from_config(config, dataset_from_config(config))


def test_relative_dataset_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    x = np.random.default_rng(0).normal(size=(40, 3))
    np.savez(tmp_path / "data" / "board.npz", x_train=x, y_train=np.arange(40) % 2)
    path = write(tmp_path, "dataset: {name: npz, path: data/board.npz, test_fraction: 0.25}\n")
    monkeypatch.chdir("/")
    ds = dataset_from_config(load_config(path))
    assert (len(ds.y_train), len(ds.y_test)) == (30, 10)


# ---------------------------------------------------------------------------------------
# edgefl partition / edgefl info
# ---------------------------------------------------------------------------------------

def test_cli_partition_prints_the_table_and_writes_a_png(tmp_path, capsys):
    config = write(tmp_path, CONFIG)
    png = tmp_path / "heat.png"
    assert main(["partition", str(config), "--set", "partition.clients=5", "--out", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "digits: shards(classes_per_client=2) over 5 clients, seed 3"
    assert out[1].split() == ["client"] + [str(c) for c in range(10)] + ["total"]
    rows = [line.split() for line in out[3:8]]
    assert [r[0] for r in rows] == ["0", "1", "2", "3", "4"]
    for r in rows:
        counts = [int(v) for v in r[1:11]]
        assert sum(counts) == int(r[11]) and sum(c > 0 for c in counts) <= 2
    total = out[9].split()
    assert total[0] == "all" and int(total[-1]) == 600
    assert out[-1] == f"heatmap: {png}"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_cli_partition_error_is_one_line_and_exit_1(tmp_path, capsys):
    config = write(tmp_path, CONFIG.replace("limit_train: 600", "path: /nowhere"))
    assert main(["partition", str(config), "--no-plot"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("edgefl partition: error: ") and \
        "run.yaml: dataset.path: unknown option of dataset 'digits'" in err
    assert main(["partition", str(tmp_path / "absent.yaml")]) == 1
    assert "absent.yaml: config file does not exist" in capsys.readouterr().err


def test_cli_partition_accepts_a_built_in_config_by_name(tmp_path, capsys, monkeypatch):
    # simulate, ctl start and client --partition take `quickstart`; partition said
    # "quickstart: config file does not exist"
    monkeypatch.chdir(tmp_path)
    assert main(["partition", "quickstart", "--no-plot"]) == 0
    assert capsys.readouterr().out.startswith("digits: iid() over 10 clients, seed 0")


@pytest.mark.parametrize("text, overrides, message", [
    (CONFIG + "bogus: 3\n", [], "run.yaml: bogus: unknown key; valid keys: dataset, partition"),
    (CONFIG, ["--set", "bogus=1"], r"run.yaml: bogus \(from --set\): unknown key; valid keys"),
])
def test_cli_partition_refuses_unknown_keys_as_simulate_does(tmp_path, capsys, text, overrides,
                                                            message):
    # docs/data.md: an unknown key is an error naming the file and the key; partition
    # accepted it (rc 0) where simulate refused it -- they now read configs alike
    png = tmp_path / "heat.png"
    assert main(["partition", str(write(tmp_path, text)), "--out", str(png), *overrides]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
    assert not png.exists()


def test_a_config_that_is_not_utf8_is_named(tmp_path, capsys):
    # the decoder's message ("'utf-8' codec can't decode byte 0xff...") named no file
    path = tmp_path / "latin.yaml"
    path.write_bytes(b"\xff\xfeseed: 1\n")
    with pytest.raises(ConfigError, match=r"latin\.yaml: not UTF-8 text \(byte 0xff at "
                                          r"offset 0\)"):
        load_config(path)
    assert main(["simulate", str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "latin.yaml: not UTF-8 text" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name, options, message", [
    ("dirichlet", {"alpha": "abc"}, "dirichlet: alpha must be a number, got 'abc'"),
    ("dirichlet", {"alpha": True}, "dirichlet: alpha must be a finite number, got True"),
    ("dirichlet", {"alpha": 0}, "dirichlet: alpha must be > 0, got 0"),
    ("quantity", {"sigma": [1]}, r"quantity: sigma must be a finite number, got \[1\]"),
    ("quantity", {"sigma": -1}, "quantity: sigma must be >= 0, got -1"),
    ("label-noise", {"rate": "abc"}, "label-noise: rate must be a number, got 'abc'"),
    ("label-noise", {"rate": [0.1, False, 0, 0]},
     r"label-noise: rate\[1\] must be a finite number, got False"),
    ("label-noise", {"max_rate": [1]}, r"label-noise: max_rate must be a finite number"),
    ("label-noise", {"rate": 0.1, "num_classes": "abc"},
     "label-noise: num_classes must be a positive integer, got 'abc'"),
    ("mod", {"num_classes": [1]}, r"mod: num_classes must be a positive integer, got \[1\]"),
])
def test_partition_options_of_the_wrong_type_are_named(digits, name, options, message):
    # were TypeErrors ('>' not supported between 'str' and 'int') or float()'s own words
    with pytest.raises(ValueError, match=message):
        partition(digits, name, 4, 0, **options)


def test_cli_info_reports_backend_and_datasets(capsys):
    import edgefl
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"backend  {edgefl.backend}" in out and f"numpy    {np.__version__}" in out
    assert "digits         available" in out and "synthetic      available" in out
    assert f"cache    {os.environ['EDGEFL_CACHE_DIR']}  (decoded data sets)" in out


def test_cli_without_a_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "partition" in capsys.readouterr().err


@pytest.mark.parametrize("clients, tile, options, message", [
    # the partitioner sees clients / tile shards and called them clients: "iid: 2000 clients
    # but only 1000 training samples" for a request of 2,000,000 clients
    (2_000_000, 1000, {}, r"^partition: clients = 2000000 with tile = 1000 splits the data into "
                          r"2000 shards, each shared by 1000 clients: iid: 2000 clients but only "
                          r"1000 training samples"),
    # a per-client list is one entry per shard under tile: "100 rates for 10 clients"
    (100, 10, {"rate": [0.1] * 100}, r"^partition: clients = 100 with tile = 10 splits the data "
                                     r"into 10 shards, .*: label-noise: 100 rates for 10 clients"),
    # were "clients must be a positive integer, got 1000.0" and "..., got -1"
    (1e6, 1000, {}, r"^partition: clients must be a positive integer, got 1000000\.0"),
    (-1000, 1000, {}, r"^partition: clients must be a positive integer, got -1000"),
])
def test_a_tiled_split_that_cannot_be_made_names_clients_tile_and_shards(clients, tile, options,
                                                                           message):
    labels = np.repeat(np.arange(10), 100)
    name = "label-noise" if options else "iid"
    with pytest.raises(ValueError, match=message):
        partition(labels, name, clients, 0, tile=tile, **options)


def test_mod_with_a_class_too_small_for_its_clients_names_the_class():
    # with clients > classes client n holds only class n mod C; a class with no samples (or
    # fewer than its clients) was reported as empty clients only, not why
    labels = np.repeat([0, 1, 2, 4, 5, 6, 7, 8, 9], 10)          # no 3 among 10 classes
    with pytest.raises(ValueError, match=r"^mod: class 3 has 0 samples for its 2 clients "
                                         r"\[3, 13\] \(client n holds class n mod 10\)"):
        partition(labels, "mod", 20, 0, num_classes=10)
    with pytest.raises(ValueError, match=r"^mod: class 0 has 10 samples for its 11 clients "
                                         r"\[0, 10, 20, 30, 40, \.\.\.\]"):
        partition(np.repeat(np.arange(10), [10] + [20] * 9), "mod", 110, 0)


def test_quantity_with_a_sigma_whose_sizes_overflow_is_refused():
    # sigma = 1000: exp() overflowed, the weights were NaN (RuntimeWarnings) and client 0 got
    # nearly everything whatever the seed; a large sigma that does not overflow still splits
    import warnings

    labels = np.zeros(1000, int)
    with pytest.raises(ValueError, match=r"quantity: sigma = 1000 is too large: the "
                                         r"log-normal sizes overflow float64"):
        quantity(labels, 10, np.random.default_rng(1), sigma=1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sizes = quantity(labels, 10, np.random.default_rng(1), sigma=100).sizes
    assert sizes.sum() == 1000 and sizes.min() >= 1
