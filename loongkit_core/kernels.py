"""Compiled CPU kernels for plugins: one loader, one ABI, prebuilt in wheels, built on first use otherwise.

A plugin (or a third party) that ships C++ kernels keeps them in one directory with a ``build.json``
(see :mod:`loongkit_core.kernelbuild`), writes them against ``loongkit/kernel.h`` and declares::

    from loongkit_core.kernels import KernelLibrary
    LIBRARY = KernelLibrary(Path(__file__).with_name("cpu"), logger="mine.kernels")

    lib = LIBRARY.load()          # the functions as attributes, or None (never raises)
    if lib is None:
        print(LIBRARY.failure())  # why: "no C++ compiler (c++ not on PATH) to build the kernels", ...
    lib.my_kernel(tensor_in, tensor_out, 3, 0.5)

:meth:`KernelLibrary.load` finds the library in this order, once per process:

1. the prebuilt binary next to the sources (``<directory>/<name>.so``: what ``pip wheel`` put in
   the wheel, or an in-place build), if it loads, speaks this core's ABI and was built from the
   sources beside it;
2. a build in the cache (``LOONGKIT_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/loongkit/kernels``, else
   ``~/.cache/loongkit/kernels``), keyed by :func:`loongkit_core.kernelbuild.build_key`;
3. a build now, with ``$CXX``/``c++`` (no ninja, no Python or torch headers needed), under a file
   lock so that concurrent first uses (several DataLoader workers) build once.

Why it did not use a prebuilt binary is :attr:`KernelLibrary.fallback` ("no prebuilt binary (a
source or editable install)", "prebuilt binary did not load: ...", "prebuilt binary is stale: ...");
:meth:`KernelLibrary.describe` says it all in one line for a Summary detail (``ctx.detail``).

The binary does not link libtorch or libpython: its functions take arrays (CPU ``torch.Tensor`` or
``numpy.ndarray``, any strides; see ``lk::View``), Python ints, floats, bools and sequences of
them, in the order and kinds its table declares (``lk_functions``), and return None, a bool or an
int. The GIL is released during each call. Errors inside (``LK_CHECK``) raise RuntimeError.

Instruction sets: the library holds a baseline, an AVX2 and an AVX-512 build of every kernel and
runs the best one this CPU supports; ``LOONGKIT_KERNEL_ISA=avx2`` (or ``baseline``) asks for a
lower one (tests, a suspected miscompile), and ``load(isa=...)`` gives one explicitly. OpenMP is
torch's: torch is imported first and its runtime made visible to the library, which never loads
one of its own; each call runs on ``torch.get_num_threads()`` threads.

Subclass :class:`Kernels` (``KernelLibrary(..., api=MyKernels)``) to add Python-side glue, e.g.
functions that allocate their outputs.
"""

from __future__ import annotations

import ctypes
import fcntl
import operator
import os
import sys
import threading
import time
from array import array
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from loongkit_core import kernelbuild
from loongkit_core.kernelbuild import BuildError, Spec, build_key, compiler
from loongkit_core.log import get_logger

CACHE_ENV = "LOONGKIT_KERNEL_CACHE"
ISA_ENV = "LOONGKIT_KERNEL_ISA"
ISAS = ("baseline", "avx2", "avx512")  # index = the library's ISA number

__all__ = ["CACHE_ENV", "ISAS", "ISA_ENV", "KernelLibrary", "Kernels", "cache_root", "compiler", "openmp_runtimes"]

# lk::Dtype codes (loongkit/kernel.h).
_TORCH_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool")
_OPENMP_NAMES = ("libgomp", "libiomp5", "libomp")


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """Where libraries built on first use are kept."""
    env = os.environ if environ is None else environ
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "loongkit" / "kernels"


