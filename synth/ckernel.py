"""Small C kernels of the CPU engine: compiled on first use with the machine's C compiler, cached on disk.

`build(source, cflags)` compiles `source` once per (source, compiler version, flags, machine) into the kernel cache
(`$AGENT_SERVER_KERNEL_CACHE`, else `~/.cache/agent-server/kernels`) and loads it. Concurrent builders each
publish a complete file (atomic rename). Without a compiler, or when the build fails, it raises KernelUnavailable
with the reason; callers fall back to torch or refuse the option that needs the kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

OPENMP_CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-Wall")


class KernelUnavailable(RuntimeError):
    pass


def _cache_dir() -> Path:
    root = os.environ.get("AGENT_SERVER_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "agent-server", "kernels")
    return Path(root)


def _compiler(purpose: str) -> str:
    wanted = os.environ.get("CC")
    cc = shutil.which(wanted) if wanted else shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelUnavailable(f"{purpose} compiles a small C kernel on first use and needs a C compiler "
                                f"on this machine: {f'CC={wanted} was not found' if wanted else 'no cc or gcc'}")
    return cc


def build(source: Path, cflags: tuple[str, ...] = OPENMP_CFLAGS, purpose: str = "") -> ctypes.CDLL:
    """Compile `source` (cached) and load it."""
    cc = _compiler(purpose or source.name)
    text = source.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(text + version.encode() + " ".join(cflags).encode()
                         + platform.machine().encode() + platform.node().encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            proc = subprocess.run([cc, *cflags, "-o", str(built), str(source)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise KernelUnavailable(f"compiling {source.name} with {cc} failed:\n{proc.stderr[-2000:]}")
            os.replace(built, target)
        log.info("compiled %s -> %s", source.name, target)
    return ctypes.CDLL(str(target))
