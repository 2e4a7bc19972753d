"""Tensor-parallel replicas on a real local Ray: `cairn serve --tensor-parallel-size 2` joins the
test's Ray and deploys 2 replicas × TP 2 with CPU bundles (gloo); each replica is a placement
group whose second bundle runs its other rank as a Ray actor. Through the official client,
multi-turn chats resume where their state is, as on one device; then one rank actor is killed
under load: the requests on its replica end at once with a retryable error (503
engine_unavailable, or an error event in a stream), nothing hangs, the replica fails its health
check and Serve replaces it, and the cluster serves every request again."""

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from tests.support.chat import chat_turns  # noqa: E402
from tests.support.ray_checks import free_port, kill_index_actor, wait_for_log  # noqa: E402


INDEX = f"cairn-test-tp-index-{uuid.uuid4().hex[:6]}"
PAGE_SIZE, TAIL_GUARD = 16, 8
QUESTIONS = ["How do I build a cairn that lasts through the winter storms on the ridge?",
             "And how tall should it be so hikers see it in fog?",
             "Which stones hold best when they are wet?"]


def rank_actors() -> dict[str, int]:
    """Name -> pid of every live rank actor (cairn.cluster.tp_ranks names them)."""
    from cairn.cluster.tp_ranks import RANK_ACTOR_PREFIX

    alive = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith(RANK_ACTOR_PREFIX):
            try:
                actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
                alive[entry["name"]] = ray.get(actor.pid.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - gone between the listing and the call
                pass
    return alive


@pytest.fixture(scope="module")
def tp_app(ray_session, demo_model, tmp_path_factory):
    import yaml
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    tmp = tmp_path_factory.mktemp("tp-app")
    config = {"applications": [{
        "name": "tp", "route_prefix": "/tp", "import_path": "cairn.cluster.app:app_builder",
        "args": {"health_check_period_s": 1.0, "engine_options": {"collective_timeout_s": 10, "max_num_seqs": 8},
                 "routing": {"index_actor_name": INDEX}}}]}
    (tmp / "tp.yaml").write_text(yaml.safe_dump(config))
    log_path, env = tmp / "serve.log", {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    address = ray.get_runtime_context().gcs_address
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cairn.cluster.cli", "serve", "--address", address,
                                 "--config", str(tmp / "tp.yaml"), "--model", str(demo_model("qwen3_5_moe")),
                                 "--served-model-name", "tp", "--replicas", "2", "--num-cpus", "0.2",
                                 "--tensor-parallel-size", "2"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True)
    url = f"http://127.0.0.1:{port}/tp/v1"
    try:
        wait_for_log(proc, log_path, f"serving on {url}", 180)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        kill_index_actor(INDEX)
        serve.shutdown()


def client(url: str):
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)


def test_two_tp_2_replicas_serve_multi_turn_chats_resuming_where_their_state_is(tp_app):
    assert len(rank_actors()) == 2, "one more rank per replica, each in its replica's placement group"
    c = client(tp_app)
    for i in range(2):
        prompts, cached, replicas = chat_turns(c, "tp", f"Conversation {i}: " + "stone ridge marker fog " * 30,
                                               QUESTIONS)
        assert len(replicas) == 1, replicas
        for t in (1, 2):
            assert cached[t] >= prompts[t - 1] - PAGE_SIZE - TAIL_GUARD, (prompts, cached)


def test_a_killed_rank_ends_its_replicas_requests_with_a_retryable_error_and_serve_replaces_it(tp_app):
    c = client(tp_app)
    outcomes: list[tuple[str, float]] = []
    stop = threading.Event()

    def load(k: int) -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                c.chat.completions.create(model="tp", messages=[{"role": "user", "content": f"load {k} {start}"}],
                                          max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
                outcomes.append(("ok", time.monotonic() - start))
            except openai.APIStatusError as e:
                outcomes.append((f"{e.status_code}:{(e.body or {}).get('code')}", time.monotonic() - start))
            except openai.APIConnectionError:
                outcomes.append(("connection", time.monotonic() - start))

    threads = [threading.Thread(target=load, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(3)
        victim, pid = sorted(rank_actors().items())[0]
        os.kill(pid, signal.SIGKILL)
        killed_at = len(outcomes)
        deadline = time.monotonic() + 90
        while True:  # replaced: two live rank actors again, none of them the victim
            alive = rank_actors()
            if len(alive) == 2 and victim not in alive:
                break
            assert time.monotonic() < deadline, f"the replica was never replaced: {alive}"
            time.sleep(1)
        time.sleep(3)
        replaced_at = len(outcomes)
        time.sleep(5)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a request hung"
    failures = [o for o, _ in outcomes[killed_at:replaced_at] if o != "ok"]
    assert failures, "requests on the broken replica failed"
    assert set(failures) <= {"503:engine_unavailable"}, failures
    assert max(s for _, s in outcomes) < 60, "every request ended well within its timeout"
    assert [o for o, _ in outcomes[replaced_at:]] and all(o == "ok" for o, _ in outcomes[replaced_at:]), \
        outcomes[replaced_at:]
