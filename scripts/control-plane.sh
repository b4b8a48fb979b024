#!/usr/bin/env bash
# Build (once) and cache the Kubernetes control plane the e2e suite runs on: etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler and kubectl, compiled from the Go
# module proxy. No Docker, no release tarballs: the proxy is the only network we may use.
#
#   scripts/control-plane.sh build    build into the cache unless it already holds these versions
#   scripts/control-plane.sh dir      print the cache directory (the e2e harness reads the same path)
#   scripts/control-plane.sh check    exit 0 only if every cached binary reports the pinned version
#   scripts/control-plane.sh gen      regenerate ci/k8s-bins and ci/etcd-bin go.mod/go.sum for the pins
#   scripts/control-plane.sh up       build if needed, then run the control plane + node agent in
#                                     the foreground (prints KUBECONFIG; Ctrl-C stops; --once)
#
# Pins live here and in e2e/cluster.py (K8S_VERSION); change both together, then run `gen`.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.36.3}
# The etcd server release Kubernetes v1.36.3 itself requires (its etcd client is v3.6.8).
ETCD_VERSION=${ETCD_VERSION:-v3.6.8}
CACHE_ROOT=${PAGEFLEET_K8S_CACHE:-${HOME}/.cache/pagefleet/k8s}
OUT="${CACHE_ROOT}/${K8S_VERSION}"

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
K8S_MOD="${ROOT}/ci/k8s-bins"
ETCD_MOD="${ROOT}/ci/etcd-bin"
HELM_VERSION=${HELM_VERSION:-v3.16.4}
# The chart tests (tests/operator/test_chart_and_rbac.py) look for helm here.
HELM_DIR="${CACHE_ROOT%/k8s}/helm"
K8S_CMDS=(kube-apiserver kube-controller-manager kube-scheduler kubectl)

# A too-new `go` line must fail here, not trigger a toolchain download; static binaries as
# upstream ships them.
export GOTOOLCHAIN=local CGO_ENABLED=0
# go.sum is committed, so builds need no checksum-database round trips.
export GOFLAGS="${GOFLAGS:-} -mod=readonly"

log() { printf '[control-plane] %s\n' "$*" >&2; }

