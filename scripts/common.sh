# hipflash — helpers sourced by scripts/run, scripts/test and scripts/compile-check.
# shellcheck shell=bash

HIPFLASH_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HIPFLASH_JOBS=${HIPFLASH_JOBS:-$(nproc)}

# Prints "[name] <elapsed>s" after running the command; returns the command's status.
timed() {
  local name=$1 start rc=0
  shift
  start=$(date +%s)
  "$@" || rc=$?
  echo "[time] $name: $(($(date +%s) - start))s$( ((rc == 0)) || echo " (FAILED, exit $rc)")"
  return $rc
}

# configure <build dir> <cmake args...>: Ninja for a fresh build dir when it is installed;
# an existing build dir keeps the generator it was made with.
configure() {
  local dir=$1
  shift
  local gen=()
  if [[ ! -f "$dir/CMakeCache.txt" ]] && command -v ninja >/dev/null; then
    gen=(-G Ninja)
  fi
  cmake -S "$HIPFLASH_ROOT" -B "$dir" "${gen[@]}" "$@"
}

# build <build dir> [cmake --build args...]
build() {
  local dir=$1
  shift
  cmake --build "$dir" -j "$HIPFLASH_JOBS" "$@"
}

# build_all_errors <build dir> [cmake --build args...]: like build, but keeps going after a
# failed translation unit, so one run reports every TU that does not compile.
build_all_errors() {
  local dir=$1 keep=()
  shift
  case $(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' "$dir/CMakeCache.txt") in
    Ninja) keep=(-- -k 0) ;;
    *Makefiles) keep=(-- -k) ;;
  esac
  cmake --build "$dir" -j "$HIPFLASH_JOBS" "$@" "${keep[@]}"
}
