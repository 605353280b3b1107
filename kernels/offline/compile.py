"""What the offline compile check compiles and how (``offline.py`` is the check, its table and its
command line): the targets, the kernels and their cases, the launch's specialisation built by the
launchers' own argument builders, and one fresh compile with ``ptxas -v``'s report."""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from .. import block_sparse_bwd_triton as bwd
from .. import block_sparse_tma as tma
from .. import block_sparse_triton as bst
from .. import block_sparse_varlen_triton as bsv
from . import sass_census
from .. import triton_tuning as tuning
from ..triton_tuning import env_var as _env
from ..quant import triton_fixed as qfx
from ..quant import triton_varlen as qvl

KIB = 1024


@dataclass(frozen=True)
class Target:
    name: str
    capability: int
    shared_limit: int  # opt-in shared memory a block, bytes
    gpus: str


TARGETS = {t.name: t for t in (
    Target("sm_80", 80, 163 * KIB, "A100"),
    Target("sm_86", 86, 99 * KIB, "RTX 30xx, A40, A10"),
    Target("sm_89", 89, 99 * KIB, "RTX 40xx, L4, L40"),
    Target("sm_90", 90, 227 * KIB, "H100, H200"),
    Target("sm_100", 100, 227 * KIB, "B200"),
    Target("sm_120", 120, 99 * KIB, "RTX 50xx"),
)}
CI_TARGETS = ("sm_80", "sm_89", "sm_90")
HEAD_DIMS = (64, 128)
DTYPES = ("bf16", "fp16", "fp32")
_TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# kernel name -> the raw @triton.jit function
KERNELS = {
    "fixed": bst._block_sparse_fwd_kernel,
    "skip": bst._block_sparse_fwd_kernel,
    "fixed_tma": tma._tma_fwd_kernel,
    "varlen": bsv._varlen_fwd_kernel,
    "bwd_dq": bwd._bwd_dq_kernel,
    "bwd_dkdv": bwd._bwd_dkdv_kernel,
    "varlen_bwd_dq": bwd._varlen_bwd_dq_kernel,
    "varlen_bwd_dkdv": bwd._varlen_bwd_dkdv_kernel,
    "quant": qfx._quant_attn_kernel,
    "quant_fp8": qfx._quant_attn_kernel,
    "quant_varlen": qvl._quant_varlen_kernel,
    "quantize": qfx._quantize_kernel,
}
BWD_KERNELS = ("bwd_dq", "bwd_dkdv", "varlen_bwd_dq", "varlen_bwd_dkdv")
#: quantised attention (``quant=``): half types only; FP8 P.V from sm_89 on
QUANT_KERNELS = ("quant", "quant_fp8", "quant_varlen", "quantize")


def quant_config(kernel, head_dim):
    """The one launch config of a quantised kernel (its launcher's, for 128-token plan blocks)."""
    if kernel == "quantize":
        return (qfx.QUANTIZE_ROWS, 0, 4, 3)  # Triton's default warps / stages
    if kernel == "quant_varlen":
        return (*qvl.varlen_tiles(False), 8, 2)
    bm, bn = qfx.tiles(_PLAN_BLOCK, _PLAN_BLOCK, False)
    return (bm, bn, 4 if bm <= 64 else 8, 2)

# the representative launch: Wan2.1-T2V-1.3B at 480p x 81 frames
_BATCH, _HEADS, _TOKENS, _PLAN_BLOCK = 1, 12, 32760, 128
_SKIP_TILE = (64, 64)


@dataclass(frozen=True)
class Case:
    kernel: str
    target: str
    dtype: str
    head_dim: int
    config: tuple  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    role: str = "pruned"  # "default": must be clean; "pruned": the pruner may select it; "full": grid only

    @property
    def label(self):
        bm, bn, w, s = self.config
        return f"{bm}x{bn} w{w} s{s}"

    @property
    def key(self):
        return f"{self.kernel}|{self.target}|{self.dtype}|d{self.head_dim}|{self.label}"


# --------------------------------------------------------------------------------------------------
# Which configs each target can run
# --------------------------------------------------------------------------------------------------

def skip_configs(target, head_dim, dtype):
    """The skip kernel's launch candidates on ``target``: the rule's default 64 x 64 tiles with each
    pipeline depth (3, 2) that fits the target's shared memory (``_skip_launch_config`` runs the
    first one the table records as clean)."""
    bm, bn = bst.skip_tile_sizes(_PLAN_BLOCK, _PLAN_BLOCK, _SKIP_TILE)
    warps, first = bst._skip_launch_config(bm, bn, head_dim, _TORCH_DTYPE[dtype].itemsize, None,
                                           smem=TARGETS[target].shared_limit)
    return [(bm, bn, warps, s) for s in (3, 2) if s <= first]


