"""Metrics: ``registry.py`` maps a metric name to what it computes (add a metric there); the metrics
themselves: ``fidelity.py`` (PSNR, SSIM, LPIPS against the dense output), ``fid.py``, ``clip_score.py``,
``vbench.py``.
"""
