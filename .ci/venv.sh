# Sourced by the stage scripts: make_venv DIR makes a Python venv at DIR
# unless one is there, installing python3-venv with apt-get (as root) when
# the interpreter lacks it.
make_venv() {
    local venv=$1
    if [ -x "$venv/bin/python" ]; then
        return 0
    fi
    if ! python3 -m venv "$venv" >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv python3-pip
            python3 -m venv "$venv"
        else
            echo "python3 -m venv failed and no root apt-get (install python3-venv)" >&2
            exit 1
        fi
    fi
}
