#!/usr/bin/env bash
# `make compose-test`: docker-compose.yml run for real by podman-compose. Installs podman, runc, debootstrap (apt-get)
# and podman-compose (a tool venv) when missing, builds a local python:3.11-slim (no image can be pulled) and the
# project image, brings the stack up on the host's network with 2 prefill and 2 decode containers, runs the HTTP
# checks on 127.0.0.1, stops a decode container and checks the system keeps serving, then removes every container,
# volume and file it created, even on failure. Kept as a cache: the base image, the project image, the tool venv.
#
#   deploy/compose_test/run.sh                # the test
#   deploy/compose_test/run.sh --clean-cache  # remove the cache too
set -euo pipefail
cd "$(dirname "$0")/../.."

HERE=deploy/compose_test
PROJECT=tsukimi-compose-test
IMAGE=localhost/tsukimi:compose-test
BASE_IMAGE=docker.io/library/python:3.11-slim
BASE_LABEL=org.tsukimi.compose-test.base  # marks a base image this script made (and may remove)
CACHE_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/tsukimi-compose-test
PODMAN_COMPOSE_VERSION=1.6.0
PYTHON=${PYTHON:-.venv/bin/python}
UP_TIMEOUT_S=${COMPOSE_TEST_UP_TIMEOUT_S:-300}
export CONTAINERS_CONF=$PWD/$HERE/containers.conf

WORK=""
COPIED_WHEELS=()
STACK_CREATED=""

say() { printf '[compose-test %s +%ss] %s\n' "$(date +%H:%M:%S)" "$SECONDS" "$*"; }
fail() { say "FAILED: $*" >&2; exit 1; }

# Runs a command under a time limit (seconds), its output to $WORK/<name>.log; on failure shows the tail and fails.
logged() {  # logged LIMIT NAME COMMAND...
    local limit=$1 name=$2
    shift 2
    if ! timeout "$limit" "$@" >"$WORK/$name.log" 2>&1; then
        tail -n 40 "$WORK/$name.log" >&2
        fail "$name: '$*' failed or ran past ${limit} s (log above)"
    fi
}

COMPOSE=()  # podman-compose with the project and its three files: docker-compose.yml and two overrides

containers_of() {  # the running containers of compose service $1, sorted
    podman ps --filter "label=io.podman.compose.project=$PROJECT" --filter "label=io.podman.compose.service=$1" \
        --format '{{.Names}}' | sort
}

checks() { timeout 900 "$PYTHON" "$HERE/checks.py" --url "http://127.0.0.1:$GATEWAY_PORT" --api-key "$API_KEY" "$@"; }

