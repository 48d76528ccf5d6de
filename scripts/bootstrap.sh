# shellcheck shell=bash
# Source this file: it makes (or reuses) the project's virtualenv and puts it first on PATH.
#
# The venv lives outside the clone, in $SLUICE_CACHE_DIR (default ~/.cache/sluicegate), named by the hash
# of requirements/lock.txt, the Python version and the uv version, so every clone and every CI run with the
# same lock reuses it instead of reinstalling gigabytes. A torch CPU wheel found in $SLUICEGATE_WHEEL_DIR
# (default /opt/wheels) replaces the CUDA build from PyPI.
# The caller's -e, -u and pipefail, restored at the end ($- here, not `set +o` in a subshell: errexit is
# not inherited there, and scripts/test would lose its -e).
_bootstrap_flags="$-"
_bootstrap_pipefail="$(shopt -po pipefail || true)"  # its status is 1 when off: a caller's -e would exit
_bootstrap_restore() {
  case "$_bootstrap_flags" in *e*) set -e ;; *) set +e ;; esac
  case "$_bootstrap_flags" in *u*) set -u ;; *) set +u ;; esac
  eval "$_bootstrap_pipefail"
}
set -euo pipefail

_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_cache="${SLUICE_CACHE_DIR:-$HOME/.cache/sluicegate}"
_uv_version="0.13.9"
_python="$(command -v python3.11 || command -v python3)"
if ! "$_python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "sluicegate needs Python 3.11 (found $("$_python" --version))" >&2
  _bootstrap_restore
  return 1 2>/dev/null || exit 1
fi

# The cache is shared by every clone and CI run: what is missing is made under an exclusive lock (flock,
# where there is one), and a bootstrap that waited for the lock finds it made. Two first bootstraps of one
# lock file at once each deleted and rebuilt the other's venv mid-install (a review). The lock goes with
# the open file, so a killed bootstrap never leaves it taken.
_bootstrap_lock() {
  mkdir -p "$(dirname "$1")"
  exec {_bootstrap_fd}>"$1"
  if command -v flock >/dev/null 2>&1; then flock "$_bootstrap_fd"; fi
}
_bootstrap_unlock() { exec {_bootstrap_fd}>&-; }

_uv="$_cache/tools/uv-$_uv_version/bin/uv"
if [ ! -x "$_uv" ]; then
  _bootstrap_lock "$_cache/tools/uv-$_uv_version.lock"
  if [ ! -x "$_uv" ]; then
    echo "bootstrap: installing uv $_uv_version into $_cache/tools" >&2
    "$_python" -m venv "$_cache/tools/uv-$_uv_version"
    "$_cache/tools/uv-$_uv_version/bin/pip" install --quiet --disable-pip-version-check "uv==$_uv_version"
  fi
  _bootstrap_unlock
fi

_wheel_dir="${SLUICEGATE_WHEEL_DIR:-/opt/wheels}"
_torch_wheel="$(ls "$_wheel_dir"/torch-*+cpu*.whl 2>/dev/null | sort -V | tail -n 1 || true)"
_hash="$( { cat "$_root/requirements/lock.txt"; "$_python" --version; echo "$_uv_version ${_torch_wheel##*/}"; } \
  | sha256sum | cut -c1-16)"
export SLUICEGATE_VENV="$_cache/venvs/$_hash"

if [ ! -f "$SLUICEGATE_VENV/.complete" ]; then
  _bootstrap_lock "$_cache/venvs/$_hash.lock"
  if [ ! -f "$SLUICEGATE_VENV/.complete" ]; then  # not made while this one waited
    echo "bootstrap: creating $SLUICEGATE_VENV (first run for this lock; later runs reuse it)" >&2
    rm -rf "$SLUICEGATE_VENV"
    "$_uv" venv --quiet --python "$_python" "$SLUICEGATE_VENV"
    if [ -n "$_torch_wheel" ]; then
      echo "bootstrap: using local torch wheel $_torch_wheel" >&2
      grep -vE '^(torch|triton|nvidia-[a-z0-9-]+)==' "$_root/requirements/lock.txt" > "$SLUICEGATE_VENV/lock.txt"
      "$_uv" pip install --python "$SLUICEGATE_VENV/bin/python" "$_torch_wheel"
    else
      cp "$_root/requirements/lock.txt" "$SLUICEGATE_VENV/lock.txt"
    fi
    "$_uv" pip install --quiet --python "$SLUICEGATE_VENV/bin/python" -r "$SLUICEGATE_VENV/lock.txt"
    touch "$SLUICEGATE_VENV/.complete"
  fi
  _bootstrap_unlock
fi

# Bytecode for everything installed, once per venv. uv installs without it, and where the environment sets
# PYTHONDONTWRITEBYTECODE nothing ever writes it, so every process compiled what it imported on each
# start: torch, transformers and evidently took 13-14 s to import on 2 cores instead of 7 (docs/perf).
# A few files are for newer Pythons (torch's py312 test helpers) and do not compile: skipped, as pip does.
if [ ! -f "$SLUICEGATE_VENV/.bytecode" ]; then
  echo "bootstrap: compiling the venv's bytecode (once, ~1 min)" >&2
  "$SLUICEGATE_VENV/bin/python" -m compileall -q -j 0 \
    "$("$SLUICEGATE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
    > /dev/null 2>&1 || true
  touch "$SLUICEGATE_VENV/.bytecode"
fi

# The project itself, editable, pointing at this clone (cheap; the last clone to bootstrap wins).
"$_uv" pip install --quiet --python "$SLUICEGATE_VENV/bin/python" --no-deps -e "$_root"
export PATH="$SLUICEGATE_VENV/bin:$PATH"
export VIRTUAL_ENV="$SLUICEGATE_VENV"
unset _root _cache _uv_version _python _uv _wheel_dir _torch_wheel _hash
# Sourced from an interactive shell, `set -e` would close it at its next failing command (an audit).
_bootstrap_restore
unset -f _bootstrap_restore _bootstrap_lock _bootstrap_unlock
unset _bootstrap_flags _bootstrap_pipefail _bootstrap_fd
