"""One cache directory for everything edge-select builds, and plans' cache paths placed inside it."""

from edge.paths import cache_dir, resolve


def test_the_cache_directory_follows_the_environment():
    assert str(cache_dir({"EDGE_SELECT_CACHE_DIR": "/srv/cache", "HOME": "/root"})) == "/srv/cache"
    assert str(cache_dir({"HOME": "/home/op"})) == "/home/op/.cache/edge-select"


def test_a_plans_engine_cache_lands_in_the_cache_directory_in_force():
    env = {"EDGE_SELECT_CACHE_DIR": "/srv/cache", "HOME": "/root"}
    assert resolve("~/.cache/edge-select/vllm/abc", env) == "/srv/cache/vllm/abc"
    assert resolve("~/.cache/edge-select-other/x", env).endswith("/.cache/edge-select-other/x")
