"""The routing config (`cairn.cluster.routing.routing_config`): the shipped YAML loads, a bad one names every bad
field, every field is described."""

import pytest

from cairn.cluster.routing.routing_config import RoutingConfig
from tests.support.paths import REPO


def test_the_shipped_routing_yaml_loads_and_names_a_router_for_every_policy(tmp_path):
    config = RoutingConfig.from_yaml(REPO / "cairn" / "configs" / "routing.yaml")
    assert config == RoutingConfig(), "the shipped file spells out the defaults"
    for policy in ("cache_affinity", "pow2", "round_robin", "ray_prefix"):
        rrc = RoutingConfig(policy=policy).request_router_config()
        assert rrc.get_request_router_class().__name__ == \
            {"cache_affinity": "CacheAffinityRouter", "pow2": "PowerOfTwoChoicesRequestRouter",
             "round_robin": "RoundRobinRouter", "ray_prefix": "RayPrefixRouter"}[policy]
    assert RoutingConfig.model_validate(RoutingConfig(load_weight=2).router_kwargs()).load_weight == 2


def test_a_bad_routing_yaml_names_the_file_and_every_bad_field(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text("spill_limit: 0\npolicy: nearest\nspil_limit: 3\n")
    with pytest.raises(ValueError) as e:
        RoutingConfig.from_yaml(path)
    message = str(e.value)
    assert str(path) in message and "spill_limit" in message and "policy" in message and "spil_limit" in message
    path.write_text("- a list\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        RoutingConfig.from_yaml(path)


def test_every_config_field_is_described():
    assert all(f.description for f in RoutingConfig.model_fields.values())
