#!/usr/bin/env bash
# Run CMD inside a network namespace made for this run, then let the namespace go.
#
#   scripts/in-netns.sh CMD [ARGS...]      e.g. scripts/in-netns.sh .venv/bin/pytest e2e
#
# Inside: only `lo`, up, plus the e2e pod range 198.18.0.0/15 made local on it (every
# address in it binds and answers like 127.0.0.1), so the e2e node agent can give pods
# their own addresses without touching the host's network. Nothing outside the namespace
# is reachable from it, and nothing is added to the host's own namespace: the namespace
# disappears when CMD (and whatever it started) exits.
#
# Root uses `unshare --net`; other users get a user namespace too (`--map-root-user`, needs
# unprivileged user namespaces). Already inside (PAGEFLEET_NETNS=1): runs CMD as is.
set -euo pipefail

POD_NETWORK=198.18.0.0/15

[ $# -gt 0 ] || { echo "usage: scripts/in-netns.sh CMD [ARGS...]" >&2; exit 2; }
if [ "${PAGEFLEET_NETNS:-}" = 1 ]; then
  exec "$@"
fi
command -v unshare >/dev/null && command -v ip >/dev/null || {
  echo "in-netns.sh: needs unshare (util-linux) and ip (iproute2)" >&2; exit 1; }

ns_flags=(--net)
[ "$(id -u)" = 0 ] || ns_flags=(--user --map-root-user --net)
if ! unshare "${ns_flags[@]}" true 2>/dev/null; then
  echo "in-netns.sh: cannot create a network namespace (unshare ${ns_flags[*]} failed):" \
    "run as root, or enable unprivileged user namespaces" \
    "(sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0)" >&2
  exit 1
fi

export PAGEFLEET_NETNS=1 PAGEFLEET_POD_NETWORK="${POD_NETWORK}"
# shellcheck disable=SC2016  # expanded by the inner shell
exec unshare "${ns_flags[@]}" -- bash -c '
  ip link set lo up
  ip route add local "${PAGEFLEET_POD_NETWORK}" dev lo
  exec "$@"' in-netns "$@"
