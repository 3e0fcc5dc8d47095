"""The `privacy:` section of a run config: every bad value is refused with its key, a good
section survives a round trip through to_dict, and strategies whose server step needs each
update are refused with the reason."""
import pytest

from edgefl.runconfig import ConfigError, load_run_config, run_config_from_mapping
from edgefl.strategies import get_strategy, strategy_names


def load(*sets):
    return load_run_config("quickstart", list(sets))


def test_defaults_and_round_trip():
    cfg = load("privacy.secure_aggregation.neighbours=4", "privacy.dp.clip=0.5",
               "privacy.dp.mode=distributed", "privacy.dp.noise_multiplier=0.5",
               "strategy.weighting=uniform")
    assert cfg.privacy.secure_aggregation.threshold == pytest.approx(0.67)
    assert cfg.privacy.secure_aggregation.neighbours == 4
    assert cfg.privacy.secure_aggregation.max_attempts == 5
    assert load("privacy.secure_aggregation.max_attempts=2").privacy.secure_aggregation \
        .max_attempts == 2
    assert cfg.privacy.dp.mode == "distributed" and cfg.privacy.dp.clip == 0.5
    again = run_config_from_mapping(cfg.to_dict(), "again.yaml")
    assert again.privacy == cfg.privacy
    adaptive = load("privacy.dp.adaptive_clip.lr=0.1", "strategy.weighting=uniform")
    assert adaptive.privacy.dp.adaptive_clip.target_quantile == 0.5
    assert run_config_from_mapping(adaptive.to_dict(), "again.yaml").privacy == \
        adaptive.privacy


def test_a_setting_added_later_leaves_the_config_of_a_run_that_does_not_set_it_unchanged():
    # the config's dict is in the run's fingerprint: a secure run stopped before
    # max_attempts existed would otherwise be refused after an upgrade ("another
    # configuration"); set, it is in the dict like any other key
    section = load("privacy.secure_aggregation.neighbours=4").to_dict()["privacy"]
    assert section["secure_aggregation"] == {"threshold": 0.67, "neighbours": 4,
                                             "ring_bits": 32, "clip_range": 8.0}
    set_ = load("privacy.secure_aggregation.max_attempts=3").to_dict()["privacy"]
    assert set_["secure_aggregation"]["max_attempts"] == 3
    assert run_config_from_mapping(load().to_dict() | {"privacy": section}, "again.yaml") \
        .privacy.secure_aggregation.max_attempts == 5


def test_no_section_no_key():
    assert "privacy" not in load().to_dict()


