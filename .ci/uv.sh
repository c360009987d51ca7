# Sourced by .ci/setup-*: make .venv, bring uv into it, install from constraints.txt with uv.
UV_VERSION=0.13.8  # the uv that installs; tools/refresh-constraints uses the same

HEADLAB_SETUP_T0=${HEADLAB_SETUP_T0:-$(date +%s)}
export HEADLAB_SETUP_T0
step() { echo "==> [$(( $(date +%s) - HEADLAB_SETUP_T0 ))s] $*" >&2; }

headlab_venv() {
  local py=${PYTHON:-python3}
  if [ ! -x .venv/bin/python ]; then
    step "creating .venv ($("$py" --version 2>&1))"
    "$py" -m venv .venv
  fi
  if [ "$(.venv/bin/python -m uv --version 2>/dev/null | cut -d' ' -f2)" != "$UV_VERSION" ]; then
    step "installing uv $UV_VERSION into .venv (pip)"
    .venv/bin/python -m pip install -q --disable-pip-version-check "uv==$UV_VERSION" 2>&1 \
      | { grep -v "^WARNING: Location .* is ignored" || true; } >&2
  fi
}

# pip's find-links (a folder of local wheels, such as the CPU build of torch) for uv, which does not read
# pip's configuration: $UV_FIND_LINKS, else $PIP_FIND_LINKS, else pip's own setting, space-separated.
headlab_find_links() {
  local links=${UV_FIND_LINKS:-${PIP_FIND_LINKS:-}}
  if [ -z "$links" ]; then
    links=$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)
  fi
  local l
  for l in $links; do printf -- '--find-links\n%s\n' "$l"; done
}

headlab_uv_install() {
  local links=()
  mapfile -t links < <(headlab_find_links)
  VIRTUAL_ENV="$PWD/.venv" .venv/bin/python -m uv pip install --quiet --python .venv/bin/python \
    --constraints constraints.txt --build-constraints constraints.txt "${links[@]}" "$@"
}

headlab_pip_check() {
  step "checking the environment (pip check)"
  .venv/bin/python -m pip check --disable-pip-version-check >/dev/null || .venv/bin/python -m pip check
}
