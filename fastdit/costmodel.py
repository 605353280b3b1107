"""A cost model of GPU time: one attention call and one transformer forward, dense vs a method.

Written before any GPU ran fastdit, from datasheets and papers; the H200's entry is since calibrated
on the first GPU run (2026-12-04, below). ``scripts/gpu_check.sh`` prints it beside each measurement,
and ``python -m fastdit.eval.predict`` prints it for Wan2.1 480p and HunyuanVideo 720p.

Attention call (batch ``B``, heads ``H``, ``N`` queries, ``Nk`` keys, head dim ``D``, element size
``e`` bytes):

* dense (PyTorch SDPA, FlashAttention-2 class): ``F = 4 B H N Nk D`` FLOPs (Q K^T and P V);
  time ``max(F / (peak * sdpa_eff), bytes / (bw * mem_eff)) + launch``, bytes = Q, K, V read and
  O written once (``4 B H N D e``, the fewest a fused kernel moves);
* a block plan (``BlockPlan``: what the methods actually build, padding included): the kernel
  computes whole tiles, so each computed (query block, key block) pair costs
  ``ceil(block_m / BLOCK_M) BLOCK_M * ceil(block_n / BLOCK_N) BLOCK_N`` score entries, with the
  tile ``(BLOCK_M, BLOCK_N)`` the kernel uses without autotuning on that GPU
  (``triton_tuning.default_config``: the offline table's clean default); ``F = 4 D`` times the
  sum of that over every (batch, head, query block) and listed key block; time
  ``F / (peak * kernel_eff)`` (memory as above over the kernel's padded length), plus what runs
  outside the kernel: the token permutation of a plan with ``perm`` (gather Q, K, V, scatter O:
  ``8 B H L D e`` bytes, ``L`` the padded kernel length), and for dynamic plans the selection
  (reading Q and K once to pool them, ``2 B H N D e`` bytes, and scoring the pooled blocks,
  ``2 B H Mq Mk D`` FLOPs plus ``16 B H Mq Mk`` bytes of softmax / sort traffic); each outside
  step at ``bw * mem_eff``, plus ``launch_us`` per kernel launch (3 for a static plan with a
  permutation, 12 for a dynamic one: an estimate of the pooling / scoring / top-k ops).

Transformer forward (``model_forward``): the linear layers' FLOPs from the published configs
(``ModelShape``; ``fastdit.eval.predict`` fills it from ``fastdit.eval.bench.transformer_models``)
at ``peak * gemm_eff``, elementwise work (norms,
modulation, RoPE, activations, residuals) as ``ELEMENTWISE_PASSES`` reads + writes of the
``tokens x dim`` activations per block at ``bw * mem_eff``, cross-attention (Wan) dense, and the
self / joint attention of every block from the call model above. The attention share of a step
is what falls out of that; a method changes only the self / joint attention calls.

GPU numbers (``GPUS``; dense bf16 / fp16 tensor throughput with fp32 accumulation, no sparsity;
HBM bandwidth):

* A100 SXM4 80 GB: 312 TFLOP/s, 2039 GB/s (NVIDIA A100 datasheet, 2021);
* H100 SXM5 80 GB: 989 TFLOP/s, 3350 GB/s (NVIDIA H100 datasheet, 2023);
* H200 SXM 141 GB: 989 TFLOP/s, 4800 GB/s (NVIDIA H200 datasheet, 2024); measured on one of this
  workplace's H200s: 788 TFLOP/s (8192^3 bf16 matmul), 4.3 TB/s (device copy);
* RTX 4090: 165 TFLOP/s (fp16/bf16 tensor with fp32 accumulate; 330 with fp16 accumulate),
  1008 GB/s (NVIDIA Ada Lovelace architecture whitepaper, appendix table).

Efficiencies (fractions of peak; *assumptions* the first GPU run checks):

* ``sdpa_eff`` (dense SDPA, FlashAttention-2): A100 0.65 (FlashAttention-2 paper, Dao 2023: the
  forward reaches 50-73% of A100 peak, ~70% at D = 128 and long sequences); the H100 and H200:
  measured, below (the FlashAttention-3 paper, Shah et al. 2024, gives FlashAttention-2's forward
  ~350-370 TFLOP/s at D = 128 on H100, 35-38%, the 0.37 assumed before the run; PyTorch's default
  backend on Hopper is cuDNN's, faster); RTX 4090 0.60 (no published
  figure found; Ampere-like kernels at Ampere-like efficiency);
* ``kernel_eff`` (fastdit's Triton kernel, an FA2-style forward without TMA or warp
  specialisation, walking a block list): 0.85 of ``sdpa_eff`` (index loads, masks, a
  non-contiguous K/V walk);
* ``gemm_eff`` (the model's linear layers): 0.75 (A100), 0.70 (RTX 4090); Hopper: measured, below;
* ``mem_eff`` 0.80 of the HBM bandwidth for memory-bound steps; ``launch_us`` 5 us a launch.
* float32 calls (``elt`` 4) run at the GPU's plain float32 rate (``fp32_tflops``: A100 19.5, H100 /
  H200 67, RTX 4090 82.6 TFLOP/s, the same datasheets) with the same efficiencies: the engine's
  float32 dots are IEEE float32, not tf32.

**H200, measured** (one H200, torch 2.11, Triton 3.6, 2026-12-04; ``docs/gpu_runs/2026-12-04-h200``,
BENCHMARKS.md "GPU"): achieved over the datasheet's 989 TFLOP/s. The **H100** takes the same values
(the same GH100 die, clocks and tensor rates; only its HBM is slower, 3.35 against 4.8 TB/s, which the
model prices separately): carried over, not measured on an H100.

* ``sdpa_eff`` 0.60: PyTorch's default SDPA ran at cuDNN's speed (Wan 480p 10.59-11.70 ms, HunyuanVideo
  115200 tokens 266-268 ms: 0.58-0.63); FlashAttention-2 forced ran at 0.36, the 0.37 assumed before.
  ``masked_sdpa_eff`` 0.42: the same call with a key mask (HunyuanVideo's text padding; 395 ms
  against 273 ms unmasked).
* ``kernel_eff`` 0.40: fastdit's kernel on plans without key validity (engine cases at densities
  1-0.1: 0.32-0.44, median 0.40; radial on Wan 0.41). ``masked_kernel_eff`` 0.30: plans with a
  key-validity vector (``plan.kv_valid`` or a call's key mask: sta's padded tiles, text masks), the
  median of six readings 0.24-0.38: the kernel alone, sta on Wan 0.24, sta on HunyuanVideo with text
  0.26, radial on HunyuanVideo with text 0.33; inside eager forwards (less their other work) sta on
  Wan 0.28, sta and radial on HunyuanVideo 0.33 and 0.38. Why the vector costs this much is not
  established (a guess: its per-tile load is not pipelined; the next GPU check times it alone).
* ``gemm_eff`` 0.285: everything but the self / joint attention calls of an eager forward, priced as
  the linear FLOPs at this rate plus the modelled elementwise passes: fitted to Wan 1.3B (0.29) and
  HunyuanVideo 13B (0.28) eager dense forwards less their attention calls timed alone. It folds in
  the eager elementwise work the 24 passes miss; a ``torch.compile``d Wan forward fits 0.45.

What the model leaves out: L2 reuse beyond the minimal traffic, tails of the grid (waves: a call of
fewer programs than the GPU has multiprocessors runs slower than priced; the H200's float32 engine
cases at 8192 tokens and two heads ran 1.8-3.9x the prediction), ``torch.compile``'s gains (a
compiled Wan forward ran at 0.69-0.82 of the eager-fitted prediction), the
autotuner's choice (it may beat the default tile), clocks under power limits, and CPU overheads
(the Python of the patched call; ``torch.compile`` removes part of it). It covers the GPUs above:
``gpu_for(device)`` maps a CUDA device to one by name, else by compute capability (8.0 -> A100,
8.6 / 8.9 -> RTX 4090, 9.0 -> H100); a CPU device or another GPU gives None (no prediction).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

ELEMENTWISE_PASSES = 24  # reads + writes of tokens x dim activations per transformer block
LAUNCH_US = 5.0
MEM_EFF = 0.80
KERNEL_OVER_SDPA = 0.85


@dataclass(frozen=True)
class GPU:
    """Published peak numbers and assumed efficiencies of one GPU (see the module docstring)."""

    name: str
    capability: int
    peak_tflops: float  # dense bf16 / fp16 tensor, fp32 accumulate
    bandwidth_gbs: float  # HBM
    sdpa_eff: float
    gemm_eff: float
    memory_gb: float
    source: str
    #: fastdit's kernel efficiency measured on this GPU (``with_measured_efficiency``); None: assumed
    measured_kernel_eff: float | None = None
    fp32_tflops: float = 0.0  # plain float32 (no tensor cores); 0: not known, float32 at peak_tflops
    #: measured efficiencies with a key mask (dense SDPA) / a key-validity vector (the kernel); None: unmasked's
    masked_sdpa_eff: float | None = None
    masked_kernel_eff: float | None = None

    @property
    def kernel_eff(self):
        if self.measured_kernel_eff is not None:
            return self.measured_kernel_eff
        return self.sdpa_eff * KERNEL_OVER_SDPA

    def attention_eff(self, kernel, masked=False):
        """Efficiency of dense SDPA (``kernel`` False) or fastdit's kernel, with a key mask / key-validity
        vector when ``masked`` (the measured masked value where there is one)."""
        if kernel:
            return self.masked_kernel_eff if masked and self.masked_kernel_eff is not None else self.kernel_eff
        return self.masked_sdpa_eff if masked and self.masked_sdpa_eff is not None else self.sdpa_eff

    def tflops(self, elt=2):
        """The peak that prices a call with ``elt``-byte elements: plain float32 for 4 bytes where known."""
        return self.fp32_tflops if elt == 4 and self.fp32_tflops else self.peak_tflops


def with_measured_efficiency(gpu, efficiency, variant=None):
    """``gpu`` with the efficiencies measured on it: ``efficiency`` is ``scripts/bench_tma.py``'s
    ``"efficiency"`` (``{"sdpa_eff": x, "kernel_eff <variant>": y, ...}``: medians of achieved over
    peak throughput), a JSON file holding it (the script's ``--json`` output), or a dict. ``sdpa_eff``
    replaces the dense baseline's; ``kernel_eff`` is the named ``variant``'s (``"tma"``,
    ``"cp_async autotuned"``, ...) or, when None, the best variant measured (the one the table picks
    runs there). Missing or null entries keep the assumed values. The GPU's ``source`` says so."""
    import json
    from pathlib import Path

    if not isinstance(efficiency, dict):
        data = json.loads(Path(efficiency).read_text())
        efficiency = data.get("efficiency", data)
    sdpa = efficiency.get("sdpa_eff")
    kernels = {key[len("kernel_eff "):]: value for key, value in efficiency.items()
               if key.startswith("kernel_eff ") and isinstance(value, (int, float)) and value > 0}
    if variant is not None and variant not in kernels:
        raise ValueError(f"no measured kernel efficiency for variant {variant!r}; measured: {sorted(kernels)}")
    kernel = kernels[variant] if variant is not None else (max(kernels.values()) if kernels else None)
    for name, value in (("sdpa_eff", sdpa), ("kernel_eff", kernel)):
        if value is not None and not (isinstance(value, (int, float)) and 0 < value <= 1):
            raise ValueError(f"measured {name} must be in (0, 1], got {value!r}")
    return replace(gpu, sdpa_eff=sdpa if sdpa is not None else gpu.sdpa_eff, measured_kernel_eff=kernel,
                   source=f"{gpu.source}; efficiencies measured (sdpa {sdpa}, kernel {kernel})")


_H200 = GPU("H200", 90, 989.0, 4800.0, 0.60, 0.285, 141,
            "NVIDIA H200 datasheet (SXM); efficiencies measured on one H200, 2026-12-04 (torch 2.11, Triton 3.6)",
            measured_kernel_eff=0.40, fp32_tflops=67.0, masked_sdpa_eff=0.42, masked_kernel_eff=0.30)

GPUS = {
    "A100": GPU("A100", 80, 312.0, 2039.0, 0.65, 0.75, 80, "NVIDIA A100 datasheet (SXM4 80GB)", fp32_tflops=19.5),
    # the same die as the H200: its measured efficiencies carried over; only the memory differs
    "H100": replace(_H200, name="H100", bandwidth_gbs=3350.0, memory_gb=80,
                    source="NVIDIA H100 datasheet (SXM5); efficiencies carried over from the H200 measured "
                           "2026-12-04 (same die)"),
    "H200": _H200,
    "RTX 4090": GPU("RTX 4090", 89, 165.2, 1008.0, 0.60, 0.70, 24, "NVIDIA Ada Lovelace whitepaper",
                    fp32_tflops=82.6),
}
_BY_CAPABILITY = {80: "A100", 86: "RTX 4090", 89: "RTX 4090", 90: "H100"}


def gpu_for(device=None):
    """The ``GPU`` that models ``device`` (a torch device, index or None for the current CUDA
    device): by name (A100, H100, H200, 4090), else by compute capability; None for a CPU device
    or a GPU the model does not cover."""
    import torch

    if device is not None and not isinstance(device, int):
        device = torch.device(device)
        if device.type != "cuda":
            return None
        device = device.index
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device).upper()
    for key in ("H200", "H100", "A100"):
        if key in name:
            return GPUS[key]
    if "4090" in name:
        return GPUS["RTX 4090"]
    major, minor = torch.cuda.get_device_capability(device)
    key = _BY_CAPABILITY.get(10 * major + minor)
    return GPUS[key] if key else None