def skip_used(target, head_dim, dtype):
    """The skip config that runs on ``target`` (table-aware, as the launcher picks it)."""
    bm, bn = bst.skip_tile_sizes(_PLAN_BLOCK, _PLAN_BLOCK, _SKIP_TILE)
    warps, stages = bst._skip_launch_config(bm, bn, head_dim, _TORCH_DTYPE[dtype].itemsize, None,
                                            smem=TARGETS[target].shared_limit,
                                            capability=TARGETS[target].capability, dtype=dtype)
    return (bm, bn, warps, stages)


def varlen_configs(head_dim):
    """Every tile ``launch_config`` returns (it depends on the mean block sizes only)."""
    seen = []
    with _env("FASTDIT_TRITON_CONFIG", None):
        for mean_q in (128, 64):
            for mean_k in (128, 64, 16):
                cfg = bsv.launch_config(mean_q * 10, 10, mean_k * 10, 10, head_dim)
                if cfg not in seen:
                    seen.append(cfg)
    return seen


def cases(targets=tuple(TARGETS), kernels=tuple(KERNELS), head_dims=HEAD_DIMS, dtypes=DTYPES, configs="pruned"):
    """The compile cases: ``configs`` is ``default`` (the configs that must be clean), ``pruned``
    (those plus every config the pruner can select) or ``full`` (the whole autotune grid too)."""
    out = []
    for t in targets:
        target = TARGETS[t]
        for dtype in dtypes:
            elt = _TORCH_DTYPE[dtype].itemsize
            for d in head_dims:
                if "fixed" in kernels:
                    chosen = {}
                    # the default config is the first clean one of DEFAULT_PREFERENCE: all of them
                    # are compiled, so the choice can be made from the table
                    for cfg in tuning.DEFAULT_PREFERENCE:
                        chosen[cfg] = "default"
                    if configs != "default":
                        with _env("FASTDIT_TRITON_AUTOTUNE", "full" if configs == "full" else "1"):
                            kept = tuning.prune_for_target(tuning.AUTOTUNE_CONFIGS, _PLAN_BLOCK, _PLAN_BLOCK, d, elt,
                                                           target.shared_limit)
                        for c in kept:
                            chosen.setdefault(tuning.config_tuple(c), "pruned" if configs == "pruned" else "full")
                    out += [Case("fixed", t, dtype, d, cfg, role) for cfg, role in chosen.items()]
                if "skip" in kernels:
                    out += [Case("skip", t, dtype, d, cfg, "default") for cfg in skip_configs(t, d, dtype)]
                if "fixed_tma" in kernels and target.capability >= tma.MIN_CAPABILITY and tma.HAS_TENSOR_DESCRIPTORS:
                    # the TMA variant's candidates (Hopper on); the first clean one runs (tma_config)
                    out += [Case("fixed_tma", t, dtype, d, cfg, "default") for cfg in tuning.TMA_PREFERENCE]
                if "varlen" in kernels:  # all of launch_config's choices; one clean one must exist
                    out += [Case("varlen", t, dtype, d, cfg, "default") for cfg in varlen_configs(d)]
                for kernel in BWD_KERNELS:  # the backward's candidates (bwd_config takes the first clean one)
                    if kernel in kernels:
                        out += [Case(kernel, t, dtype, d, cfg, "default") for cfg in bwd.BWD_PREFERENCE[kernel]]
                for kernel in QUANT_KERNELS:
                    if kernel in kernels and dtype != "fp32" and (kernel != "quant_fp8" or target.capability >= 89):
                        out.append(Case(kernel, t, dtype, d, quant_config(kernel, d), "default"))
    return out


# --------------------------------------------------------------------------------------------------
# The launch's specialisation
# --------------------------------------------------------------------------------------------------

def _meta(*shape, dtype):
    return torch.empty(*shape, dtype=dtype, device="meta")


