# hipflash — helpers sourced by the scripts in scripts/.
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

# ---- Prebuilt kernel libraries (scripts/gpu-prebuild) ----------------------------------------
# What the library is compiled from: a package built from these files is the library of any tree
# that has the same ones.
PREBUILT_SOURCES=(CMakeLists.txt cmake include kernels src)

# prebuilt_fingerprint <tree> <settings...>: 16 hex digits over the library's sources under <tree>
# (paths and contents) and the build settings (CUDA archs, head dims, flags).
prebuilt_fingerprint() {
  local tree=$1
  shift
  {
    (cd "$tree" && find "${PREBUILT_SOURCES[@]}" -type f -print0 | LC_ALL=C sort -z |
      xargs -0 sha256sum)
    printf 'setting %s\n' "$@"
  } | sha256sum | cut -c1-16
}

# prebuilt_prefix <name> <tree> <unpack dir> <settings...>: where .device/prebuilt/<name>.tar.xz
# was built from <tree>'s library sources with these settings, unpacks it into <unpack dir> and
# prints the install prefix to pass as -DHIPFLASH_PREBUILT; otherwise says why on stderr and
# fails (the caller then compiles the library itself).
prebuilt_prefix() {
  local name=$1 tree=$2 into=$3
  shift 3
  local pkg=$HIPFLASH_ROOT/.device/prebuilt/$name.tar.xz want have
  if [[ ! -f $pkg ]]; then
    echo "prebuilt $name: no package ($pkg); compiling the library here" >&2
    return 1
  fi
  rm -rf "$into" && mkdir -p "$into"
  xz -dc "$pkg" | tar -x -C "$into"
  want=$(prebuilt_fingerprint "$tree" "$@")
  have=$(cat "$into/FINGERPRINT")
  if [[ $want != "$have" ]]; then
    echo "prebuilt $name: package $have was built from other sources or settings than" \
      "$tree's ($want); compiling the library here" >&2
    return 1
  fi
  echo "prebuilt $name: $(cat "$into/COMMIT"), fingerprint $have" >&2
  echo "$into/prefix"
}