@dataclass
class CallPrediction:
    """Predicted time of one attention call (milliseconds) and what it is made of."""

    label: str
    flops: float  # of the attention kernel, padding and tile rounding included
    kernel_ms: float
    outside_ms: float  # permutation, selection, launches
    density: float  # computed score entries / dense's, tile rounding included

    @property
    def total_ms(self):
        return self.kernel_ms + self.outside_ms


def _seconds_ms(flops, tflops, eff, nbytes, gbs):
    return 1e3 * max(flops / (tflops * 1e12 * eff), nbytes / (gbs * 1e9 * MEM_EFF))


def dense_call(gpu, batch, heads, n_q, n_k, head_dim, elt=2, key_mask=False):
    """Dense SDPA (PyTorch's default backend) for one call; ``key_mask``: the call passes a key mask."""
    flops = 4.0 * batch * heads * n_q * n_k * head_dim
    nbytes = (2 * n_q + 2 * n_k) * batch * heads * head_dim * elt
    eff = gpu.attention_eff(kernel=False, masked=key_mask)
    ms = _seconds_ms(flops, gpu.tflops(elt), eff, nbytes, gpu.bandwidth_gbs) + 1e-3 * LAUNCH_US
    return CallPrediction("dense", flops, ms, 0.0, 1.0)