def launch(case):
    """``(fn, named arguments, compile options)`` of ``case``'s launch, built by the launchers' own
    argument builders on meta tensors (no memory, real strides)."""
    dt = _TORCH_DTYPE[case.dtype]
    bm, bn, warps, stages = case.config
    b, h, n, d = _BATCH, _HEADS, _TOKENS, case.head_dim
    q, k, v, out = (_meta(b, h, n, d, dtype=dt) for _ in range(4))
    lse = _meta(b, h, n, dtype=torch.float32)
    kv_valid = _meta(b, n, dtype=torch.bool)
    fn = KERNELS[case.kernel]
    if case.kernel in ("fixed", "skip", "fixed_tma"):
        m = -(-n // _PLAN_BLOCK)
        kv_indices = _meta(1, h, m, 64, dtype=torch.int32)
        kv_counts = _meta(1, h, m, dtype=torch.int32)
        skip = case.kernel == "skip"
        skipped = _meta(b, h, dtype=torch.int32) if skip else None
        args = bst.kernel_args(q, k, v, out, lse, skipped, kv_indices, kv_counts, kv_valid, _PLAN_BLOCK, _PLAN_BLOCK,
                               d ** -0.5, 1.0 if skip else None, False)
        named = dict(zip(fn.arg_names, args), BLOCK_M=bm, BLOCK_N=bn)
        named.update({name: rule(named) for name, rule in bst._HEURISTICS.items()})
        if case.kernel == "fixed_tma":
            named["WARP_SPEC"] = tma.warp_spec_for(TARGETS[case.target].capability)
    elif case.kernel in ("bwd_dq", "bwd_dkdv"):
        m = -(-n // _PLAN_BLOCK)
        plan_idx = _meta(1, h, m, 64 if case.kernel == "bwd_dq" else m, dtype=torch.int32)
        plan_cnt = _meta(1, h, m, dtype=torch.int32)
        grad = (out,) if case.kernel == "bwd_dq" else (out, out)
        args, flags = bwd.bwd_kernel_args(q, k, v, out, lse, lse, grad, plan_idx, plan_cnt, kv_valid, _PLAN_BLOCK,
                                          _PLAN_BLOCK, d ** -0.5)
        named = dict(zip(fn.arg_names, args), **flags, BLOCK_M=bm, BLOCK_N=bn)
    elif case.kernel in ("varlen_bwd_dq", "varlen_bwd_dkdv"):
        mq, mk = 100, 500
        q_off = _meta(1, h, mq + 1, dtype=torch.int32)
        k_off = _meta(1, h, mk + 1, dtype=torch.int32)
        dq = case.kernel == "varlen_bwd_dq"
        plan_idx = _meta(1, h, mq if dq else mk, 64 if dq else mq, dtype=torch.int32)
        plan_cnt = _meta(1, h, mq if dq else mk, dtype=torch.int32)
        n_slots = (mq if dq else mk) + -(-n // (bm if dq else bn))
        sched = _meta(1, h, n_slots, dtype=torch.int32)
        args, flags = bwd.varlen_bwd_kernel_args(q, k, v, out, lse, lse, (out,) if dq else (out, out), q_off, k_off,
                                                 plan_idx, plan_cnt, kv_valid, (sched, sched), d ** -0.5)
        named = dict(zip(fn.arg_names, args), **flags, BLOCK_M=bm, BLOCK_N=bn)
    elif case.kernel in QUANT_KERNELS:
        named, options = _quant_launch(case, q, k, v, out, lse, kv_valid, fn)
        return fn, named, options
    else:
        mq, mk = 100, 500  # svg2-like clusters
        q_off = _meta(1, h, mq + 1, dtype=torch.int32)
        k_off = _meta(1, h, mk + 1, dtype=torch.int32)
        kv_indices = _meta(1, h, mq, 64, dtype=torch.int32)
        kv_counts = _meta(1, h, mq, dtype=torch.int32)
        n_slots = mq + -(-n // bm)
        sched = _meta(1, h, n_slots, dtype=torch.int32)
        args, flags = bsv.varlen_kernel_args(q, k, v, out, lse, q_off, k_off, kv_indices, kv_counts, kv_valid,
                                             sched, sched, d ** -0.5, False)
        named = dict(zip(fn.arg_names, args), **flags, BLOCK_M=bm, BLOCK_N=bn)
    missing = [a for a in fn.arg_names if a not in named]
    if missing:
        raise RuntimeError(f"{case.kernel}: no value for kernel arguments {missing}")
    return fn, named, {"num_warps": warps, "num_stages": stages}


def _quant_launch(case, q, k, v, out, lse, kv_valid, fn):
    """Named arguments and options of a quantised kernel's launch (its launcher's argument builders)."""
    b, h, n, d = q.shape
    q8, k8 = (_meta(b, h, n, d, dtype=torch.int8) for _ in range(2))
    m = -(-n // _PLAN_BLOCK)
    scales = _meta(b, h, m, dtype=torch.float32)
    fp8 = case.kernel == "quant_fp8"
    v_used = _meta(b, h, n, d, dtype=torch.float8_e4m3fn) if fp8 else v
    v_scale = _meta(b, h, 1, d, dtype=torch.float32)
    if case.kernel == "quantize":  # K, smoothed, fixed-size blocks (the Q call adds the shift term)
        args, flags = qfx.quantize_kernel_args(k, _meta(b * h, d, dtype=torch.float32), k8, scales, scales,
                                               (scales, 0, 0, 0), _PLAN_BLOCK, m, 0.0, True, False, False)
    elif case.kernel == "quant_varlen":
        mq, mk = 100, 500  # svg2-like clusters
        q_off, k_off = _meta(1, h, mq + 1, dtype=torch.int32), _meta(1, h, mk + 1, dtype=torch.int32)
        sched = _meta(1, h, mq + -(-n // case.config[0]), dtype=torch.int32)
        args, flags = qvl.quant_varlen_kernel_args(
            q8, k8, v_used, _meta(b, h, mq, dtype=torch.float32), _meta(b, h, mk, dtype=torch.float32), v_scale, out,
            lse, q_off, k_off, _meta(1, h, mq, 64, dtype=torch.int32), _meta(1, h, mq, dtype=torch.int32), kv_valid,
            sched, sched, d ** -0.5, "int8", False)
    else:
        args, flags = qfx.quant_kernel_args(q8, k8, v_used, scales, scales, v_scale, out, lse,
                                            _meta(1, h, m, 64, dtype=torch.int32), _meta(1, h, m, dtype=torch.int32),
                                            kv_valid, _PLAN_BLOCK, _PLAN_BLOCK, d ** -0.5,
                                            "int8-fp8" if fp8 else "int8", False)
    options = {"num_warps": flags.pop("num_warps", case.config[2]), "num_stages": flags.pop("num_stages",
                                                                                          case.config[3])}
    return dict(zip(fn.arg_names, args), **flags), options


def _specialize(backend, value):
    """``(type, specialisation)`` of one runtime argument, by Triton's own rule when it has one."""
    try:
        from triton._C.libtriton import native_specialize_impl
    except ImportError:  # older Triton: the same rule, written out
        native_specialize_impl = None
    if native_specialize_impl is not None:
        return native_specialize_impl(type(backend), value, False, True, True)
    if isinstance(value, bool):
        return "i1", None
    if isinstance(value, int):
        if value == 1:
            return "constexpr", 1
        kind = "i32" if -2**31 <= value < 2**31 else "i64"
        return kind, "D" if value % 16 == 0 else ""
    if isinstance(value, float):
        return "fp32", None
    if isinstance(value, torch.Tensor):
        names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
                 torch.int64: "i64", torch.uint8: "u8", torch.bool: "i1", torch.int8: "i8",
                 torch.float8_e4m3fn: "fp8e4nv"}
        return "*" + names[value.dtype], "D"
    raise TypeError(f"cannot specialise {type(value).__name__}")


def specialise(fn, named, target):
    """``ASTSource`` inputs ``(signature, constexprs, attrs)`` of a launch of ``fn`` with ``named``."""
    from triton.compiler.compiler import make_backend
    backend = make_backend(target)
    import inspect
    signature, constexprs, attrs = {}, {}, {}
    # constexpr parameters by annotation (works for JITFunction and, in tests, the interpreter's)
    params = inspect.signature(fn.fn).parameters
    for i, name in enumerate(fn.arg_names):
        value = named[name]
        if "constexpr" in str(params[name].annotation):
            signature[name] = "constexpr"
            constexprs[(i,)] = value
            continue
        kind, spec = _specialize(backend, value)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = spec
        elif isinstance(spec, str) and spec:
            try:
                attrs[(i,)] = backend.parse_attr(spec)
            except AttributeError:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


# --------------------------------------------------------------------------------------------------
# Compiling one case
# --------------------------------------------------------------------------------------------------

def dependencies(kernel):
    """The jitted functions ``kernel`` is made of: its own and every jitted function it calls,
    directly or not (found by name in the source, among the defining module's globals)."""
    seen, order, todo = set(), [], [KERNELS[kernel]]
    while todo:
        fn = todo.pop()
        if fn.__name__ in seen:
            continue
        seen.add(fn.__name__)
        order.append(fn)
        src = _source(fn)
        for name, value in fn.fn.__globals__.items():
            if hasattr(value, "fn") and hasattr(value, "arg_names") and re.search(rf"\b{re.escape(name)}\b", src):
                todo.append(value)
    return sorted(order, key=lambda f: f.__name__)


def _source(fn):
    """The source of a jitted function from its ``def`` on (as ``JITFunction.src``; the same under
    the interpreter, so the hash does not depend on ``TRITON_INTERPRET``)."""
    import inspect
    import textwrap
    src = textwrap.dedent(inspect.getsource(fn.fn))
    return src[re.search(r"^def\s+\w+\s*\(", src, re.MULTILINE).start():]


def source_hash(kernel):
    """sha256 (16 hex digits) of the source of ``dependencies(kernel)`` (and, for the fixed-size
    kernel, of the heuristics that set its flags): a change to any of them makes the kernel's
    table entries stale. Docstring / line moves elsewhere in the file do not."""
    digest = hashlib.sha256()
    for fn in dependencies(kernel):
        digest.update(fn.__name__.encode() + b"\0" + _source(fn).encode() + b"\0")
    if kernel in ("fixed", "skip", "fixed_tma"):  # the heuristics decide constexpr flags
        import inspect
        for rule in bst._HEURISTICS.values():
            digest.update(inspect.getsource(rule).encode())
    return digest.hexdigest()[:16]


_PTXAS_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def _target_error(capability):
    """None when the installed Triton compiles for ``capability``, else the reason (one line)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    try:
        triton.compile(ASTSource(_probe_kernel, {"X": "*fp32"}, {}), target=GPUTarget("cuda", capability, 32),
                       options={"num_warps": 1})
        return None
    except Exception as error:  # noqa: BLE001 - reported as the skip reason
        lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
        fatal = [ln for ln in lines if "fatal" in ln.lower() or "error" in ln.lower()]
        return f"{type(error).__name__}: {(fatal or lines or [''])[0][:200]}"


@triton.jit
def _probe_kernel(X):
    tl.store(X + tl.arange(0, 32), tl.zeros([32], dtype=tl.float32))


def compile_case(case):
    """Compile ``case`` (a fresh compile: Triton's cache is bypassed so that ``ptxas`` runs) and
    return its table entry."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = TARGETS[case.target]
    gpu = GPUTarget("cuda", target.capability, 32)
    entry = dict(asdict(case), key=case.key, capability=target.capability, triton=triton.__version__,
                 source_hash=source_hash(case.kernel), shared_limit=target.shared_limit,
                 registers=None, spill_stores=None, spill_loads=None, stack=None, shared=None,
                 clean=False, error=None, compile_s=None, sass=None)
    entry["config"] = list(case.config)
    start = time.perf_counter()
    log = io.StringIO()
    try:
        fn, named, options = launch(case)
        signature, constexprs, attrs = specialise(fn, named, gpu)
        knobs = triton.knobs
        with _knob(knobs.nvidia, "dump_ptxas_log", True), _knob(knobs.compilation, "always_compile", True), \
                contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=gpu, options=options)
        entry["shared"] = int(kernel.metadata.shared)
        # instruction census of the machine code (the wheel's cuobjdump; None without one)
        entry["sass"] = sass_census.census(kernel.asm["cubin"])
        text = log.getvalue()
        for field, pattern in _PTXAS_RE.items():
            found = pattern.findall(text)
            entry[field] = int(found[-1]) if found else None
        if entry["registers"] is None:
            entry["error"] = "no ptxas -v report in Triton's log"
    except Exception as error:  # noqa: BLE001 - the check reports it with the case
        lines = [ln for ln in str(error).splitlines() if ln.strip()]
        entry["error"] = f"{type(error).__name__}: {' / '.join(lines[:3])[:400]}"
    entry["compile_s"] = round(time.perf_counter() - start, 2)
    entry["clean"] = (entry["error"] is None and entry["spill_stores"] == 0 and entry["spill_loads"] == 0
                      and entry["shared"] <= target.shared_limit)
    return entry


@contextlib.contextmanager
def _knob(group, name, value):
    old = getattr(group, name)
    setattr(group, name, value)
    try:
        yield
    finally:
        setattr(group, name, old)


def _worker_init(cache_dir):
    os.environ["TRITON_CACHE_DIR"] = cache_dir  # keep the user's Triton cache out of it
    with contextlib.suppress(Exception):
        triton.knobs.cache.dir = cache_dir


def compile_cases(todo, jobs=1, progress=None):
    """Compile ``todo`` with ``jobs`` processes; entries in ``todo``'s order."""
    if not todo:
        return []
    with tempfile.TemporaryDirectory(prefix="fastdit-offline-") as cache_dir:
        if jobs <= 1:
            _worker_init(cache_dir)
            results = []
            for case in todo:
                results.append(compile_case(case))
                if progress:
                    progress(results[-1])
            return results
        import multiprocessing
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init, initargs=(cache_dir,)) as pool:
            results = []
            for entry in pool.map(compile_case, todo):
                results.append(entry)
                if progress:
                    progress(entry)
            return results
