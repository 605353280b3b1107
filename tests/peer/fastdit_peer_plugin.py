"""pytest plugin: run other projects' model tests with every supported diffusers model patched by fastdit.

Not part of the project's own test run (the file name is not ``test_*``; nothing imports it). Enable it
with ``-p fastdit_peer_plugin`` (this folder on ``PYTHONPATH``) and choose the method by environment:

    FASTDIT_PEER_METHOD=sparge                                   # unset or empty: patch nothing
    FASTDIT_PEER_OPTIONS='{"dense_steps": 0, "dense_layers": 0}'  # keyword options of fastdit.patch
    FASTDIT_PEER_REPORT=/tmp/report.json                         # optional: the counts as JSON

Every ``diffusers.ModelMixin`` built during the session gets a forward pre-hook on the instance (the
diffusers classes and their forward code are left alone). At the instance's first forward the hook
removes itself and calls ``fastdit.patch(model, METHOD, **OPTIONS)``; a model fastdit has no adapter
for, or one where ``patch`` refuses the options, is left unpatched and counted. Each test's junit
record gets a ``fastdit_patched`` property naming the classes patched while it ran.
"""
import collections
import json
import os

import pytest
import torch

if not torch.cuda.is_available():  # as the project's own tests: Triton kernels run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

_STATE = {
    "method": None,
    "options": {},
    "patched": collections.Counter(),      # class name -> models patched
    "unsupported": collections.Counter(),  # class name -> models fastdit has no adapter for
    "refused": collections.Counter(),      # "class: error" -> models where patch() raised
    "current": [],                         # classes patched during the running test
    "stats": [],                           # each patch's PatchStats (summed in the report)
}
_ORIGINAL_INIT = None


def _first_forward(module, args, kwargs):
    """Forward pre-hook: patch ``module`` once, before its first forward, then remove this hook.

    ``fastdit.patch`` adds its own forward pre-hook, which torch would skip for the call already under
    way, so the hooks it added run here for this first call."""
    for key, hook in list(module._forward_pre_hooks.items()):
        if hook is _first_forward:
            del module._forward_pre_hooks[key]
            module._forward_pre_hooks_with_kwargs.pop(key, None)
    if getattr(module, "_fastdit_patch", None) is not None:  # patched already (e.g. by the test itself)
        return None
    import fastdit
    from fastdit.pipelines import UnsupportedModelError, find_adapter

    name = type(module).__name__
    try:
        find_adapter(module)
    except UnsupportedModelError:
        _STATE["unsupported"][name] += 1
        return None
    before = set(module._forward_pre_hooks)
    try:
        patch = fastdit.patch(module, _STATE["method"], **_STATE["options"])
    except Exception as error:  # noqa: BLE001 - counted and reported, the model runs unpatched
        _STATE["refused"][f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:160]}"] += 1
        return None
    _STATE["patched"][name] += 1
    _STATE["current"].append(name)
    _STATE["stats"].append(patch.stats)
    for key, hook in list(module._forward_pre_hooks.items()):
        if key in before:
            continue
        if key in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def _init_with_hook(self, *args, **kwargs):
    _ORIGINAL_INIT(self, *args, **kwargs)
    self.register_forward_pre_hook(_first_forward, with_kwargs=True)


def pytest_configure(config):
    global _ORIGINAL_INIT
    method = os.environ.get("FASTDIT_PEER_METHOD", "").strip()
    if not method or method == "none":
        return
    import fastdit

    if method not in fastdit.method_names():
        raise pytest.UsageError(f"FASTDIT_PEER_METHOD={method!r}: not one of {', '.join(fastdit.method_names())}")
    options = json.loads(os.environ.get("FASTDIT_PEER_OPTIONS", "") or "{}")
    if not isinstance(options, dict):
        raise pytest.UsageError("FASTDIT_PEER_OPTIONS must be a JSON object of fastdit.patch keyword options")
    _STATE["method"], _STATE["options"] = method, options
    from diffusers.models.modeling_utils import ModelMixin

    # ModelMixin.__init__ runs first thing in every diffusers model's __init__ (super().__init__());
    # wrapping it only adds the per-instance hook above, inside this test session.
    _ORIGINAL_INIT = ModelMixin.__init__
    ModelMixin.__init__ = _init_with_hook


def pytest_unconfigure(config):
    global _ORIGINAL_INIT
    if _ORIGINAL_INIT is not None:
        from diffusers.models.modeling_utils import ModelMixin

        ModelMixin.__init__ = _ORIGINAL_INIT
        _ORIGINAL_INIT = None
    path = os.environ.get("FASTDIT_PEER_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_summary(), f, indent=1, sort_keys=True)


def _calls():
    """Attention calls over every patch of the session: sparse, dense, fallback (by reason), guard."""
    calls = collections.Counter()
    reasons = collections.Counter()
    for stats in _STATE["stats"]:
        for key in ("sparse_calls", "dense_calls", "fallback_calls", "guard_head_calls", "guard_dense"):
            calls[key] += int(getattr(stats, key, 0) or 0)
        for reason, n in (getattr(stats, "fallbacks", None) or {}).items():
            reasons[str(reason)[:120]] += n if isinstance(n, int) else 1
    return {**calls, "fallback_reasons": dict(reasons)}


def _summary():
    return {"method": _STATE["method"], "options": _STATE["options"],
            "patched": dict(_STATE["patched"]), "unsupported": dict(_STATE["unsupported"]),
            "refused": dict(_STATE["refused"]), "calls": _calls()}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _STATE["current"] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    if _STATE["method"]:  # before the teardown report is made, so junit-xml carries it
        item.user_properties.append(("fastdit_patched", ",".join(sorted(set(_STATE["current"]))) or "-"))


def pytest_report_header(config):
    if _STATE["method"]:
        return f"fastdit peer plugin: patching every supported diffusers model with {_STATE['method']!r} {_STATE['options']}"
    return "fastdit peer plugin: no method (FASTDIT_PEER_METHOD unset), nothing patched"


def pytest_terminal_summary(terminalreporter):
    if not _STATE["method"]:
        return
    s = _summary()
    write = terminalreporter.write_line
    write(f"fastdit peer plugin ({s['method']} {s['options']}):")
    write(f"  patched:     {sum(s['patched'].values())} models " + json.dumps(s["patched"], sort_keys=True))
    write(f"  unsupported: {sum(s['unsupported'].values())} models " + json.dumps(s["unsupported"], sort_keys=True))
    calls = s["calls"]
    write(f"  attention calls: {calls.get('sparse_calls', 0)} sparse, {calls.get('dense_calls', 0)} dense, "
          f"{calls.get('fallback_calls', 0)} fallbacks {json.dumps(calls['fallback_reasons'], sort_keys=True)}; "
          f"guard: {calls.get('guard_dense', 0)} of {calls.get('guard_head_calls', 0)} head checks run dense")
    write(f"  refused:     {sum(s['refused'].values())} models")
    for reason, n in sorted(s["refused"].items()):
        write(f"    {n} x {reason}")
