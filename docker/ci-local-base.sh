#!/usr/bin/env bash
# The docker leg of CI on machines that reach Debian's packages and PyPI but no container
# registry. It installs docker.io and debootstrap, starts dockerd by hand (no systemd), builds
# a Debian base image locally, builds docker/Dockerfile on it with the host's CPU torch wheel,
# and runs the multi-rank tests inside (the whole suite while no test is marked `multirank`).
#
# Invariants: a daemon this script started is stopped by its PID on every exit, and no
# container is left behind. The base image is keyed by its recipe, the host's CA certificates
# and pip settings, so a re-run on the same machine reuses it and a change rebuilds it.
#
# Environment: IMAGE (tag to build), DOCKER_PYTEST_ARGS (pytest arguments in the container;
# unset means `-m multirank`, or the whole suite when nothing is marked), RUN_TIMEOUT (s).
# HOST_DONE (a path) and HOST_PID: the leg builds at once but runs its tests only once that
# file exists. .ci/run starts the leg beside the host's suite, whose CPU the setup (apt,
# debootstrap, pip) barely competes for, and creates the file when the host's jobs are done.
# The wait fails if process HOST_PID is gone or WAIT_TIMEOUT (s) passes.
set -euo pipefail
cd "$(dirname "$0")/.."

# The docker.io client by full path: a newer client may come first on PATH, and it lacks the
# buildx plugin that it would want for builds against this daemon.
DOCKER=/usr/bin/docker
DOCKERD=/usr/sbin/dockerd
SUITE=bookworm
PY_TAG=cp311
MIRROR=${MIRROR:-http://deb.debian.org/debian}
ROOTFS_PACKAGES=python3,python3-venv,make,ca-certificates
BASE_REPO=cp-blocktables-ci-base
IMAGE=${IMAGE:-cp-blocktables:ci}
RUN_TIMEOUT=${RUN_TIMEOUT:-600}
WAIT_TIMEOUT=${WAIT_TIMEOUT:-3600}
CONTAINER_CERTS=/etc/ssl/certs/ca-certificates.crt
HOST_CA_DIR=/usr/local/share/ca-certificates
STATE_DIR=/var/run/cp-blocktables-ci
TORCH_SPEC=$(sed -n 's/^TORCH_SPEC ?= *//p' Makefile)
CONTAINER=cp-blocktables-ci-$$

daemon_pid=""
rootfs=""

log() { echo "docker-ci: $*"; }

phase() {
    local name=$1 start=$SECONDS
    shift
    "$@"
    log "phase $name took $((SECONDS - start)) s"
}

cleanup() {
    local rc=$?
    if [[ -x $DOCKER ]] && "$DOCKER" container inspect "$CONTAINER" >/dev/null 2>&1; then
        "$DOCKER" rm -f "$CONTAINER" >/dev/null 2>&1 || true
    fi
    [[ -n $rootfs ]] && rm -rf "$rootfs" "$rootfs.log"
    [[ -n $daemon_pid ]] && stop_daemon
    exit "$rc"
}

stop_daemon() {
    log "stopping dockerd (pid $daemon_pid)"
    kill -TERM "$daemon_pid" 2>/dev/null || true
    local waited=0
    while kill -0 "$daemon_pid" 2>/dev/null && ((waited < 30)); do
        sleep 1
        waited=$((waited + 1))
    done
    if kill -0 "$daemon_pid" 2>/dev/null; then
        log "dockerd did not stop within 30 s; killing it"
        kill -KILL "$daemon_pid" 2>/dev/null || true
    fi
    wait "$daemon_pid" 2>/dev/null || true
    daemon_pid=""
}

install_tools() {
    if [[ -x $DOCKER && -x $DOCKERD ]] && command -v debootstrap >/dev/null; then
        log "docker.io and debootstrap already installed"
        return
    fi
    local apt_log=$STATE_DIR/apt.log
    if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        --no-install-recommends docker.io debootstrap; } >"$apt_log" 2>&1; then
        log "installing docker.io and debootstrap failed; last lines of the apt log:"
        tail -n 20 "$apt_log" >&2
        return 1
    fi
}

start_daemon() {
    if "$DOCKER" info >/dev/null 2>&1; then
        log "using the docker daemon already running"
        return
    fi
    local pidfile=$STATE_DIR/dockerd.pid
    if [[ -f $pidfile ]] && ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        rm -f "$pidfile"
    fi
    "$DOCKERD" --pidfile "$pidfile" >"$STATE_DIR/dockerd.log" 2>&1 &
    daemon_pid=$!
    local waited=0
    until "$DOCKER" info >/dev/null 2>&1; do
        if ! kill -0 "$daemon_pid" 2>/dev/null || ((waited >= 60)); then
            log "dockerd did not come up; last lines of its log:"
            tail -n 20 "$STATE_DIR/dockerd.log" >&2
            return 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
    log "dockerd is up (pid $daemon_pid)"
}

# Prints "key=value" lines of the host's pip settings, values unquoted, section dropped.
host_pip_settings() {
    python3 -m pip config list 2>/dev/null | sed -E "s/^[^=]*\.([a-z-]+)='?([^']*)'?$/\1=\2/"
}

# The host's pip settings as a pip.conf for the container. Only what means the same inside is
# kept: remote indexes and timeouts. Local paths (file:// indexes, find-links, constraints) are
# the host's disk; the torch wheel reaches the image through docker/wheels instead.
container_pip_conf() {
    local key value url
    echo "[global]"
    echo "cert = $CONTAINER_CERTS"
    while IFS='=' read -r key value; do
        case $key in
            index-url | extra-index-url)
                for url in $value; do
                    if [[ $url == http://* || $url == https://* ]]; then
                        echo "$key = $url"
                    fi
                done
                ;;
            trusted-host | default-timeout | timeout | retries)
                echo "${key/default-timeout/timeout} = $value"
                ;;
        esac
    done < <(host_pip_settings | sort -u)
}