def guard_share(gpu, seq, head_dim, rows, batch=1, heads=1, elt=2):
    """The quality guard's check (``fastdit/methods/guard.py``) over dense attention's time for one
    call of ``seq`` tokens: ``rows`` sampled rows per head (``guard.row_count``)
    attend every key through the engine (tensor cores, ``kernel_eff``), plus one read of q, k, v
    for the finiteness test and the rows' copy; re-runs of failed heads are not included (they
    are what the guard buys). Returns ``(share, check_ms, dense_ms)``."""
    n = rows
    flops = 4.0 * batch * heads * n * seq * head_dim
    nbytes = (2 * n + 2 * seq) * batch * heads * head_dim * elt + 3 * batch * heads * seq * head_dim * elt
    check = _seconds_ms(flops, gpu.tflops(elt), gpu.kernel_eff, 0.0, gpu.bandwidth_gbs)
    check += _seconds_ms(0.0, gpu.tflops(elt), gpu.kernel_eff, nbytes, gpu.bandwidth_gbs) + 3e-3 * LAUNCH_US
    dense = dense_call(gpu, batch, heads, seq, seq, head_dim, elt).total_ms
    return check / dense, check, dense


def kernel_tile(gpu, head_dim, dtype="bf16"):
    """``(BLOCK_M, BLOCK_N)`` the kernel runs without autotuning on ``gpu`` (offline table;
    128 x 64 where Triton is not installed)."""
    try:
        from fastdit.kernels.triton_tuning import next_pow2, default_config
    except ImportError:
        return 128, 64
    bm, bn, _, _ = default_config(gpu.capability, max(16, next_pow2(head_dim)), dtype)
    return bm, bn


