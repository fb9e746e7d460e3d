"""Building the CPU kernels' library from `csrc/`, once per machine (docs/architecture.md, "The
CPU path"): `gcc -O3 -march=native -fopenmp` (without `-march=native` if rejected) into
`$MINISGL_CACHE_DIR/kernels/` (private to the user), named by a hash of the sources, compiler,
flags and CPU. Processes starting together take turns on a lock file; the library appears by an
atomic rename; a failed build leaves `<library>.failed`, so the next start skips those flags."""

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "MINISGL_CACHE_DIR"
SOURCE_DIR = Path(__file__).with_name("csrc")
COMPILERS = ("gcc", "cc")
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast", "-std=gnu11", "-shared", "-fPIC")
NATIVE_FLAGS = ("-march=native",)  # dropped if the compiler rejects it
BUILD_TIMEOUT_S = 120
CPU_FIELDS = ("model name", "flags", "Features", "CPU part")  # of /proc/cpuinfo (x86, arm)


def cache_root() -> Path:
    """minisgl's cache folder (the kernels' builds, the converted default model):
    $MINISGL_CACHE_DIR or ~/.cache/minisgl."""
    root = os.environ.get(CACHE_DIR_ENV)
    return Path(root) if root else Path.home() / ".cache" / "minisgl"


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = {line for line in text.splitlines() if line.split(":")[0].strip() in CPU_FIELDS}
    return "\n".join(sorted(keep)) or platform.machine()


def _compiler_version(compiler: str) -> str:
    try:
        result = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout.splitlines()[0] if result.returncode == 0 and result.stdout else ""


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Build the library at `target` (atomically); returns an error message or None."""
    fd, tmp_name = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    sources = [str(path) for path in _sources() if path.suffix == ".c"]
    cmd = [compiler, *flags, *sources, "-o", tmp_name, "-lm"]
    logger.info("building the CPU kernels, once per machine (usually 15-60 s on 2 CPU cores) ...")
    start_s = time.perf_counter()
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            return f"{' '.join(cmd)} failed: {result.stderr.strip()[-2000:]}"
        os.replace(tmp_name, target)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{' '.join(cmd)} failed: {exc}"
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    logger.info("built the CPU kernels in %.1f s: %s", time.perf_counter() - start_s, target)
    return None


def _sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.[ch]"))


def build_library() -> Path:
    """The compiled library for this machine: from the cache, or built now. Raises with the
    compiler's message when it cannot be built."""
    compiler = next((c for c in COMPILERS if shutil.which(c)), None)
    if compiler is None:
        raise RuntimeError(f"no C compiler found (looked for {', '.join(COMPILERS)})")
    # What every build's name depends on but the flags: read once for both flag sets.
    identity = [
        *(path.read_text() for path in _sources()),
        compiler,
        _compiler_version(compiler),
        _cpu_identity(),
    ]
    errors = []
    for flags in (FLAGS + NATIVE_FLAGS, FLAGS):
        key = hashlib.sha256("\n".join([*identity, " ".join(flags)]).encode()).hexdigest()[:16]
        target = cache_root() / "kernels" / f"minisgl_cpu_{key}.so"
        failed = target.with_suffix(".failed")  # the key covers sources, compiler and CPU
        if target.exists():
            return target
        if failed.exists():
            errors.append(failed.read_text(errors="replace"))
            continue
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Processes take turns on a lock file (released when it closes, or at death).
        with open(target.with_suffix(".lock"), "a") as lock_file:
            # A filesystem without locks raises: the atomic rename still keeps every process safe.
            with contextlib.suppress(OSError):
                fcntl.flock(lock_file, fcntl.LOCK_EX)
            if target.exists():  # built by another process while we waited for the lock
                return target
            if (error := _compile(compiler, flags, target)) is None:
                return target
            with contextlib.suppress(OSError):
                failed.write_text(error)
        errors.append(error)
    raise RuntimeError("; ".join(errors))