@pytest.mark.parametrize("sets, key, words", [
    (["privacy.secure_aggregation.threshold=0.5"], "privacy.secure_aggregation.threshold",
     "(0.5, 1]"),
    (["privacy.secure_aggregation.threshold=2.5"], "privacy.secure_aggregation.threshold",
     "whole"),
    (["privacy.secure_aggregation.threshold=99"], "privacy.secure_aggregation.threshold",
     "between 3"),
    # quickstart's 5 a round: a count of 2 lets two disjoint pairs each unmask
    (["privacy.secure_aggregation.threshold=2"], "privacy.secure_aggregation.threshold",
     "between 3 and the 5 clients of a round"),
    (["privacy.secure_aggregation.neighbours=1"], "privacy.secure_aggregation.neighbours", ">= 2"),
    (["privacy.secure_aggregation.ring_bits=16"], "privacy.secure_aggregation.ring_bits",
     "32, 64"),
    (["privacy.secure_aggregation.clip_range=0"], "privacy.secure_aggregation.clip_range", "> 0"),
    # below float32's smallest normal every value clips to ~0, and the quantiser's scale
    # levels / clip_range overflows float64 (the kernel refused it only mid-round)
    (["privacy.secure_aggregation.clip_range=1e-300"], "privacy.secure_aggregation.clip_range",
     "smallest normal float32"),
    (["privacy.secure_aggregation.max_attempts=0"], "privacy.secure_aggregation.max_attempts",
     "below the minimum 1"),
    (["privacy.secure_aggregation.max_attempts=2.5"],
     "privacy.secure_aggregation.max_attempts", "integer"),
    (["privacy.secure_aggregation.mask=aes"], "privacy.secure_aggregation.mask", "valid keys"),
    (["privacy.secure_aggregation.threshold=0.8", "clients_per_round=1"],
     "privacy.secure_aggregation", "at least 2"),
    (["privacy.dp.mode=local"], "privacy.dp.mode", "central, distributed"),
    (["privacy.dp.mode=distributed"], "privacy.dp.mode", "secure_aggregation"),
    (["privacy.dp.clip=-1"], "privacy.dp.clip", "> 0"),
    (["privacy.dp.noise_multiplier=-0.1"], "privacy.dp.noise_multiplier", ">= 0"),
    (["privacy.dp.delta=1"], "privacy.dp.delta", "(0, 1)"),
    (["privacy.dp.target_epsilon=0"], "privacy.dp.target_epsilon", "> 0"),
    (["privacy.dp.target_epsilon=4", "privacy.dp.noise_multiplier=0"],
     "privacy.dp.target_epsilon", "infinite"),
    (["privacy.dp.accountant=moments"], "privacy.dp.accountant", "rdp, pld"),
    (["privacy.dp.mode=distributed", "privacy.secure_aggregation.threshold=0.8",
      "privacy.dp.adaptive_clip.lr=0.1"], "privacy.dp.adaptive_clip",
     "without secure aggregation only"),
    (["privacy.dp.mode=distributed", "privacy.secure_aggregation.threshold=0.8",
      "privacy.dp.clip=1", "privacy.dp.noise_multiplier=3",
      "privacy.secure_aggregation.clip_range=8", "strategy.weighting=uniform"],
     "privacy.secure_aggregation.clip_range", "clip_range >= 11.7"),
    (["privacy.dp.reproducible=yes please"], "privacy.dp.reproducible", "true or false"),
    (["privacy.dp.clip=1"], "strategy.weighting", "set strategy.weighting: uniform"),
    (["privacy.dp.clip=1", "strategy.name=fednova", "strategy.weighting=uniform"], "privacy.dp",
     "tau_eff"),
    (["privacy.dp.adaptive_clip.target_quantile=1"], "privacy.dp.adaptive_clip.target_quantile",
     "(0, 1)"),
    (["privacy.dp.clip=abc"], "privacy.dp.clip", "number"),
    (["privacy.dp=3"], "privacy.dp", "mapping"),
    (["privacy.extra=1"], "privacy.extra", "valid keys"),
])
def test_bad_values_name_the_key(sets, key, words):
    with pytest.raises(ConfigError) as err:
        load(*sets)
    message = str(err.value)
    assert f": {key} (from --set): " in message or f": {key}: " in message, message
    assert words in message


def test_empty_section_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("privacy: {}\n")
    with pytest.raises(ConfigError, match=r"run.yaml: privacy: is empty"):
        load_run_config(path)


@pytest.mark.parametrize("name", [n for n in strategy_names() if not get_strategy(n).secure_sum])
def test_strategies_that_need_each_update_are_refused(name):
    with pytest.raises(ConfigError, match=rf"privacy.dp: strategy '{name}' cannot run with it: "):
        run_config_from_mapping({"strategy": {"name": name}, "privacy": {"dp": {"clip": 1}}})


def test_served_strategies_are_the_weighted_sum_ones():
    served = {n for n in strategy_names() if get_strategy(n).secure_sum}
    assert served == {"fedavg", "fednova", "mfl", "fedumf", "fedprox", "fedavgm", "fedadam",
                      "fedyogi"}


def test_robust_aggregation_and_attacks_are_refused():
    with pytest.raises(ConfigError, match="privacy.secure_aggregation: robust aggregation"):
        load("strategy.robust.rule=median", "privacy.secure_aggregation.threshold=0.8")
    with pytest.raises(ConfigError, match=r"privacy.dp: the attack simulation"):
        load("attack.kind=sign_flip", "privacy.dp.clip=1")
