"""Two-process context-parallel runs on the CPU (gloo) for tests/parallel/test_context_parallel.py.

Diffusers 0.42 asks for an accelerator count before it builds its device mesh; on a CPU machine
the workers report one (``torch.accelerator.device_count``), which is all gloo needs.
"""
import os
import socket

import torch
import torch.distributed as dist

HEADS = 4


def build(family, seed=0):
    """Tiny Wan (video only), Flux (text prefix) and Qwen-Image (text prefix with padded text: a key
    mask) with 4 heads, so Ulysses degree 2 gives 2 each."""
    torch.manual_seed(seed)
    if family.startswith("wan"):
        from diffusers import WanTransformer3DModel
        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=8,
                                     in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64,
                                     num_layers=2, rope_max_seq_len=64).eval()
    if family == "qwen":
        from diffusers import QwenImageTransformer2DModel
        model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                            attention_head_dim=16, num_attention_heads=HEADS, joint_attention_dim=32,
                                            axes_dims_rope=(4, 6, 6)).eval()
    else:
        from diffusers import FluxTransformer2DModel
        model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                       attention_head_dim=16, num_attention_heads=HEADS, joint_attention_dim=32,
                                       pooled_projection_dim=16, axes_dims_rope=(4, 6, 6)).eval()
    with torch.no_grad():  # zero-initialised gates would hide attention from the output
        for param in model.parameters():
            if param.numel() and not bool(param.any()):
                param.normal_(0.0, 0.05)
    return model


def inputs(family, text=6):
    """The tiny model's inputs; ``text``: text tokens (Flux, Qwen-Image; Qwen's second half is padding)."""
    g = torch.Generator().manual_seed(1)
    if family.startswith("wan"):  # latent 4 x 8 x 12 -> a 4 x 4 x 6 token grid ("wan_odd": 3 x 3 x 5)
        latent = (1, 4, 3, 6, 10) if family == "wan_odd" else (1, 4, 4, 8, 12)
        return dict(hidden_states=torch.randn(*latent, generator=g), timestep=torch.full((1,), 900.0),
                    encoder_hidden_states=torch.randn(1, 6, 32, generator=g), return_dict=False)
    h, w = 6, 8
    if family == "qwen":  # the last 3 of 6 text tokens are padding: rank 1's text shard is all padding
        mask = torch.ones(1, text, dtype=torch.long)
        mask[:, text // 2:] = 0
        return dict(hidden_states=torch.randn(1, h * w, 16, generator=g), encoder_hidden_states=torch.randn(1, text, 32, generator=g),
                    encoder_hidden_states_mask=mask, timestep=torch.tensor([0.5]), img_shapes=[[(1, h, w)]],
                    return_dict=False)
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None]
    return dict(hidden_states=torch.randn(1, h * w, 16, generator=g),
                encoder_hidden_states=torch.randn(1, text, 32, generator=g), pooled_projections=torch.randn(1, 16, generator=g),
                timestep=torch.tensor([0.5]), img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(text, 3), return_dict=False)


def run(family, method, options, parallel=None, patch_first=True, text=6):
    """The transformer's output with ``method`` (None: unpatched), under ``parallel`` (a
    ContextParallelConfig) enabled before or after patching; returns (output, patch stats dict)."""
    import fastdit

    model = build(family)
    patch = None
    if parallel is not None and not patch_first:
        model.enable_parallelism(config=parallel)
    if method is not None:
        patch = fastdit.patch(model, method, backend="torch", **options)
    if parallel is not None and patch_first:
        model.enable_parallelism(config=parallel)
    try:
        with torch.no_grad():
            out = model(**inputs(family, text))[0]
        return out, (None if patch is None else patch.stats.as_dict())
    finally:
        if patch is not None:  # the private backends it registered with diffusers go with it
            patch.remove()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world, port, jobs, results):
    """Run ``jobs`` (list of (key, family, method, options, patch_first, ring[, text])) under context
    parallelism of degree ``world``: ``ring`` False (Ulysses ``world``), True (ring ``world``) or a
    ``(ring_degree, ulysses_degree)`` pair; rank 0 puts ``{key: (output array, stats) or (None, error text)}``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.accelerator.device_count = lambda: 1
    from diffusers import ContextParallelConfig

    outputs = {}
    try:
        for key, family, method, options, patch_first, ring, *text in jobs:
            degrees = ring if isinstance(ring, tuple) else (world, 1) if ring else (1, world)
            parallel = ContextParallelConfig(ring_degree=degrees[0], ulysses_degree=degrees[1])
            try:
                out, stats = run(family, method, options, parallel, patch_first, *text)
                outputs[key] = (out.numpy(), stats)
            except Exception as error:  # noqa: BLE001 - the test reads the message
                outputs[key] = (None, f"{type(error).__name__}: {error}")
    finally:
        if rank == 0:
            results.put(outputs)
        dist.destroy_process_group()


def run_parallel(jobs, world=2, timeout=600):
    """Run ``jobs`` in ``world`` spawned gloo processes; rank 0's results."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=worker, args=(rank, world, port, jobs, results)) for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        outputs = results.get(timeout=timeout)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return outputs