base_image_tag() {
    local key
    key=$({
        echo "$SUITE $MIRROR $ROOTFS_PACKAGES"
        cat "$HOST_CA_DIR"/*.crt 2>/dev/null || true
        container_pip_conf
    } | sha256sum | cut -c1-12)
    echo "$BASE_REPO:$SUITE-$key"
}

build_base_image() {
    local tag=$1
    if "$DOCKER" image inspect "$tag" >/dev/null 2>&1; then
        log "base image $tag exists; reusing it"
        return
    fi
    rootfs=$(mktemp -d /var/tmp/cp-blocktables-rootfs.XXXXXX)
    local start=$SECONDS
    log "debootstrap $SUITE into $rootfs"
    debootstrap --variant=minbase --include="$ROOTFS_PACKAGES" "$SUITE" "$rootfs" "$MIRROR" \
        >"$rootfs.log" 2>&1 || { tail -n 20 "$rootfs.log" >&2; return 1; }
    rm -f "$rootfs.log"
    log "debootstrap took $((SECONDS - start)) s"
    if compgen -G "$HOST_CA_DIR/*.crt" >/dev/null; then
        cp "$HOST_CA_DIR"/*.crt "$rootfs$HOST_CA_DIR/"
    fi
    chroot "$rootfs" update-ca-certificates >/dev/null
    container_pip_conf >"$rootfs/etc/pip.conf"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | "$DOCKER" import \
        --change "ENV PIP_CERT=$CONTAINER_CERTS" \
        --change 'CMD ["/bin/bash"]' - "$tag" >/dev/null
    rm -rf "$rootfs"
    rootfs=""
    "$DOCKER" images --format '{{.Repository}}:{{.Tag}}' "$BASE_REPO" | grep -vxF "$tag" |
        xargs -r "$DOCKER" rmi >/dev/null || true
    log "imported base image $tag"
}

# Copies the host's CPU torch wheel from pip's find-links folders into docker/wheels.
stage_torch_wheel() {
    local version=${TORCH_SPEC#torch==} dir wheel
    [[ $version == "$TORCH_SPEC" ]] && version="*"
    while IFS='=' read -r _ dir; do
        for dir in $dir; do
            dir=${dir#file://}
            for wheel in "$dir"/torch-"$version"+cpu-"$PY_TAG"-"$PY_TAG"-*.whl; do
                [[ -f $wheel ]] || continue
                cmp -s "$wheel" "docker/wheels/${wheel##*/}" || cp "$wheel" docker/wheels/
                log "torch wheel: ${wheel##*/}"
                return
            done
        done
    done < <(host_pip_settings | grep '^find-links=')
    log "no local CPU wheel for $TORCH_SPEC ($PY_TAG); pip will fetch torch from the index"
}

# Build output with seconds since the build started, to see which step costs what.
build_image() {
    local start=$SECONDS line
    make --no-print-directory docker-build DOCKER="$DOCKER" IMAGE="$IMAGE" BASE_IMAGE="$1" |
        while IFS= read -r line; do echo "[$((SECONDS - start)) s] $line"; done
    "$DOCKER" image prune -f >/dev/null
}

# `-m multirank` when some test carries the marker, else the whole suite.
default_pytest_args() {
    local rc=0
    "$DOCKER" run --rm "$IMAGE" python -m pytest --collect-only -q -m multirank \
        >/dev/null 2>&1 || rc=$?
    case $rc in
        0) echo "-m multirank" ;;
        5) echo "" ;;
        *) log "collecting the multirank tests in the container failed (rc $rc)" >&2; return 1 ;;
    esac
}

run_tests() {
    local args
    if [[ -v DOCKER_PYTEST_ARGS ]]; then
        args=$DOCKER_PYTEST_ARGS
    else
        args=$(default_pytest_args)
    fi
    log "running 'make test PYTEST_ARGS=\"$args\"' in the container"
    local rc=0
    timeout "$RUN_TIMEOUT" make --no-print-directory docker-test DOCKER="$DOCKER" \
        IMAGE="$IMAGE" DOCKER_RUN_ARGS="--name $CONTAINER" PYTEST_ARGS="$args" || rc=$?
    if ((rc == 124)); then
        log "the container run passed RUN_TIMEOUT=$RUN_TIMEOUT s; its container is removed"
    fi
    return "$rc"
}

wait_for_host() {
    local waited=0
    log "waiting for the host's jobs to finish ($HOST_DONE)"
    until [[ -e $HOST_DONE ]]; do
        if [[ -n ${HOST_PID:-} ]] && ! kill -0 "$HOST_PID" 2>/dev/null; then
            log "the host's CI run (pid $HOST_PID) is gone; not running the tests"
            return 1
        fi
        if ((waited >= WAIT_TIMEOUT)); then
            log "the host's jobs did not finish within WAIT_TIMEOUT=$WAIT_TIMEOUT s"
            return 1
        fi
        sleep 2
        waited=$((waited + 2))
    done
}

main() {
    trap cleanup EXIT
    trap 'exit 130' INT TERM
    local total=$SECONDS base
    mkdir -p "$STATE_DIR"
    phase install-tools install_tools
    phase start-daemon start_daemon
    base=$(base_image_tag)
    phase base-image build_base_image "$base"
    phase stage-wheel stage_torch_wheel
    phase build-image build_image "$base"
    [[ -z ${HOST_DONE:-} ]] || phase wait-for-host wait_for_host
    phase run-tests run_tests
    log "docker leg took $((SECONDS - total)) s"
}

main "$@"