install_tools() {
    local missing=() tool
    for tool in podman runc debootstrap; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    if ((${#missing[@]})); then
        [ "$(id -u)" = 0 ] || fail "${missing[*]} missing; installing them (apt-get) needs root"
        say "installing ${missing[*]} (apt-get)"
        logged 900 apt-update apt-get update
        logged 900 apt-install env DEBIAN_FRONTEND=noninteractive apt-get install -y podman runc debootstrap
    fi
    if [ "$("$CACHE_DIR/venv/bin/podman-compose" --version 2>/dev/null | head -n 1)" \
            != "podman-compose version $PODMAN_COMPOSE_VERSION" ]; then
        say "installing podman-compose $PODMAN_COMPOSE_VERSION into $CACHE_DIR/venv"
        rm -rf "$CACHE_DIR/venv"
        logged 300 venv python3 -m venv "$CACHE_DIR/venv"
        logged 600 pip-podman-compose "$CACHE_DIR/venv/bin/pip" install "podman-compose==$PODMAN_COMPOSE_VERSION"
    fi
    say "$(podman --version), runc $(runc --version | head -n 1 | cut -d' ' -f3), podman-compose $PODMAN_COMPOSE_VERSION"
}

pip_setting() {  # pip's configured value of $1 (the environment's first), or nothing
    local name=$1 env_name
    env_name=PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')
    [ -n "${!env_name:-}" ] && { echo "${!env_name}"; return; }
    "$PYTHON" -m pip config list 2>/dev/null | sed -n "s/^[a-z]*\.$name='\(.*\)'\$/\1/p" | head -n 1
}

ensure_base_image() {
    if podman image exists "$BASE_IMAGE"; then
        local made
        made=$(podman image inspect --format "{{ index .Labels \"$BASE_LABEL\" }}" "$BASE_IMAGE")
        say "base image $BASE_IMAGE: ${made:+made here by debootstrap, }cached"
        return
    fi
    # No registry can be reached for images: Debian bookworm's Python 3.11 from the package mirror, and this
    # machine's CA bundle (the one pip uses), so that pip inside the build trusts what pip outside does.
    say "building the base image $BASE_IMAGE (debootstrap bookworm, about a minute)"
    local root=$WORK/rootfs cert
    cert=$(pip_setting cert)
    logged 900 debootstrap debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$root"
    cp "${cert:-/etc/ssl/certs/ca-certificates.crt}" "$root/etc/ssl/certs/ca-certificates.crt"
    tar -C "$root" -c . | timeout 600 podman import --change "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt" \
        --change "LABEL $BASE_LABEL=debootstrap" - "$BASE_IMAGE" >"$WORK/import.log" 2>&1 \
        || { tail -n 20 "$WORK/import.log" >&2; fail "podman import of the base image"; }
    rm -rf "$root"
}

# The CPU torch wheel from pip's find-links goes into wheels/ (an unpinned or PyPI torch is a multi-GB CUDA build);
# sets TORCH_WHEEL to its name, or to nothing when there is none.
stage_torch_wheel() {
    local pin dir whl
    pin=$(sed -n 's/^ *"torch==\([^"]*\)",*$/\1/p' pyproject.toml)
    TORCH_WHEEL=""
    for dir in $(pip_setting find-links); do
        for whl in "${dir#file://}"/torch-"$pin"[+-]*.whl; do
            [ -f "$whl" ] || continue
            TORCH_WHEEL=${whl##*/}
            if [ ! -e "wheels/$TORCH_WHEEL" ]; then
                ln "$whl" wheels/ 2>/dev/null || cp "$whl" wheels/
                COPIED_WHEELS+=("wheels/$TORCH_WHEEL")
            fi
            return
        done
    done
}

build_image() {
    local old new
    stage_torch_wheel
    local args=(--network host --pull=never -t "$IMAGE")
    if [ -n "$TORCH_WHEEL" ]; then
        args+=(--build-arg TORCH_INDEX_URL=)  # torch comes from wheels/
        say "building $IMAGE (torch from wheels/$TORCH_WHEEL)"
    else
        say "building $IMAGE (no local torch wheel: torch from the Dockerfile's TORCH_INDEX_URL)"
    fi
    old=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
    logged 1800 build podman build "${args[@]}" .
    new=$(podman image inspect --format '{{.Id}}' "$IMAGE")
    if [ -n "$old" ] && [ "$old" != "$new" ]; then
        podman rmi "$old" >/dev/null 2>&1 || true  # the previous build: the cache is the current one only
    fi
    say "image $IMAGE ${new:0:12}, $(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1/1e9}')"
}

pick_ports() {  # two free loopback ports, none of the defaults (a developer's NATS or gateway may be running)
    read -r NATS_PORT GATEWAY_PORT < <("$PYTHON" -c '
import socket
sockets = [socket.socket() for _ in range(2)]
for s in sockets:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in sockets))')
    say "ports on 127.0.0.1: NATS $NATS_PORT, gateway $GATEWAY_PORT"
}

dump_logs() {
    say "the stack's state and each container's last log lines:"
    timeout 60 "${COMPOSE[@]}" ps 2>&1 || true
    timeout 120 "${COMPOSE[@]}" logs --no-color --tail 30 2>&1 | tail -n 400 || true
}

remove_leftovers() {  # whatever `down` missed: by the project's label, and podman-compose's pod by its name
    local label=label=io.podman.compose.project=$PROJECT
    podman ps -aq --filter "$label" | xargs -r podman rm -f --depend -t 5 >/dev/null 2>&1 || true
    if podman pod exists "pod_$PROJECT"; then podman pod rm -f "pod_$PROJECT" >/dev/null 2>&1 || true; fi
    podman volume ls -q --filter "$label" | xargs -r podman volume rm -f >/dev/null 2>&1 || true
    podman network ls -q --filter "$label" | xargs -r podman network rm -f >/dev/null 2>&1 || true
    if [ -n "$(podman ps -aq --filter "$label")$(podman volume ls -q --filter "$label")" ]; then
        say "WARNING: containers or volumes of $PROJECT are left: podman ps -a --filter $label; podman volume ls"
    fi
}

cleanup() {
    local code=$?
    trap - EXIT INT TERM
    if [ -n "$STACK_CREATED" ]; then
        ((code == 0)) || dump_logs
        say "tearing down (podman-compose down -v)"
        timeout 180 "${COMPOSE[@]}" down -v -t 10 >"$WORK/down.log" 2>&1 || { tail -n 20 "$WORK/down.log"; code=1; }
        remove_leftovers
    fi
    if ((${#COPIED_WHEELS[@]})); then rm -f "${COPIED_WHEELS[@]}"; fi
    if [ -n "$WORK" ]; then rm -rf "$WORK"; fi
    if ((code == 0)); then say "PASSED in ${SECONDS} s"; else say "FAILED (exit $code) after ${SECONDS} s"; fi
    exit "$code"
}

clean_cache() {
    podman image exists "$IMAGE" && podman rmi -f "$IMAGE" >/dev/null
    if podman image exists "$BASE_IMAGE" && [ -n "$(podman image inspect --format \
            "{{ index .Labels \"$BASE_LABEL\" }}" "$BASE_IMAGE")" ]; then
        podman rmi -f "$BASE_IMAGE" >/dev/null
    fi
    rm -rf "$CACHE_DIR"
    say "removed $IMAGE, the debootstrap base image and $CACHE_DIR"
}

main() {
    if [ "${1:-}" = "--clean-cache" ]; then
        clean_cache
        return
    fi
    [ -x "$PYTHON" ] || fail "$PYTHON not found: run through 'make compose-test' (it creates .venv)"
    WORK=$(mktemp -d /tmp/tsukimi-compose-test.XXXXXX)
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    install_tools
    if [ -n "$(podman ps -aq --filter "label=io.podman.compose.project=$PROJECT")" ]; then
        say "removing containers left by an earlier run"
        remove_leftovers
    fi
    ensure_base_image
    build_image
    pick_ports
    "$PYTHON" -m shared compose --host-network --image "$IMAGE" --nats-port "$NATS_PORT" \
        --port "$GATEWAY_PORT" --output "$WORK/hostnet.yml"
    # The stack's secrets and an API key, as a user makes them (never the repository's .env or api-keys.json, which
    # are the user's own).
    "$PYTHON" -m shared secrets --output "$WORK/secrets.env"
    API_KEY=$("$PYTHON" -m shared keys add compose-test --file "$WORK/api-keys.json" 2>/dev/null)
    echo "API_KEYS_FILE=$WORK/api-keys.json" >>"$WORK/secrets.env"
    COMPOSE=("$CACHE_DIR/venv/bin/podman-compose" --env-file "$WORK/secrets.env" -p "$PROJECT" -f docker-compose.yml
             -f "$WORK/hostnet.yml" -f "$HERE/compose.test.yml")
    if "$CACHE_DIR/venv/bin/podman-compose" --env-file /dev/null -f docker-compose.yml config >"$WORK/no-env.log" 2>&1
    then
        fail "the compose file started without NATS passwords"
    fi
    grep -q "run tsukimi secrets" "$WORK/no-env.log" || fail "no hint to make the passwords: $(tail -n 3 "$WORK/no-env.log")"
    logged 60 config-plain "$CACHE_DIR/venv/bin/podman-compose" --env-file "$WORK/secrets.env" -f docker-compose.yml \
        config  # users' file, as is
    logged 60 config "${COMPOSE[@]}" config

    say "podman-compose up -d: nats, gateway, scheduler, 2 prefill, 2 decode, cache-store-0 (host network)"
    STACK_CREATED=1
    logged 300 up "${COMPOSE[@]}" up -d --no-build
    say "waiting for /health with 2 prefill and 2 decode instances (at most $UP_TIMEOUT_S s)"
    checks wait-health --prefill 2 --decode 2 --timeout "$UP_TIMEOUT_S"
    timeout 60 "${COMPOSE[@]}" ps
    local service container
    for service in nats gateway; do  # podman runs health checks from systemd timers; without systemd, by hand
        container=$(containers_of "$service")
        timeout 60 podman healthcheck run "$container" >/dev/null || fail "the $service health check failed"
        say "health check of $container: $(podman inspect --format '{{.State.Health.Status}}' "$container")"
    done

    say "HTTP checks: chat, streaming, cached tokens, bad requests; NATS refuses anonymous clients"
    checks e2e
    checks nats-auth --port "$NATS_PORT"

    local decodes
    mapfile -t decodes < <(containers_of decode)
    ((${#decodes[@]} == 2)) || fail "expected 2 decode containers, found: ${decodes[*]}"
    say "stopping ${decodes[0]}; ${decodes[1]} must serve alone"
    timeout 60 podman stop -t 10 "${decodes[0]}" >/dev/null
    checks wait-health --prefill 2 --decode 1 --timeout 30
    checks serve --requests 4 --id-prefix compose-test-after-stop
    local served
    served=$(podman logs "${decodes[1]}" 2>&1 | grep -o 'compose-test-after-stop-[0-9]*' | sort -u | wc -l)
    ((served == 4)) || fail "${decodes[1]} logged $served of the 4 requests sent after the stop"
    say "${decodes[1]} served all 4 requests sent after the stop"
}

main "$@"
