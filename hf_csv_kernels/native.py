"""hf_csv's own int8 screen GEMV (``csrc/screen_avx2.c``), compiled on first use and loaded with ctypes.

Why a kernel of our own next to fbgemm's dynamic linear:

* **No prepack.** fbgemm needs its packed layout, which takes seconds on a large head (docs/benchmarks.md §7)
  and cannot be saved. This kernel reads the int8 codes as they are (row-major)
  at once, and a 4-row interleaved copy (one cheap pass, built in the background) a little faster.
* **8-bit activations.** fbgemm quantizes activations to 7 bits (``reduce_range``); this kernel multiplies
  signed 8-bit activations exactly (the sign trick, see the C source), so the screen's activation term —
  most of its radius on real heads — is about halved.
* **Dynamic row schedule.** Threads take chunks of rows from an atomic counter; a thread on a core shared with
  another process takes fewer rows instead of holding the others at a join.

**Paths.** The integer dot product has three implementations (:data:`PATHS`, best first): ``avx512vnni``
(``vpdpbusd`` with AVX-512VL), ``avxvnni`` (its VEX form) and ``avx2`` (``maddubs`` + ``madd``). Each is exact in
int32 (the C source says why), so the screen's values do not depend on the path. The library is built for the best
path this CPU reports (``/proc/cpuinfo`` flags) and the compiler accepts, then **self-tested** at load on random
codes (row-major and interleaved, one and two threads, ±127 extremes) against an int64 reference, bit for bit; a path
that fails to build or to match is never used: the next one is tried and the reason logged. ``HF_CSV_SCREEN_PATH``
forces one path (tests and the fuzzer use it); a forced path the CPU cannot run leaves the native kernel unavailable
(fbgemm serves, same values) with the reason in :func:`why_unavailable`. :func:`path` names the path in use.

It needs an x86-64 CPU with AVX2 and a C compiler (``$CC`` or ``cc``) the first time on a machine; the library
is cached under ``$HF_CSV_KERNEL_CACHE`` (default ``~/.cache/hf_csv/kernels``), keyed by the source and flags.
Where it cannot be built or loaded, :func:`available` is False, :func:`why_unavailable` says why, and the
screen uses fbgemm as before. ``HF_CSV_NATIVE=0`` turns it off. This module imports neither ``hf_csv`` nor
transformers.
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
import threading
import time
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from hf_csv_kernels.floats import NonFiniteWeightError, round_up_f32

logger = logging.getLogger(__name__)

__all__ = ["available", "why_unavailable", "path", "runnable_paths", "simd_flags", "load_path", "PATHS", "screen_i8", "interleave",
           "min_code", "row_terms", "top1", "Top1Result", "top1_constants", "MAX_D"]

_SRC = Path(__file__).with_name("csrc") / "screen_avx2.c"
# -ffp-contract=off: no product and sum fuse, so the float steps that mirror torch ops round as those ops do (hf_csv_top1)
_FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fPIC", "-shared", "-pthread", "-std=c11"]
# best first: (extra compiler flags, /proc/cpuinfo flags the path needs)
PATHS = ("avx512vnni", "avxvnni", "avx2")
_PATH_FLAGS = {"avx512vnni": (["-DHF_CSV_PATH_AVX512VNNI", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
                              ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")),
               "avxvnni": (["-DHF_CSV_PATH_AVXVNNI", "-mavxvnni"], ("avx_vnni",)),
               "avx2": ([], ("avx2", "fma"))}
# int32 partial sums stay below 2^31 while 127·127·d does (csrc/screen_avx2.c)
MAX_D = (2 ** 31 - 1) // (127 * 127)

# below this many multiply-adds a call runs on the calling thread alone (waking the pool costs more than the work)
_SMALL = 1 << 22

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_why: Optional[str] = None
_tried = False
_path: Optional[str] = None
load_seconds: Optional[float] = None  # this process's build-or-load time of the library (benchmarks report it)


def _cache_dir() -> Path:
    return Path(os.environ.get("HF_CSV_KERNEL_CACHE") or Path.home() / ".cache" / "hf_csv" / "kernels")


def _cpu_ok() -> Optional[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - very old torch
        cap = "unknown"
    if cap not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch reports {cap})"
    return None


def _torch_openmp() -> bool:
    """torch's intra-op threads are an OpenMP team of libgomp (the Linux wheels): the kernel then takes its threads
    from the same runtime (csrc/screen_avx2.c, run_threads), once this process has it mapped."""
    try:
        if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
            return False
        with open("/proc/self/maps") as f:
            return any("libgomp" in line for line in f)
    except Exception:  # pragma: no cover - no /proc, exotic builds
        return False


def gomp_copies() -> int:
    """How many distinct libgomp files this process maps (1 where the kernel shares torch's OpenMP runtime)."""
    try:
        with open("/proc/self/maps") as f:
            return len({line.split()[-1] for line in f if "libgomp" in line})
    except Exception:  # pragma: no cover
        return 0


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:  # pragma: no cover - no /proc
        pass
    return set()


def simd_flags() -> list:
    """This CPU's flags that choose a kernel path or name the host in a benchmark (avx2, fma, avx512*, avx_vnni, amx*),
    sorted; empty without /proc/cpuinfo."""
    return sorted(f for f in _cpu_flags() if f.startswith(("avx512", "avx_vnni", "amx")) or f in ("avx2", "fma"))


def runnable_paths() -> list:
    """The kernel paths this CPU reports the instructions for, best first (``avx2`` on any AVX2 host)."""
    flags = _cpu_flags()
    out = [p for p in PATHS if all(f in flags for f in _PATH_FLAGS[p][1])]
    if "avx2" not in out and _cpu_ok() is None:  # no /proc/cpuinfo: torch saw AVX2
        out.append("avx2")
    return out


def load_path(name: str) -> ctypes.CDLL:
    """Build (cached) and load the kernel for path ``name``, then self-test it; raises RuntimeError where the CPU
    lacks the path's instructions, the build fails, or the self-test finds a difference."""
    if name not in PATHS:
        raise ValueError(f"unknown kernel path {name!r}; use one of {PATHS}")
    if name not in runnable_paths():
        need = ", ".join(_PATH_FLAGS[name][1])
        raise RuntimeError(f"this CPU lacks the {name} path's instructions ({need})")
    extra = list(_PATH_FLAGS[name][0])
    pf = os.environ.get("HF_CSV_SCREEN_PREFETCH", "").strip()
    if pf:  # the interleaved loop's software prefetch distance in bytes (default 2048 in the C source; 0 = none)
        extra.append(f"-DHF_CSV_PREFETCH={int(pf)}")
    lib = None
    if _torch_openmp():
        try:
            lib = _build_with(_FLAGS + extra + ["-fopenmp"], name)
        except Exception as e:
            logger.info("hf_csv: the OpenMP build of the native kernel failed (%s); POSIX threads serve", e)
    if lib is None:
        lib = _build_with(_FLAGS + extra, name)
    got = PATHS[::-1][int(lib.hf_csv_path())]
    if got != name:
        raise RuntimeError(f"the {name} build reports path {got}")
    _self_test(lib)
    return lib


def _self_test(lib: ctypes.CDLL) -> None:
    """Raise unless the library's screen equals fl(fl(fl(dot)·s_i)·cr_r) with the dot product in int64, bit for bit, on
    random codes with ±127 extremes: row-major and interleaved, one and two threads, odd V and d (tails of every
    loop). Takes a few milliseconds."""
    g = torch.Generator().manual_seed(1234)
    for V, d, N in ((67, 77, 3), (131, 256, 1), (8, 1000, 2)):
        q = torch.randint(-127, 128, (V, d), generator=g, dtype=torch.int8)
        q[0, :] = 127
        q[1, :] = -127
        A = torch.randint(-127, 128, (N, d), generator=g, dtype=torch.int8)
        A[0, : d // 2] = -127
        scale = torch.rand(V, generator=g) * 1e-2 + 1e-4
        cr = torch.rand(N, generator=g) + 0.5
        dot = A.long() @ q.long().T  # exact
        ref = dot.float() * scale[None] * cr[:, None]
        qi = torch.empty_like(q)
        lib.hf_csv_interleave4(q.data_ptr(), V, d, qi.data_ptr())
        for codes, il in ((q, 0), (qi, 1)):
            for threads in (1, 2):
                out = torch.empty(N, V, dtype=torch.float32)
                lib.hf_csv_screen_i8(codes.data_ptr(), scale.data_ptr(), V, d, A.data_ptr(), cr.data_ptr(), N,
                                     out.data_ptr(), threads, 8, il)
                if not torch.equal(out, ref):
                    bad = int((out != ref).sum())
                    raise RuntimeError(f"self-test: {bad} of {out.numel()} screen values differ from the int64 "
                                       f"reference (V={V}, d={d}, interleaved={il}, threads={threads})")


def _build() -> ctypes.CDLL:
    """The kernel for ``HF_CSV_SCREEN_PATH`` if set, else for the best path that builds and passes its self-test."""
    global _path
    forced = os.environ.get("HF_CSV_SCREEN_PATH", "").strip().lower()
    if forced:
        if forced not in PATHS:
            raise RuntimeError(f"HF_CSV_SCREEN_PATH={forced!r} is not one of {PATHS}")
        lib = load_path(forced)
        _path = forced
        return lib
    errors = []
    for name in runnable_paths():
        try:
            lib = load_path(name)
        except Exception as e:  # a compiler without the instructions, a failed self-test: the next path
            errors.append(f"{name}: {e}")
            logger.warning("hf_csv: the %s path of the native int8 screen is not used (%s); trying the next", name, e)
            continue
        _path = name
        return lib
    raise RuntimeError("; ".join(errors) or "no kernel path for this CPU")


def _source() -> bytes:
    """The kernel's C source: the package's csrc/ file, or (in a copy without it: the vendored hf_csv of a Hub
    ``custom_generate`` folder, which transformers fills with .py files only) the same text carried as a module."""
    if _SRC.is_file():
        return _SRC.read_bytes()
    from .csrc_screen_avx2 import SOURCE

    return SOURCE.encode()


def _build_with(flags: list, name: str = "avx2") -> ctypes.CDLL:
    src = _source()
    cc = os.environ.get("CC") or "cc"
    key = hashlib.sha256(src + " ".join([cc] + flags).encode()).hexdigest()[:16]
    out = _cache_dir() / f"screen_{name}-{key}.so"
    if not out.is_file():
        if shutil.which(cc) is None:
            raise RuntimeError(f"no C compiler ({cc!r} not found; set CC)")
        out.parent.mkdir(parents=True, exist_ok=True)
        src_path = _SRC
        if not src_path.is_file():  # (compile the carried text from a file of its own, named by its hash)
            src_path = out.with_suffix(".c")
            src_path.write_bytes(src)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            r = subprocess.run([cc, *flags, str(src_path), "-o", tmp], capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[:500]}")
            os.replace(tmp, out)  # atomic: concurrent builders each write their own file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(out))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.hf_csv_screen_i8.argtypes = [p, p, i64, i64, p, p, i64, p, i32, i64, i32]
    lib.hf_csv_screen_i8.restype = i32
    lib.hf_csv_interleave4.argtypes = [p, i64, i64, p]
    lib.hf_csv_interleave4.restype = i32
    lib.hf_csv_min_i8.argtypes = [p, i64]
    lib.hf_csv_min_i8.restype = i32
    lib.hf_csv_row_terms.argtypes = [p, p, p, i64, i64, p, p, p, i32]
    lib.hf_csv_row_terms.restype = i32
    lib.hf_csv_quantize_i8.argtypes = [p, i64, i64, p, p, p, p, p, p, i32]
    lib.hf_csv_quantize_i8.restype = i32
    lib.hf_csv_outlier_cols.argtypes = [p, p, p, i64, i64, p, i64, p, p, i32]
    lib.hf_csv_outlier_cols.restype = i32
    lib.hf_csv_screen_bounds.argtypes = [p, p, i64, i64, p, i64, p, i64, p, i32, p, p, p, p, p, p, p, p, i32, i64, i32]
    lib.hf_csv_screen_bounds.restype = i32
    lib.hf_csv_openmp.argtypes = []
    lib.hf_csv_openmp.restype = i32
    lib.hf_csv_path.argtypes = []
    lib.hf_csv_path.restype = i32
    lib.hf_csv_top1.argtypes = [p, i32, i64, i64, p, p, p, i64, p, p, i64, p, p, p, p, p, p, p]
    lib.hf_csv_top1.restype = i64
    return lib


def _load() -> Optional[ctypes.CDLL]:
    global _lib, _why, _tried, load_seconds
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            t0 = time.perf_counter()
            if os.environ.get("HF_CSV_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
                _why = "turned off (HF_CSV_NATIVE=0)"
            else:
                _why = _cpu_ok()
                if _why is None:
                    try:
                        _lib = _build()
                    except Exception as e:  # no compiler, a failed build, a library that will not load
                        _why = f"could not build the native int8 kernel ({e})"
            if _why is not None and _why.startswith("could not build"):
                # a fixable cause (no compiler, a broken toolchain): say it once, at WARNING, with the fix
                logger.warning("hf_csv: %s. The int8 screen falls back to fbgemm: the same results, slower (a large "
                               "head uses the full head while it is packed). Install a C compiler (e.g. `apt install "
                               "gcc`) or set CC; HF_CSV_NATIVE=0 silences this.", _why)
            elif _why is not None:
                logger.info("hf_csv: native int8 screen unavailable (%s); fbgemm serves", _why)
            load_seconds = time.perf_counter() - t0
            _tried = True
    return _lib


def available() -> bool:
    """True when the native kernel is built and loaded (builds it on the first call in a process)."""
    return _load() is not None


def path() -> Optional[str]:
    """The kernel path in use (``avx512vnni``, ``avxvnni`` or ``avx2``), or None when the kernel is unavailable."""
    _load()
    return _path


def uses_openmp() -> bool:
    """True when the kernel's threads come from the process's OpenMP runtime (torch's), not threads of its own."""
    lib = _load()
    return lib is not None and bool(lib.hf_csv_openmp())


def why_unavailable() -> Optional[str]:
    """Why :func:`available` is False (None when it is True)."""
    _load()
    return _why


def _lib_or_raise() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"hf_csv native kernel unavailable: {_why}")
    return lib


def min_code(q: torch.Tensor) -> int:
    """The smallest code of a contiguous int8 CPU tensor (one vectorized pass)."""
    if q.dtype != torch.int8 or q.device.type != "cpu" or not q.is_contiguous():
        raise ValueError("min_code needs a contiguous int8 CPU tensor")
    return int(_lib_or_raise().hf_csv_min_i8(q.data_ptr(), q.numel())) if q.numel() else 127


def interleave(q: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(The 4-row interleaved copy of ``q`` [V, d], its smallest code); layout in csrc/screen_avx2.c."""
    if q.dtype != torch.int8 or q.device.type != "cpu" or q.dim() != 2:
        raise ValueError("interleave needs a 2-D int8 CPU tensor")
    q = q.contiguous()
    out = torch.empty_like(q)
    mn = _lib_or_raise().hf_csv_interleave4(q.data_ptr(), q.shape[0], q.shape[1], out.data_ptr())
    return out, int(mn)


def screen_i8(q: torch.Tensor, scale: torch.Tensor, A: torch.Tensor, cr: torch.Tensor, interleaved: bool,
              threads: Optional[int] = None, chunk: int = 2048) -> torch.Tensor:
    """out[r, i] = fl(fl(fl(Σ_j q_ij·A_rj)·scale_i)·cr_r): the dot product exact in int32, then three roundings.

    ``q``: int8 [V, d] codes in [−127, 127] (row-major, or :func:`interleave`'s layout with ``interleaved``);
    ``A``: int8 [N, d] in [−127, 127]; ``scale`` float32 [V]; ``cr`` float32 [N]. The caller guarantees the
    code ranges (a −128 would overflow the sign trick): :class:`hf_csv_kernels.screen.ScreenState` checks
    the codes once with :func:`min_code` / :func:`interleave` before it uses this kernel.
    """
    lib = _lib_or_raise()
    V, d = q.shape
    N = A.shape[0]
    if d > MAX_D:
        raise ValueError(f"hidden size {d} > {MAX_D}: int32 partial sums could overflow")
    for t, dt, shape in ((q, torch.int8, (V, d)), (A, torch.int8, (N, d)), (scale, torch.float32, (V,)),
                         (cr, torch.float32, (N,))):
        if t.dtype != dt or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"screen_i8: expected a contiguous CPU {dt} tensor of shape {shape}, got "
                             f"{t.dtype} {tuple(t.shape)}")
    out = torch.empty(N, V, dtype=torch.float32)
    n = torch.get_num_threads() if threads is None else int(threads)
    if threads is None and V * d * N < _SMALL:
        n = 1  # a thread's start and join (tens of µs) would cost more than its share of the work
    lib.hf_csv_screen_i8(q.data_ptr(), scale.data_ptr(), V, d, A.data_ptr(), cr.data_ptr(), N, out.data_ptr(),
                         max(1, n), int(chunk), int(bool(interleaved)))
    return out


def block8(w: torch.Tensor) -> torch.Tensor:
    """float32 [V, k] -> [ceil(V / 8), k, 8]: each block of 8 rows column by column (rows padded with zeros), the
    layout in which :func:`screen_bounds` reads the outlier columns (8 rows per FMA)."""
    V, k = w.shape
    pad = torch.zeros((V + 7) // 8 * 8, k, dtype=torch.float32)
    pad[:V] = w
    return pad.view(pad.shape[0] // 8, 8, k).transpose(1, 2).contiguous()


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def screen_bounds(q: torch.Tensor, scale: torch.Tensor, interleaved: bool, H: torch.Tensor, cols: torch.Tensor,
                  wJ: torch.Tensor, rest_norm: bool, K: tuple, terms: list, bias: Optional[torch.Tensor] = None,
                  threads: Optional[int] = None, chunk: int = 2048,
                  checked: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The screen and its upper bounds from the hidden states in one call: (est, upper, top), float32 [N, V] twice
    and int64 [N] (the first index of each row's largest ``est``; -1 where every estimate of a row is NaN).

    Per row (csrc/screen_avx2.c, ``hf_csv_screen_bounds``): the columns ``cols`` of h are split off (h_R: the
    rest), X = h_R/m with m = ||h_R||_∞, a = round(127·X) in int8 (Lemma 2′), then
    est_i = fl(fl(fl(Σ_j q_ij·a_j)·scale_i)·fl(m/127)) + Σ_{j∈cols} wJ_ij·h_j (float32) + bias_i, and
    upper_i >= est_i + Σ_t c_t·terms[t]_i + c_3·|bias_i| in real arithmetic, with c = (‖h_R‖₂·K0 (‖h‖₂ without
    ``rest_norm``; the norm in float64, raised by 10⁻¹⁰), m·K1 + ‖h‖_∞·K2, ‖h‖_∞·K3, K4). ``terms``: two or three
    float32 [V] vectors; ``wJ``: the outlier columns in :func:`block8`'s layout. ``checked``: the caller has
    validated everything but ``H`` before (the screen's state does so once). Code ranges as for :func:`screen_i8`.
    """
    lib = _lib_or_raise()
    V, d = q.shape
    k = cols.numel()
    if H.dtype != torch.float32 or H.dim() != 2 or H.shape[1] != d or not H.is_contiguous() or H.device.type != "cpu":
        raise ValueError(f"screen_bounds: H must be a contiguous CPU float32 [N, {d}] tensor")
    if not checked:
        check_bounds_inputs(q, scale, cols, wJ, terms, bias)
    N = H.shape[0]
    chunk = max(8, (int(chunk) + 7) & ~7)  # the epilogue reads W_J in blocks of 8 rows
    est = torch.empty(N, V, dtype=torch.float32)
    upper = torch.empty(N, V, dtype=torch.float32)
    top = torch.empty(N, dtype=torch.int64)
    n = torch.get_num_threads() if threads is None else int(threads)
    if threads is None and V * d * N < _SMALL:
        n = 1
    Kd = (ctypes.c_double * 5)(*[float(x) for x in K])
    ran = lib.hf_csv_screen_bounds(q.data_ptr(), scale.data_ptr(), V, d, H.data_ptr(), N, cols.data_ptr() if k else None,
                                   k, wJ.data_ptr() if k else None, int(bool(rest_norm)), ctypes.addressof(Kd), _ptr(bias),
                                   terms[0].data_ptr(), terms[1].data_ptr(), _ptr(terms[2] if len(terms) == 3 else None),
                                   est.data_ptr(), upper.data_ptr(), top.data_ptr(), max(1, n), chunk,
                                   int(bool(interleaved)))
    if ran < 0:
        raise MemoryError("screen_bounds: no memory for the kernel's workspace")
    return est, upper, top


def check_bounds_inputs(q: torch.Tensor, scale: torch.Tensor, cols: torch.Tensor, wJ: torch.Tensor, terms: list,
                        bias: Optional[torch.Tensor]) -> None:
    """What :func:`screen_bounds` needs of everything but the hidden states (raises ValueError)."""
    V, d = q.shape
    k = cols.numel()
    if d > MAX_D:
        raise ValueError(f"hidden size {d} > {MAX_D}: int32 partial sums could overflow")
    if not 2 <= len(terms) <= 3:
        raise ValueError("screen_bounds takes two or three per-row terms")
    checks = [(q, torch.int8, (V, d)), (scale, torch.float32, (V,)), (cols, torch.int64, (k,))]
    checks += [(t, torch.float32, (V,)) for t in terms]
    if k:
        checks.append((wJ, torch.float32, ((V + 7) // 8, k, 8)))
    if bias is not None:
        checks.append((bias, torch.float32, (V,)))
    for t, dt, shape in checks:
        if t.dtype != dt or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"screen_bounds: expected a contiguous CPU {dt} tensor of shape {shape}, got "
                             f"{t.dtype} {tuple(t.shape)}")
    if k and (int(cols.min()) < 0 or int(cols.max()) >= d or cols.unique().numel() != k):
        raise ValueError(f"screen_bounds: outlier columns must be distinct and in [0, {d})")


# Each float64 sum of n <= MAX_D (< 133,000) nonnegative terms, every term within 3·2^-53 of its real value,
# errs by at most (n + 3)·2^-53 < 1.5e-11 relatively; the square root and the products below add a few 2^-53 more
_RAISE = 1.0 + 1e-10


def _check_head_codes(fn: str, weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """ValueError unless ``weight`` [V, d] float32, ``q`` [V, d] int8 and ``scale`` [V] float32 are contiguous CPU
    tensors (``V, d`` from ``q``): what the C passes over a head and its codes read."""
    V, d = q.shape
    for t, dt, shape in ((weight, torch.float32, (V, d)), (q, torch.int8, (V, d)), (scale, torch.float32, (V,))):
        if t.dtype != dt or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{fn}: expected a contiguous CPU {dt} tensor of shape {shape}, got "
                             f"{t.dtype} {tuple(t.shape)}")


def row_terms(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
              threads: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(err_l2, l1, abs_l1), float32 [V]: rounded-up bounds on ||W_i − s_i q_i||_2, ||s_i q_i||_1 and ||W_i||_1 for a
    float32 head ``weight`` [V, d] and its int8 codes ``q`` (scale ``s``), in one pass over memory — the terms of
    :class:`hf_csv_kernels.quantize.Int8Rows`, a little tighter than the quantizer's float32 torch pass (which
    serves where this kernel does not: other dtypes and formats, other hosts).

    In C: s_i·q_ij exact in float64, each difference, square and add rounded once (2^-53), so the float64 sums
    are within (d + 3)·2^-53 < 1.5e-11 relatively of the real ones; l1 = s_i·Σ|q_ij| with the integer sum exact.
    Here each is raised by 1 + 1e-10 (in float64, after the square root for err_l2) and rounded up to float32.
    """
    lib = _lib_or_raise()
    V, d = q.shape
    if d > MAX_D:
        raise ValueError(f"hidden size {d} > {MAX_D}")
    _check_head_codes("row_terms", weight, q, scale)
    err2 = torch.empty(V, dtype=torch.float64)
    absl1 = torch.empty(V, dtype=torch.float64)
    l1q = torch.empty(V, dtype=torch.int64)
    n = torch.get_num_threads() if threads is None else int(threads)
    lib.hf_csv_row_terms(weight.data_ptr(), q.data_ptr(), scale.data_ptr(), V, d, err2.data_ptr(), l1q.data_ptr(),
                         absl1.data_ptr(), max(1, n))
    return _bounds_from_sums(err2, l1q, absl1, scale)


def _bounds_from_sums(err2: torch.Tensor, l1q: torch.Tensor, absl1: torch.Tensor,
                      scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`row_terms`' float32 bounds from the C sums (each raised by 1 + 1e-10, rounded up)."""
    err_l2 = round_up_f32(err2.sqrt_().mul_(_RAISE))
    l1 = round_up_f32(l1q.double().mul_(scale.double()).mul_(_RAISE))
    abs_l1 = round_up_f32(absl1.mul_(_RAISE))
    return err_l2, l1, abs_l1


def quantize_i8(weight: torch.Tensor, interleaved: bool = True, threads: Optional[int] = None) -> dict:
    """hf_csv's one-pass int8 quantizer for a contiguous float32 CPU head ``weight`` [V, d]: the codes and scales of
    :func:`hf_csv_kernels.quantize.quantize_rows_int8`'s torch path bit for bit (scale_i = max|W_i| / 127, codes
    round-half-to-even of W_ij / scale_i clamped to ±127: never −128), the error terms of :func:`row_terms` (the same C
    sums, so a recompute agrees bit for bit) and, with ``interleaved``, the codes' 4-row interleaved copy
    (:func:`interleave`'s), in one read of the weight. Returns a dict ``q, qi, scale, err_l2, l1, abs_l1`` (``qi`` None
    without ``interleaved``). ValueError on a weight that is not finite."""
    lib = _lib_or_raise()
    if weight.dtype != torch.float32 or weight.dim() != 2 or not weight.is_contiguous() or weight.device.type != "cpu":
        raise ValueError(f"quantize_i8 needs a contiguous 2-D float32 CPU tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    V, d = weight.shape
    if d > MAX_D:
        raise ValueError(f"hidden size {d} > {MAX_D}")
    q = torch.empty(V, d, dtype=torch.int8)
    qi = torch.empty(V, d, dtype=torch.int8) if interleaved else None
    scale = torch.empty(V, dtype=torch.float32)
    err2 = torch.empty(V, dtype=torch.float64)
    absl1 = torch.empty(V, dtype=torch.float64)
    l1q = torch.empty(V, dtype=torch.int64)
    n = torch.get_num_threads() if threads is None else int(threads)
    rc = lib.hf_csv_quantize_i8(weight.data_ptr(), V, d, q.data_ptr(), _ptr(qi), scale.data_ptr(), err2.data_ptr(),
                                l1q.data_ptr(), absl1.data_ptr(), max(1, n))
    if rc != 0:
        raise NonFiniteWeightError("head weight contains non-finite values")
    err_l2, l1, abs_l1 = _bounds_from_sums(err2, l1q, absl1, scale)
    return dict(q=q, qi=qi, scale=scale, err_l2=err_l2, l1=l1, abs_l1=abs_l1)


def outlier_cols(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, cols: torch.Tensor,
                 threads: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(W[:, cols] as float32 [V, k], exactly; per row the float64 sum over those columns of (W_ij − s_i q_ij)²,
    within (k + 2)·2^-53 relatively of the real sum) for a contiguous float32 CPU head ``weight`` [V, d] and its
    contiguous int8 codes ``q``, in one pass over the rows: what :func:`hf_csv_kernels.screen.make_outliers` needs,
    without a strided gather per column."""
    lib = _lib_or_raise()
    V, d = q.shape
    cols = cols.to(torch.int64).contiguous()
    _check_head_codes("outlier_cols", weight, q, scale)
    k = cols.numel()
    if k and (int(cols.min()) < 0 or int(cols.max()) >= d):
        raise ValueError(f"outlier columns must lie in [0, {d})")
    wJ = torch.empty(V, k, dtype=torch.float32)
    low = torch.empty(V, dtype=torch.float64)
    n = torch.get_num_threads() if threads is None else int(threads)
    lib.hf_csv_outlier_cols(weight.data_ptr(), q.data_ptr(), scale.data_ptr(), V, d, cols.data_ptr(), k,
                            wJ.data_ptr(), low.data_ptr(), max(1, n))
    return wJ, low


def top1_constants(gam: float, underflow: float, l1_max: float, b_max: float) -> torch.Tensor:
    """The float32 constants :func:`top1` takes, each rounded to nearest from the Python float as torch rounds a
    scalar operand of a float32 op: γ, the underflow term, max ||W_i||_1, max |b|, 1 + 1e-6, the slack coefficient
    2γ(1 + 2γ)(1 + 1e-6) and twice the underflow term (hf_csv.core.certificate.values.HeadValues._values)."""
    return torch.tensor([gam, underflow, l1_max, b_max, 1 + 1e-6, 2 * gam * (1 + 2 * gam) * (1 + 1e-6),
                         2 * underflow], dtype=torch.float32)


class Top1Result(NamedTuple):
    """What :func:`top1` returns: S's candidates row by row, tokens ascending (on a negative code, the rest None)."""
    n: int  # the candidates of all rows (the sum of counts); negative: a code (the C source) for the torch path
    logits: Optional[torch.Tensor]  # [N, V] in the head's dtype: the values on S, -inf elsewhere
    mask: Optional[torch.Tensor]  # [N, V] bool: S
    rows: Optional[torch.Tensor]  # [n] int64: each candidate's row
    toks: Optional[torch.Tensor]  # [n] int64: its token
    acc: Optional[torch.Tensor]  # [n] float32: its accumulator (its value is it rounded to the head's dtype)
    ent: Optional[torch.Tensor]  # [n] float32: its slack (>= |acc - stock's accumulator|)
    out: Optional[torch.Tensor]  # [N, 4] float32 per row: the cut t, the bound, the row's slack, its radius sum
    counts: Optional[torch.Tensor]  # [N] int64: |S| per row


def top1(weight: torch.Tensor, H: torch.Tensor, upper: torch.Tensor, seeds: torch.Tensor, abs_l1: torch.Tensor,
         cst: torch.Tensor, limit: int) -> Top1Result:
    """The top-1 epilogue of ``hf_csv.core.certificate.topk.TopKCertificates._topk`` in one C call (``hf_csv_top1``)
    with the torch path's guarantees (docs/certificates.md §2.1, §2.0), on a float32 or bfloat16 head ``weight`` [V, d]
    (no bias), float32 rows ``H`` [N, d], ``upper`` [N, V], int64 seeds [N], ``cst``: all contiguous CPU, as checked."""
    lib = _lib_or_raise()
    V, d = weight.shape
    N, bf16 = H.shape[0], weight.dtype == torch.bfloat16
    limit = max(1, min(int(limit), V - 1))
    logits, mask = torch.empty(N, V, dtype=weight.dtype), torch.empty(N, V, dtype=torch.bool)
    toks = torch.empty(N, limit, dtype=torch.int64)
    acc, ent = torch.empty(N, limit, dtype=torch.float32), torch.empty(N, limit, dtype=torch.float32)
    out, counts = torch.empty(N, 4, dtype=torch.float32), torch.empty(N, dtype=torch.int64)
    n = int(lib.hf_csv_top1(weight.data_ptr(), int(bf16), V, d, H.data_ptr(), upper.data_ptr(), seeds.data_ptr(), N,
                            abs_l1.data_ptr(), cst.data_ptr(), limit, logits.data_ptr(), mask.data_ptr(),
                            toks.data_ptr(), acc.data_ptr(), ent.data_ptr(), out.data_ptr(), counts.data_ptr()))
    if n < 0:
        return Top1Result(n, None, None, None, None, None, None, None, None)
    if N == 1:
        rows = torch.zeros(n, dtype=torch.int64)
        return Top1Result(n, logits, mask, rows, toks[0, :n], acc[0, :n], ent[0, :n], out, counts)
    keep = torch.arange(limit)[None, :] < counts[:, None]
    rows = torch.repeat_interleave(torch.arange(N), counts)
    return Top1Result(n, logits, mask, rows, toks[keep], acc[keep], ent[keep], out, counts)
