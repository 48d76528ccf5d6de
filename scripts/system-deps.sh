# shellcheck shell=bash
# Source this file: installs the system programs the platform needs when they are missing (Debian apt).
# The JDK runs the Kafka broker; Maven resolves the broker's jars from Maven Central once.
# promtool and amtool check the generated Prometheus rules and the example Alertmanager config (tests).
# Chromium (headless) renders the dashboard in its browser test.
_need=()
command -v java >/dev/null 2>&1 || _need+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || _need+=(maven)
command -v promtool >/dev/null 2>&1 || _need+=(prometheus)
command -v amtool >/dev/null 2>&1 || _need+=(prometheus-alertmanager)
command -v chromium >/dev/null 2>&1 || _need+=(chromium)
# Debian's own Python makes venvs only with python3.11-venv (ensurepip); another Python (pyenv) has it.
if command -v python3.11 >/dev/null 2>&1 && ! python3.11 -c 'import ensurepip' >/dev/null 2>&1; then
  _need+=(python3.11-venv)
fi
if [ "${#_need[@]}" -gt 0 ]; then
  echo "system-deps: installing ${_need[*]} with apt-get" >&2
  _sudo=""; [ "$(id -u)" -eq 0 ] || _sudo="sudo"
  $_sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $_sudo apt-get install -y -qq --no-install-recommends "${_need[@]}" >/dev/null
  # The packages start Prometheus (:9090) and Alertmanager (:9093, :9094) as services where systemd runs;
  # only their tools are wanted, and 9093 is the local Kafka controller's port (an audit).
  if [ -d /run/systemd/system ]; then
    $_sudo systemctl disable --now prometheus prometheus-alertmanager >/dev/null 2>&1 || true
  fi
fi
unset _need _sudo
