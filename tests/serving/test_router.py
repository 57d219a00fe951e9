"""The request router's choice: load first, prefix affinity while load stays balanced."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from ray import cloudpickle

from common import Priority
from protocol.requests import GenerationRequest
from protocol.stats import EngineStats
from serving.pinning import Pinned
from serving.router import Candidate, LoomRequestRouter, affinity_key, load_score, pinned_choice, rank


def _stats(kv: float = 0.0, running: int = 0, **waiting: int) -> EngineStats:
    return EngineStats(
        running={Priority.STANDARD: running},
        waiting={Priority(p): n for p, n in waiting.items()},
        kv_blocks_used=round(kv * 1000),
        kv_blocks_total=1000,
    )


def test_stats_survive_serves_dict_channel() -> None:
    s = _stats(kv=0.25, running=3, batch=4, interactive=1)
    assert EngineStats.from_dict(s.to_dict()) == s


def test_lower_kv_usage_and_queue_rank_first() -> None:
    busy = load_score(_stats(kv=0.8, standard=3), Priority.STANDARD, 0)
    idle = load_score(_stats(kv=0.1), Priority.STANDARD, 0)
    assert rank([Candidate("busy", busy), Candidate("idle", idle)], None) == ["idle", "busy"]


def test_waiting_batch_work_does_not_count_against_an_interactive_request() -> None:
    batch_queue = _stats(kv=0.3, batch=40)
    std_queue = _stats(kv=0.3, standard=5)
    empty = _stats(kv=0.3)
    assert load_score(batch_queue, Priority.INTERACTIVE, 0) == load_score(empty, Priority.INTERACTIVE, 0)
    assert load_score(batch_queue, Priority.STANDARD, 0) < load_score(std_queue, Priority.STANDARD, 0)
    assert load_score(batch_queue, Priority.BATCH, 0) > load_score(std_queue, Priority.BATCH, 0)


def test_requests_sent_since_the_last_stats_count_as_load() -> None:
    same = _stats(kv=0.2)
    assert load_score(same, Priority.STANDARD, 10) > load_score(same, Priority.STANDARD, 0)


def test_prefix_affinity_wins_while_balanced_and_yields_when_not() -> None:
    balanced = [Candidate("a", 0.30), Candidate("b", 0.35)]
    assert rank(balanced, preferred="b")[0] == "b"
    skewed = [Candidate("a", 0.10), Candidate("b", 0.90)]
    assert rank(skewed, preferred="b")[0] == "a"
    assert rank(skewed, preferred="gone") == ["a", "b"]


def test_affinity_key_is_per_tenant_and_per_prefix() -> None:
    def key(salt: bytes, ids: list[int]) -> bytes:
        return affinity_key(GenerationRequest("r", ids, cache_salt=salt))

    prompt = list(range(300))
    assert key(b"a", prompt) == key(b"a", prompt[:200] + [7] * 50)  # same first 128 tokens
    assert key(b"a", prompt) != key(b"b", prompt)
    assert key(b"a", prompt) != key(b"a", [1, *prompt])


def test_a_replica_whose_steps_fail_ranks_behind_a_busy_healthy_one() -> None:
    healthy_busy = load_score(_stats(kv=0.95, running=60, standard=30), Priority.STANDARD, 5)
    broken_idle = load_score(replace(_stats(), consecutive_failed_steps=2), Priority.STANDARD, 0)
    ranked = rank([Candidate("broken", broken_idle), Candidate("busy", healthy_busy)], preferred="broken")
    assert ranked == ["busy", "broken"]  # not even prefix affinity brings traffic back to it


def test_a_retry_avoids_the_replica_that_failed_it_even_when_it_is_idlest() -> None:
    candidates = [Candidate("failed", 0.0), Candidate("other", 0.6)]
    assert rank(candidates, preferred="failed", avoid="failed") == ["other", "failed"]
    assert rank([Candidate("failed", 0.0)], None, avoid="failed") == ["failed"]  # the only one left


def test_an_adapter_request_prefers_a_replica_that_holds_it_while_load_allows() -> None:
    from serving.router import adapter_holder

    stats = {
        "a": replace(_stats(kv=0.1), loaded_adapters=()),
        "b": replace(_stats(kv=0.3), loaded_adapters=("t/x@1",)),
        "c": replace(_stats(kv=0.9), loaded_adapters=("t/x@1",)),
    }
    candidates = [Candidate(rid, load_score(s, Priority.STANDARD, 0)) for rid, s in stats.items()]
    holder = adapter_holder(candidates, stats, "t/x@1")
    assert holder == "b"  # the least loaded of those holding it
    assert rank(candidates, holder)[0] == "b"  # within tolerance of the idlest
    assert adapter_holder(candidates, stats, "t/other@2") is None


def test_a_pinned_call_goes_to_its_replica_or_if_gone_anywhere_that_refuses_it() -> None:
    replicas = {"r1": "replica one", "r2": "replica two"}
    assert pinned_choice(Pinned("r2", "gateway"), replicas) == [["replica two"]]
    # Waiting for a replica that is gone would hold one of the router's routing tasks forever.
    assert pinned_choice(Pinned("gone", "gateway"), replicas) == [["replica one", "replica two"]]


def test_a_pin_is_recognised_by_the_router_serve_ships_by_value() -> None:
    """Serve pickles the router's module by value for each caller; the copy must still know a pin
    made with the classes the gateway imports (a copy of Pinned in that module never matched)."""
    code = (
        "import sys; from ray.serve.config import RequestRouterConfig as C; "
        "from serving.router import ROUTER_CLASS as R; "
        "sys.stdout.buffer.write(C(request_router_class=R).get_serialized_request_router_cls())"
    )
    blob = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True, check=True
    ).stdout
    shipped = cloudpickle.loads(blob)  # as in a gateway process: a copy of serving.router
    assert shipped is not LoomRequestRouter
    pin = Pinned("r2", "gateway")
    pinned_of = shipped.choose_replicas.__globals__["_pinned_of"]
    assert pinned_of(SimpleNamespace(args=[pin], kwargs={})) is pin


def test_a_call_of_several_requests_is_placed_as_one_and_each_is_reported_routed() -> None:
    from serving.replica_stats import process_registry
    from serving.router import _requests_of

    a = GenerationRequest("t/a", [1, 2, 3], priority=Priority.BATCH)
    b = replace(a, request_id="t/b", prompt_token_ids=[4, 5], priority=Priority.INTERACTIVE)
    call = SimpleNamespace(args=[[a, b], "gateway"], kwargs={})
    assert _requests_of(call) == [a, b]
    assert _requests_of(SimpleNamespace(args=[Pinned("r1", "gw")], kwargs={})) == []

    router = LoomRequestRouter.__new__(LoomRequestRouter)
    router.initialize_state()
    router._deployment_id = SimpleNamespace(app_name="app", name="batch-test")
    heard: list[tuple[str, str]] = []
    process_registry().listen_routed("app/batch-test", lambda rid, replica: heard.append((rid, replica)))
    router.on_request_routed(call, SimpleNamespace(unique_id="r1"), None)
    assert heard == [("t/a", "r1"), ("t/b", "r1")]
    assert router._sent["r1"] == 2  # two requests of load until the next stats, not one call
    assert router._affinity[affinity_key(b)] == "r1"


def test_the_autoscaler_counts_the_requests_replicas_run_not_calls() -> None:
    from serving.autoscaling import ENGINE_REQUESTS_METRIC, engine_requests_policy

    config = SimpleNamespace(get_target_ongoing_requests=lambda: 64.0)
    ctx = SimpleNamespace(
        current_num_replicas=2,
        target_num_replicas=2,
        total_num_requests=3.0,  # Serve's count: three calls
        aggregated_metrics={ENGINE_REQUESTS_METRIC: {"r1": 150.0, "r2": 106.0}},
        config=config,
    )
    assert engine_requests_policy(ctx) == (4.0, {})
    ctx.aggregated_metrics = {}  # no replica has reported yet: Serve's own count
    assert engine_requests_policy(ctx) == (3.0 / 64.0, {})