ldflags() {
  local minor=${K8S_VERSION#v1.}
  minor=${minor%%.*}
  local flags="-s -w"
  # The same -X targets as upstream hack/lib/version.sh; without them /version says v0.0.0-master.
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X ${pkg}.gitVersion=${K8S_VERSION} -X ${pkg}.gitMajor=1 -X ${pkg}.gitMinor=${minor}"
    flags+=" -X ${pkg}.gitTreeState=clean -X ${pkg}.buildDate=1970-01-01T00:00:00Z"
  done
  printf '%s' "$flags"
}

# Version checks capture the output before matching: `bin --version | grep -q` under
# pipefail fails at random when grep exits first and the binary dies of SIGPIPE, which made
# cached binaries look stale and triggered rebuilds.
reports() {  # reports BINARY EXPECTED-LINE ARGS...: the binary prints EXPECTED-LINE as a line
  local bin=$1 want=$2 out
  shift 2
  [[ -x "$bin" ]] || return 1
  out=$("$bin" "$@" 2>/dev/null) || return 1
  [[ $'\n'"$out"$'\n' == *$'\n'"$want"$'\n'* ]]
}

k8s_ok() {
  local c
  for c in kube-apiserver kube-controller-manager kube-scheduler; do
    reports "${OUT}/${c}" "Kubernetes ${K8S_VERSION}" --version || return 1
  done
  reports "${OUT}/kubectl" "Client Version: ${K8S_VERSION}" version --client
}

etcd_ok() {
  reports "${OUT}/etcd" "etcd Version: ${ETCD_VERSION#v}" --version
}

# A `go install`ed helm reports only its minor ("v3.16"): the patch is stamped by release builds.
helm_ok() { reports "${HELM_DIR}/helm" "${HELM_VERSION%.*}" version --template '{{.Version}}'; }

cmd_gen() {
  local stg="v0.${K8S_VERSION#v1.}" gomod m c
  log "generating ${K8S_MOD}/go.mod for k8s.io/kubernetes ${K8S_VERSION} (staging ${stg})"
  rm -f "${K8S_MOD}/go.mod" "${K8S_MOD}/go.sum"
  (
    cd "${K8S_MOD}"
    go mod init ci.local/k8s-bins >/dev/null 2>&1
    gomod=$(go mod download -json "k8s.io/kubernetes@${K8S_VERSION}" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
    # Match the tagged module's go/godebug lines: in a dependency they are ignored, so the
    # wrapper (the main module) must restate them or GODEBUG defaults drift.
    go mod edit -go="$(sed -n 's/^go //p' "$gomod")" -require="k8s.io/kubernetes@${K8S_VERSION}"
    sed -n 's/^godebug default=\(.*\)$/\1/p' "$gomod" | while read -r d; do go mod edit -godebug="default=$d"; done
    # Staging modules are required at v0.0.0 and replaced by ./staging paths that are not in
    # the module zip; point each at its published tag instead.
    for m in $(sed -n 's|^[[:space:]]*\(k8s.io/[^ ]*\) => \./staging/.*|\1|p' "$gomod"); do
      go mod edit -replace="${m}=${m}@${stg}"
    done
    for c in "${K8S_CMDS[@]}"; do go mod edit -tool="k8s.io/kubernetes/cmd/${c}"; done
    GOFLAGS=-mod=mod go mod tidy
  )
  log "generating ${ETCD_MOD}/go.mod for go.etcd.io/etcd/server/v3 ${ETCD_VERSION}"
  rm -f "${ETCD_MOD}/go.mod" "${ETCD_MOD}/go.sum"
  (
    cd "${ETCD_MOD}"
    go mod init ci.local/etcd-bin >/dev/null 2>&1
    gomod=$(go mod download -json "go.etcd.io/etcd/server/v3@${ETCD_VERSION}" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
    go mod edit -go="$(sed -n 's/^go //p' "$gomod")" -require="go.etcd.io/etcd/server/v3@${ETCD_VERSION}"
    go mod edit -tool=go.etcd.io/etcd/server/v3
    GOFLAGS=-mod=mod go mod tidy
  )
}

cmd_build() {
  mkdir -p "${OUT}"
  local start=$SECONDS
  if etcd_ok; then
    log "etcd ${ETCD_VERSION} cached in ${OUT}"
  else
    log "building etcd ${ETCD_VERSION} into ${OUT} (first run only)"
    # The version string comes from the module's own constant, so no -X is needed here.
    # A per-process temp name: concurrent builds must not write into one file.
    (cd "${ETCD_MOD}" && go build -trimpath -ldflags "-s -w" -o "${OUT}/etcd.tmp.$$" go.etcd.io/etcd/server/v3)
    mv "${OUT}/etcd.tmp.$$" "${OUT}/etcd"   # the default name would be "server" (path minus /v3)
    etcd_ok || { log "built etcd does not report ${ETCD_VERSION}"; exit 1; }
  fi
  if k8s_ok; then
    log "Kubernetes ${K8S_VERSION} cached in ${OUT}"
  else
    log "building Kubernetes ${K8S_VERSION} (${K8S_CMDS[*]}) into ${OUT}: 20-40 min cold on 2 cores"
    local tmp="${OUT}/.build.$$" c pkgs=()
    mkdir -p "$tmp"
    for c in "${K8S_CMDS[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/${c}"); done
    (cd "${K8S_MOD}" && go build -trimpath -ldflags "$(ldflags)" -o "${tmp}/" "${pkgs[@]}")
    # Move into place only after every binary linked, so a killed build never looks cached.
    for c in "${K8S_CMDS[@]}"; do mv "${tmp}/${c}" "${OUT}/${c}"; done
    rmdir "$tmp"
    k8s_ok || { log "built binaries do not report ${K8S_VERSION}"; exit 1; }
  fi
  build_helm
  log "ready in ${OUT} ($((SECONDS - start))s)"
}

# helm alone (a minute or two cold): enough for the chart tests of `make test-fast`.
build_helm() {
  if helm_ok; then
    log "helm ${HELM_VERSION} cached in ${HELM_DIR}"
  else
    log "building helm ${HELM_VERSION} into ${HELM_DIR} (first run only)"
    mkdir -p "${HELM_DIR}"
    # helm's go.mod has no replace directives, so a plain versioned install works.
    GOFLAGS= GOBIN="${HELM_DIR}" go install -trimpath -ldflags "-s -w" "helm.sh/helm/v3/cmd/helm@${HELM_VERSION}"
    helm_ok \
      || { log "built helm does not report ${HELM_VERSION%.*}"; exit 1; }
  fi
}

case "${1:-build}" in
  build) cmd_build ;;
  helm) build_helm ;;
  check) etcd_ok && k8s_ok && helm_ok ;;
  dir) printf '%s\n' "${OUT}" ;;
  gen) cmd_gen ;;
  up)
    cmd_build
    shift
    # In a network namespace of its own, like the e2e suite (the pod range is local there only).
    cd "${ROOT}" && exec bash scripts/in-netns.sh "${PYTHON:-${ROOT}/.venv/bin/python}" -m e2e.cluster "$@"
    ;;
  *) echo "usage: $0 {build|helm|check|dir|gen|up [--once] [--no-node]}" >&2; exit 2 ;;
esac
