# FlashInfer's JIT-compiled modules carried between device runs (sourced by gpu_check.sh and
# peer_check.sh). A run packs what it compiled into $OUT/fi_aot.tar; unpacked into .fi_aot/ here
# and carried, the next run loads the modules as FlashInfer's AOT ones and compiles nothing.

# load_fi_aot SITE: copy .fi_aot's modules into the flashinfer package installed under SITE.
# The tarball keeps FlashInfer's cache layout (.cache/flashinfer/<version>/<arch>/cached_ops/
# <name>/<name>.so); its AOT directory wants <name>/<name>.so.
load_fi_aot() {
  [ -d .fi_aot ] && [ -d "$1/flashinfer" ] || return 0
  find .fi_aot -name '*.so' | while read -r so; do
    name=$(basename "$(dirname "$so")")
    mkdir -p "$1/flashinfer/data/aot/$name" && cp "$so" "$1/flashinfer/data/aot/$name/"
  done
}

# pack_fi_aot TAR: the modules compiled under $FLASHINFER_WORKSPACE_BASE, if any (modules loaded
# from .fi_aot leave nothing to pack, and an empty tarball would come back for nothing).
pack_fi_aot() {
  local compiled
  compiled=$(cd "$FLASHINFER_WORKSPACE_BASE" 2>/dev/null && find . -name '*.so' -path '*cached_ops*')
  if [ -n "$compiled" ]; then
    (cd "$FLASHINFER_WORKSPACE_BASE" && echo "$compiled" | tar -cf "$1" -T -)
  fi
}