def plan_pairs(plan, batch, heads, tile):
    """Score entries the kernel computes for ``plan`` over ``batch`` x ``heads``: every listed
    (query block, key block) pair costs its blocks rounded up to whole kernel tiles."""
    bm, bn = tile
    rows = -(-plan.block_m // bm) * bm
    cols = -(-plan.block_n // bn) * bn
    counts = plan.kv_counts
    listed = float(counts.double().sum()) * (batch / counts.shape[0]) * (heads / counts.shape[1])
    return listed * rows * cols


def _has_key_validity(plan):
    """Whether the kernel runs ``plan`` with a key-validity vector (its padding): the masked efficiency."""
    return getattr(plan, "kv_valid", None) is not None


def plan_call(gpu, plan, batch, heads, head_dim, elt=2, dtype="bf16", label=None, key_mask=False):
    """One attention call on ``plan`` (a ``BlockPlan`` as the method built it); the kernel runs its
    key-validity path when the plan has ``kv_valid`` (padding) or the call a ``key_mask``."""
    tile = kernel_tile(gpu, head_dim, dtype)
    pairs = plan_pairs(plan, batch, heads, tile)
    flops = 4.0 * head_dim * pairs
    length = plan.kernel_len
    nbytes = 4 * batch * heads * length * head_dim * elt
    eff = gpu.attention_eff(kernel=True, masked=key_mask or _has_key_validity(plan))
    kernel_ms = _seconds_ms(flops, gpu.tflops(elt), eff, nbytes, gpu.bandwidth_gbs) + 1e-3 * LAUNCH_US
    outside_bytes, outside_flops, launches = 0.0, 0.0, 0
    if plan.perm is not None:
        outside_bytes += 8.0 * batch * heads * length * head_dim * elt
        launches += 2
    if plan.dynamic:
        mq, mk = plan.kv_counts.shape[-1], plan.num_kv_blocks
        outside_bytes += 2.0 * batch * heads * plan.seq_len * head_dim * elt + 16.0 * batch * heads * mq * mk
        outside_flops += 2.0 * batch * heads * mq * mk * head_dim
        launches += 12
    outside_ms = 0.0
    if outside_bytes or outside_flops:
        outside_ms = _seconds_ms(outside_flops, gpu.peak_tflops, gpu.gemm_eff, outside_bytes, gpu.bandwidth_gbs)
    outside_ms += 1e-3 * LAUNCH_US * launches
    density = pairs / (batch * heads * float(plan.seq_len) ** 2)
    return CallPrediction(label or plan.name, flops, kernel_ms, outside_ms, density)


def density_call(gpu, density, batch, heads, n, head_dim, elt=2, dynamic=True, block=128, label="", dtype="bf16",
                 key_mask=False):
    """One call of a plan known only by its block density (dynamic methods in ``predict``):
    ``density`` of ``block`` x ``block`` pairs of an ``n``-token call, no padding."""
    from types import SimpleNamespace

    import torch

    blocks = -(-n // block)
    listed = max(1, round(density * blocks))
    plan = SimpleNamespace(block_m=block, block_n=block, kv_counts=torch.full((1, 1, blocks), float(listed)),
                           kernel_len=blocks * block, seq_len=n, perm=None, dynamic=dynamic, num_kv_blocks=blocks,
                           name=label)
    return plan_call(gpu, plan, batch, heads, head_dim, elt, dtype, label, key_mask=key_mask)


# --------------------------------------------------------------------------------------------------
# Transformer forward
# --------------------------------------------------------------------------------------------------

@dataclass
class ForwardPrediction:
    label: str
    other_ms: float  # everything but the self / joint attention calls
    attention_ms: float  # all self / joint attention calls of one forward

    @property
    def total_ms(self):
        return self.other_ms + self.attention_ms

    @property
    def attention_share(self):
        return self.attention_ms / self.total_ms


@dataclass(frozen=True)
class ModelShape:
    """What the forward model needs of a transformer: attention layers, heads, tokens."""

    name: str
    family: str  # fastdit family (method defaults)
    grid: tuple  # video tokens (T, H, W)
    text_len: int  # text tokens in the joint sequence (0: text enters by cross-attention)
    text_position: str
    heads: int
    head_dim: int
    layers: int  # self / joint attention calls a forward
    linear_flops: float  # one forward's linear layers
    cross_flops: float  # one forward's cross-attention (dense)
    elementwise_bytes: float
    key_mask: bool = False  # the self / joint attention calls pass a key mask (padded joint text)

    @property
    def tokens(self):
        return math.prod(self.grid) + self.text_len


def model_forward(gpu, shape, attention_call_ms, label=""):
    """One forward: the non-attention work of ``shape`` plus ``layers`` calls of
    ``attention_call_ms`` (the predicted time of one self / joint attention call)."""
    other = _seconds_ms(shape.linear_flops, gpu.peak_tflops, gpu.gemm_eff, 0.0, gpu.bandwidth_gbs)
    other += _seconds_ms(shape.cross_flops, gpu.peak_tflops, gpu.sdpa_eff, 0.0, gpu.bandwidth_gbs)
    other += 1e3 * shape.elementwise_bytes / (gpu.bandwidth_gbs * 1e9 * MEM_EFF)
    return ForwardPrediction(label, other, shape.layers * attention_call_ms)


def speedup(dense, other):
    """``dense / other`` of two predictions (anything with ``total_ms``)."""
    return dense.total_ms / other.total_ms


# --------------------------------------------------------------------------------------------------
# "Is sparse worth it at this size?" (fastdit.patch's one-time warning)
# --------------------------------------------------------------------------------------------------

MIN_GAIN = 0.05


def call_gain(q, k, info, gpu=None):
    """``(gpu, dense CallPrediction, method CallPrediction)`` of one intercepted call, or None when
    the model has nothing to say: no covered GPU (a CPU device, or a GPU not in ``GPUS``), or the
    method reported neither a plan nor its performed work (``info`` is the call's ``ctx.info``).
    A dense step or a dense layer (``info["dense"]``) is not a sparse call: None."""
    import torch

    gpu = gpu or gpu_for(q.device)
    if gpu is None or info.get("dense"):
        return None
    batch, heads, n_q, head_dim = q.shape
    n_k = k.shape[2]
    elt = q.element_size()
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(q.dtype, "bf16")
    dense = dense_call(gpu, batch, heads, n_q, n_k, head_dim, elt)
    plan = info.get("plan")
    if plan is not None and hasattr(plan, "kv_counts"):
        call = plan_call(gpu, plan, batch, heads, head_dim, elt, dtype)
    elif "performed" in info and info.get("total"):
        density = float(info["performed"]) / float(info["total"])
        call = CallPrediction("method", density * dense.flops, density * dense.kernel_ms, 0.0, density)
    else:
        return None
    return gpu, dense, call


def worth_warning(method, q, k, info, threshold=MIN_GAIN):
    """The warning text when the predicted gain of ``method`` on this call (dense time over the
    method's, minus 1) is below ``threshold``; None otherwise or when there is no prediction (no
    covered GPU: a CPU device gets no warning). ``fastdit.patch`` asks once, on the first sparse
    call of a patch; a prediction that fails says nothing rather than break the call."""
    try:
        got = call_gain(q, k, info)
    except Exception:  # noqa: BLE001 - a prediction must never break an attention call
        return None
    if got is None:
        return None
    gpu, dense, call = got
    gain = dense.total_ms / call.total_ms - 1.0
    if gain >= threshold:
        return None
    batch, heads, n_q, head_dim = q.shape
    return (f"method {method!r} is predicted to gain {gain:+.0%} over dense attention on this call "
            f"(batch {batch}, {heads} heads, {n_q} tokens, head dim {head_dim}) on {gpu.name}: "
            f"{call.total_ms:.3f} ms (kernel {call.kernel_ms:.3f} + outside {call.outside_ms:.3f}, computed "
            f"fraction {call.density:.2f} with padding and tile rounding) vs dense {dense.total_ms:.3f} ms "
            f"(fastdit.costmodel; below {threshold:.0%}: sparse attention may not pay off at this size)")


# --------------------------------------------------------------------------------------------------
# Per head (method="auto": the cheapest method per head within an error budget)
# --------------------------------------------------------------------------------------------------

DEFAULT_GPU = "H100"


def gpu_named(name):
    """The ``GPU`` of ``GPUS`` called ``name`` (case and spaces ignored: ``h100``, ``rtx4090``,
    ``4090``); ValueError naming the known GPUs otherwise (no silent default)."""
    if isinstance(name, GPU):
        return name
    key = str(name).upper().replace(" ", "").replace("RTX", "")
    for known, gpu in GPUS.items():
        if known.upper().replace(" ", "").replace("RTX", "") == key:
            return gpu
    raise ValueError(f"unknown gpu {name!r} for the cost model; known: {sorted(GPUS)} (fastdit/costmodel.py)")


def token_outside_ms(gpu, method, options, batch, n, head_dim, elt=2):
    """Per head, what a token method does besides attention (milliseconds): the method's own
    ``outside_work(options, batch, n, head_dim, elt)`` (``(flops, bytes)``: ToMe's matching and
    merge / unmerge, ToDo's pooling; see ``fastdit.methods``) at ``gemm_eff``. ``method`` is the
    method class or instance (this layer knows no method names); 0 for None."""
    work = getattr(method, "outside_work", None)
    if work is None:
        if isinstance(method, str):
            raise TypeError(f"token_outside_ms takes the method class (fastdit.methods.get_method({method!r})), "
                            "not its name")
        return 0.0
    flops, nbytes = work(options or {}, batch, n, head_dim, elt)
    if not flops and not nbytes:
        return 0.0
    return _seconds_ms(flops, gpu.peak_tflops, gpu.gemm_eff, nbytes, gpu.bandwidth_gbs)


def head_times(gpu, info, batch, heads, n_q, n_k, head_dim, elt=2, dtype="bf16", method=None, options=None):
    """Predicted milliseconds per head of one call of a method (a list of ``heads`` floats), from
    the call's ``info`` (``fastdit.attention(..., return_info=True)``).

    Per head ``h``, the kernel time of its own work and an equal share of what the call does
    outside the kernel: a block plan's computed pairs of head ``h`` rounded to whole kernel tiles
    (``plan_pairs`` on that head) at ``kernel_eff``, memory ``4 B L D e`` of its padded length at
    ``mem_eff`` (the larger of the two), plus ``outside_ms / heads`` of ``plan_call`` (permutation,
    dynamic selection, launches); a token method (``performed / total``) at its per-head density
    of the dense head time plus ``token_outside_ms`` of ``method`` (a method class: its matching or pooling, given
    its ``options``); a dense call (or a method that reported nothing) the dense head time
    ``dense_call(gpu, B, H, N, Nk, D) / H``. Launches are shared by the call's heads (``launch_us /
    H`` each; a token method's two extra launches, its reduction and its attention, likewise). A
    head's time is what it adds to a call of ``H`` heads, so methods compare per head on equal
    terms; ``auto``'s grouping pays one launch per group besides, which this leaves out."""
    dense_head = dense_call(gpu, batch, heads, n_q, n_k, head_dim, elt).total_ms / heads  # one launch, shared
    plan = info.get("plan")
    if info.get("dense") or (plan is None and "head_density" not in info):
        return [dense_head] * heads
    if plan is None or not hasattr(plan, "kv_counts"):  # a token method: its per-head density, and its own work
        extra = token_outside_ms(gpu, method, options, batch, n_q, head_dim, elt) + 1e-3 * LAUNCH_US * 2 / heads
        return [float(d) * dense_head + extra for d in info["head_density"]]
    tile = kernel_tile(gpu, head_dim, dtype)
    bm, bn = tile
    rows = -(-plan.block_m // bm) * bm
    cols = -(-plan.block_n // bn) * bn
    counts = plan.kv_counts.double().sum(-1)  # (1|B, 1|H)
    per_head = counts.expand(batch, heads).sum(0) * rows * cols  # computed score entries, tile-rounded
    nbytes = 4.0 * batch * plan.kernel_len * head_dim * elt
    outside = plan_call(gpu, plan, batch, heads, head_dim, elt, dtype).outside_ms / heads
    launch = 1e-3 * LAUNCH_US / heads  # the kernel's launch, shared by the call's heads
    eff = gpu.attention_eff(kernel=True, masked=_has_key_validity(plan))
    return [_seconds_ms(4.0 * head_dim * float(p), gpu.tflops(elt), eff, nbytes, gpu.bandwidth_gbs)
            + outside + launch for p in per_head]