def openmp_runtimes(maps: str = "/proc/self/maps") -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (one is expected: torch's)."""
    found: list[str] = []
    try:
        with open(maps) as fh:
            for line in fh:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if os.path.basename(path).startswith(_OPENMP_NAMES) and ".so" in path and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


class KernelError(RuntimeError):
    """Why a library cannot be used (the loader turns it into :meth:`KernelLibrary.failure`)."""


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = next((ln for ln in text if "error" in ln.lower()), text[0] if text else "")
    return f"{type(exc).__name__}: {first[:300]}"


class _Codes:
    """dtype -> lk::Dtype code for torch and numpy, built on first use (neither is imported here)."""

    def __init__(self) -> None:
        self.torch: dict[Any, int] | None = None
        self.numpy: dict[Any, int] | None = None

    def of_torch(self, torch: Any) -> dict[Any, int]:
        if self.torch is None:
            self.torch = {getattr(torch, n): i + 1 for i, n in enumerate(_TORCH_DTYPES)}
        return self.torch

    def of_numpy(self, np: Any) -> dict[Any, int]:
        if self.numpy is None:
            self.numpy = {np.dtype(n): i + 1 for i, n in enumerate(_TORCH_DTYPES) if n != "bfloat16"}
        return self.numpy


_CODES = _Codes()


def _torch_encoder(torch: Any) -> Callable[[list[int], Any], None]:
    codes = _CODES.of_torch(torch)

    def encode(ints: list[int], a: Any) -> None:
        # The hot path of every call: one attribute access per field, nothing else.
        if not a.is_cpu:
            raise ValueError(f"the CPU kernels take CPU tensors, not {a.device}")
        code = codes.get(a.dtype)
        if code is None:
            raise TypeError(f"the CPU kernels do not take {a.dtype} tensors")
        shape = a.shape
        ints += (a.data_ptr(), code, 3, len(shape))  # 3: writable, strides in elements
        ints += shape
        ints += a.stride()

    return encode


def _numpy_encoder(np: Any) -> Callable[[list[int], Any], None]:
    codes = _CODES.of_numpy(np)

    def encode(ints: list[int], a: Any) -> None:
        code = codes.get(a.dtype)
        if code is None:
            raise TypeError(f"the CPU kernels do not take {a.dtype} arrays")
        data, readonly = a.__array_interface__["data"]
        ints += (data, code, 0 if readonly else 1, a.ndim, *a.shape, *a.strides)  # byte strides

    return encode


_ENCODERS: dict[type, Callable[[list[int], Any], None]] = {}


def _put_array(ints: list[int], a: Any) -> None:
    """Append the View encoding of ``a`` (pointer, dtype, flags, ndim, sizes, strides) to ``ints``."""
    encode = _ENCODERS.get(type(a))
    if encode is None:
        torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
        if torch is not None and isinstance(a, torch.Tensor):
            encode = _torch_encoder(torch)
        elif np is not None and isinstance(a, np.ndarray):
            encode = _numpy_encoder(np)
        else:
            raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(a).__name__}")
        _ENCODERS[type(a)] = encode  # per class: Parameter and other subclasses included
    encode(ints, a)


class Kernels:
    """One loaded library, bound to one instruction set: its functions as attributes (module-like).

    Attributes besides the functions: ``isa``, ``__file__`` (the binary), ``origin`` ("prebuilt",
    "cached" or "built"), ``ABI``, ``functions`` (name -> (parameter kinds, return kind)).
    """

    def __init__(self, lib: ctypes.CDLL, path: Path, isa: str, origin: str,
                 threads: Callable[[], int] | None) -> None:
        self.isa = isa
        self.__file__ = str(path)
        self.origin = origin
        self.ABI = int(lib.lk_abi())
        self.functions: dict[str, tuple[str, str]] = {}
        call = lib.lk_call
        last_error = lib.lk_last_error
        number = ISAS.index(isa)
        table = lib.lk_functions().decode()
        for index, item in enumerate(filter(None, table.split(";"))):
            name, params, ret = item.split(":")
            self.functions[name] = (params, ret)
            if not hasattr(self, name):  # a subclass's glue keeps its name
                setattr(self, name, _function(call, last_error, number, index, name, params, ret, threads))

    def __repr__(self) -> str:
        return f"<Kernels {os.path.basename(self.__file__)} isa={self.isa} origin={self.origin}>"


def _function(call: Any, last_error: Any, isa: int, index: int, name: str, params: str, ret: str,
              threads: Callable[[], int] | None) -> Callable[..., Any]:
    nparams = len(params)

    def kernel(*args: Any) -> Any:
        if len(args) != nparams:
            raise TypeError(f"{name}() takes {nparams} arguments ({params}), {len(args)} given")
        ints: list[int] = []
        dbls: list[float] = []
        for kind, a in zip(params, args, strict=True):
            if kind == "T":
                encode = _ENCODERS.get(type(a))
                if encode is None:
                    _put_array(ints, a)
                else:
                    encode(ints, a)
            elif kind == "i":
                ints.append(operator.index(a))
            elif kind == "b":
                ints.append(1 if a else 0)
            elif kind == "d":
                dbls.append(float(a))
            elif kind == "D":
                seq = [float(x) for x in a]
                ints.append(len(seq))
                dbls += seq
            elif kind == "I":
                vals = [operator.index(x) for x in a]
                ints.append(len(vals))
                ints += vals
            else:  # a library newer than this core: load() refuses it by ABI before this
                raise TypeError(f"{name}: unknown parameter kind {kind!r}")
        ia = array("q", ints)
        da = array("d", dbls)
        result = ctypes.c_int64()
        # ctypes releases the GIL for the call; the arrays stay alive until it returns.
        rc = call(isa, index, threads() if threads else 1, ia.buffer_info()[0], len(ia), da.buffer_info()[0],
                  len(da), ctypes.byref(result))
        if rc != 0:
            raise RuntimeError(f"{name}: {last_error().decode(errors='replace')}")
        if ret == "b":
            return bool(result.value)
        if ret == "i":
            return result.value
        return None

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = f"{name}({', '.join(params)}) -> {ret} (compiled kernel)"
    return kernel


