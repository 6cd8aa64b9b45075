#!/usr/bin/env bash
# Best-effort install of the system packages the deploy checks use (Debian's prometheus:
# promtool and the server). Tests that need them skip with a clear reason when absent.
set -u
if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian package 'prometheus' (promtool + server) ..."
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
    >/tmp/ludic-system-deps.log 2>&1 || echo "could not install prometheus (see /tmp/ludic-system-deps.log); its tests will skip"
  # the package starts a daemon on :9090 on some systems; the tests run their own
  (service prometheus stop || pkill -x prometheus) >/dev/null 2>&1 || true
else
  echo "prometheus not installed and cannot apt-get here; promtool tests will skip"
fi
exit 0