def _torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


class KernelLibrary:
    """One kernel library (its source directory holds ``build.json``), loaded once per process.

    ``logger``: the structlog logger name for its messages. ``api``: the :class:`Kernels` subclass
    :meth:`load` returns. ``openmp="torch"``: import torch first and use its OpenMP runtime (each
    call then runs on ``torch.get_num_threads()`` threads); ``None`` for a library built without
    OpenMP use.
    """

    def __init__(self, directory: str | Path, *, logger: str = "loongkit.kernels", api: type[Kernels] = Kernels,
                 openmp: str | None = "torch") -> None:
        self.directory = Path(directory)
        self.spec = Spec.read(self.directory)
        self.name = self.spec.name
        self.log = get_logger(logger)
        self.api = api
        self.openmp = openmp
        self._lock = threading.Lock()
        self.reset()

    # ------------------------------------------------------------------------------------------
    # public

    def load(self, isa: str | None = None) -> Kernels | None:
        """The functions, for ``isa`` (default: the best this CPU supports, or ``LOONGKIT_KERNEL_ISA``);
        None when the library cannot be used (see :meth:`failure`). Never raises for a broken
        toolchain, cache or binary; a ``isa`` this CPU cannot run is a ValueError."""
        if isa is None and self._tried:
            return self._default
        with self._lock:
            if not self._tried:
                self._first_load()
            if isa is None or self._lib is None:
                return self._default if isa is None else None
            if isa not in self._supported:
                raise ValueError(f"{self.name}: instruction set {isa!r} is not usable here "
                                 f"(usable: {', '.join(self._supported)})")
            if isa not in self._variants:
                self._variants[isa] = self._bind(isa)
            return self._variants[isa]

    def failure(self) -> str | None:
        """Why :meth:`load` returned None (None when it did not, or has not run)."""
        return self._failure

    def isas(self) -> tuple[str, ...]:
        """The instruction sets this library can run here, best first (empty if it cannot load)."""
        self.load()
        return tuple(reversed(self._supported))

    def describe(self) -> str:
        """One line for a Summary detail: where the binary came from, which ISA runs, and why a
        prebuilt one was not used (computed once: cheap enough for a hot path)."""
        if self._description is None:
            self._description = self._describe()
        return self._description

    def _describe(self) -> str:
        self.load()
        if self._default is None:
            return f"unavailable: {self._failure}"
        how = {"prebuilt": "prebuilt", "cached": "built earlier on this machine",
               "built": f"built on first use in {self.build_seconds or 0:.1f} s"}[self.origin or "built"]
        text = f"{how}, {self._default.isa}"
        return f"{text}; {self.fallback}" if self.fallback else text

    def reset(self) -> None:
        """Forget the load result (tests; the process keeps the shared object mapped)."""
        with self._lock:
            self._tried = False
            self._lib: ctypes.CDLL | None = None
            self._path: Path | None = None
            self._default: Kernels | None = None
            self._variants: dict[str, Kernels] = {}
            self._supported: list[str] = []
            self._failure: str | None = None
            self._description: str | None = None
            self.origin: str | None = None
            self.fallback: str | None = None  # why the prebuilt binary was not used
            self.build_seconds: float | None = None  # set in the process that compiled it

    def build_key(self, cxx: str | None = None) -> str:
        return build_key(self.spec, cxx)

    def main(self, label: str) -> int:
        """``python -m <plugin>.kernels``: load (building if needed) and say how."""
        start = time.perf_counter()
        lib = self.load()
        if lib is None:
            print(f"{label} kernels unavailable: {self.failure()}", file=sys.stderr)
            return 1
        print(f"{label} kernels ({self.describe()}) loaded in {time.perf_counter() - start:.2f} s: {lib.__file__}")
        return 0

    # ------------------------------------------------------------------------------------------
    # loading

    def _first_load(self) -> None:
        try:
            self._lib, self._path = self._open()
            self._supported = [isa for i, isa in enumerate(ISAS) if self._lib.lk_isa_supported(i)]
            self._default = self._bind(self._pick())
            self._variants[self._default.isa] = self._default
            self.log.debug("kernels loaded", library=self.name, path=str(self._path), origin=self.origin,
                           isa=self._default.isa, fallback=self.fallback)
        except BaseException as exc:  # a kernel must never break the user's program
            if isinstance(exc, KeyboardInterrupt):
                raise
            self._lib, self._default = None, None
            self._failure = _reason(exc)
            if isinstance(exc, BuildError) and exc.output:
                self.log.debug("kernel build output", library=self.name, output=exc.output[-4000:])
            self.log.warning("kernels unavailable; using the reference path", library=self.name,
                             reason=self._failure)
        self._tried = True

    def _pick(self) -> str:
        best = self._supported[-1]
        wanted = os.environ.get(ISA_ENV, "").strip().lower()
        if not wanted:
            return best
        if wanted in self._supported:
            return wanted
        self.log.warning(f"{ISA_ENV}={wanted!r} is not usable here; using {best}", library=self.name,
                         usable=self._supported)
        return best

    def _bind(self, isa: str) -> Kernels:
        assert self._lib is not None and self._path is not None and self.origin is not None
        return self.api(self._lib, self._path, isa, self.origin, _torch_threads if self.openmp == "torch" else None)

    def _open(self) -> tuple[ctypes.CDLL, Path]:
        if self.openmp == "torch":
            self._share_torch_openmp()
        prebuilt = self.spec.binary
        if prebuilt.exists():
            try:
                lib = self._dlopen(prebuilt, check_sources=True)
                self.origin = "prebuilt"
                return lib, prebuilt
            except KernelError as exc:
                self.fallback = f"prebuilt binary {exc}"
            except OSError as exc:
                self.fallback = f"prebuilt binary did not load: {str(exc)[:300]}"
            self.log.warning("prebuilt kernels not used; building them", library=self.name, reason=self.fallback)
        else:
            self.fallback = "no prebuilt binary (a source or editable install)"
        path = self._cached_or_built()
        return self._dlopen(path, check_sources=False), path

    def _share_torch_openmp(self) -> None:
        """Import torch and make its OpenMP runtime the one the library's GOMP_* symbols bind to."""
        import torch  # noqa: F401  (loads torch's libgomp)

        runtimes = openmp_runtimes()
        if not runtimes:
            raise KernelError("torch loaded no OpenMP runtime (libgomp/libiomp5/libomp) for the kernels to share")
        # Usually global already (torch loads it RTLD_GLOBAL through libtorch_global_deps);
        # RTLD_NOLOAD guarantees this only promotes the loaded copy, never loads another one.
        ctypes.CDLL(runtimes[0], mode=os.RTLD_NOW | os.RTLD_GLOBAL | os.RTLD_NOLOAD)

    def _dlopen(self, path: Path, check_sources: bool) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        lib.lk_abi.restype = ctypes.c_int32
        abi = lib.lk_abi()
        if abi != kernelbuild.ABI:
            raise KernelError(f"speaks kernel ABI {abi}, this loongkit-core {kernelbuild.ABI}")
        lib.lk_source_key.restype = ctypes.c_char_p
        if check_sources:
            try:
                expected = self.spec.source_key()
            except OSError:  # sources not shipped: nothing to rebuild from anyway
                expected = None
            built_from = lib.lk_source_key().decode()
            if expected is not None and built_from != expected:
                raise KernelError(f"is stale: built from other sources ({built_from or '?'} != {expected})")
        lib.lk_isa_supported.restype = ctypes.c_int32
        lib.lk_isa_supported.argtypes = [ctypes.c_int32]
        lib.lk_functions.restype = ctypes.c_char_p
        lib.lk_last_error.restype = ctypes.c_char_p
        lib.lk_call.restype = ctypes.c_int32
        lib.lk_call.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64,
                                ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
        return lib

    def _cached_or_built(self) -> Path:
        cxx = compiler()
        directory = cache_root() / f"{self.name}-{self.build_key(cxx)}"
        so = directory / f"{self.name}.so"
        if so.exists():
            self.origin = "cached"
            return so
        if cxx is None:
            raise KernelError(f"no C++ compiler ({os.environ.get('CXX') or 'c++'} not on PATH) to build the kernels")
        directory.mkdir(parents=True, exist_ok=True)  # OSError on a read-only cache
        with open(directory / "build.lock", "w") as lock:
            waited = time.perf_counter()
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
            waited = time.perf_counter() - waited
            if so.exists():
                self.log.info("kernels built by another process", library=self.name, waited_s=round(waited, 3))
                self.origin = "cached"
                return so
            self.build_seconds = kernelbuild.build(self.spec, so, cxx)
        self.origin = "built"
        # Once per machine and key (the lock makes a single builder): the one-time compilation.
        self.log.info("built the kernels (one-time compilation)", library=self.name,
                      seconds=round(self.build_seconds, 2), path=str(so), why=self.fallback)
        return so
