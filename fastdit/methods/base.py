"""What every attention method shares: its config base class and the method registry.

A method is a config dataclass plus a function from a ``TokenLayout`` (and, for dynamic methods,
the call's ``q`` and ``k``) to a ``BlockPlan``. Methods know nothing of diffusers: model families
only change their defaults, through ``family_defaults``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

_REGISTRY = {}


@dataclass
class MethodConfig:
    """Options every method accepts.

    Attributes:
        dense_steps: denoising steps that run dense attention. An int counts steps; a float in
            [0, 1) is a fraction of the pipeline call's steps. Steps are counted from 0 within each
            pipeline call and step ``i`` runs dense iff ``i < dense_steps`` (for a fraction,
            ``i < dense_steps * num_steps``). None: the method's default for the model family.
        dense_layers: the first N patched layers always run dense. None: the family default.
    """

    dense_steps: int | float | None = None
    dense_layers: int | None = None

    def validate(self):
        steps = self.dense_steps
        if steps is not None:
            if isinstance(steps, bool) or not isinstance(steps, (int, float)):
                raise ValueError(f"dense_steps must be an int (count) or a float in [0, 1) (fraction), got {steps!r}")
            if isinstance(steps, float) and not 0.0 <= steps < 1.0:
                raise ValueError(f"dense_steps as a fraction must be in [0, 1), got {steps!r}; pass an int to count steps")
            if isinstance(steps, int) and steps < 0:
                raise ValueError(f"dense_steps must be >= 0, got {steps!r}")
        if self.dense_layers is not None and (
            isinstance(self.dense_layers, bool) or not isinstance(self.dense_layers, int) or self.dense_layers < 0
        ):
            raise ValueError(f"dense_layers must be an int >= 0, got {self.dense_layers!r}")


class Method:
    """Base class of attention methods. Subclasses set ``name`` and ``config_cls`` and implement
    ``plan`` (None means: run the model's own dense attention)."""

    name = ""
    config_cls = MethodConfig
    #: True when the plan depends on q/k (rebuilt every call) rather than only on the layout.
    dynamic = False
    #: Family name -> option defaults, for options left at None.
    family_defaults = {}
    #: Defaults for any family not listed.
    generic_defaults = {}

    def make_config(self, config=None, **options):
        """Build and validate the config from a config object and/or keyword options."""
        if config is not None and not isinstance(config, self.config_cls):
            raise ValueError(
                f"method {self.name!r} takes a {self.config_cls.__name__}, got {type(config).__name__}"
            )
        valid = [f.name for f in dataclasses.fields(self.config_cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for method {self.name!r}; valid options: {valid}")
        config = dataclasses.replace(config, **options) if config is not None else self.config_cls(**options)
        config.validate()
        return config

    def resolve(self, config, family):
        """Fill options left at None with the family's defaults (then the generic ones)."""
        defaults = {**MethodConfig(dense_steps=0, dense_layers=0).__dict__, **self.generic_defaults,
                    **self.family_defaults.get(family, {})}
        filled = {name: value for name, value in defaults.items()
                  if hasattr(config, name) and getattr(config, name) is None}
        config = dataclasses.replace(config, **filled)
        config.validate()
        return config

    def check_family(self, adapter, config):
        """Raise ValueError when the method does not apply to the adapter's model family."""

    def check_layout(self, layout, config):
        """Raise ValueError when the method cannot run on this layout (e.g. radial on one frame)."""

    def plan(self, layout, config, num_heads, device, q=None, k=None):
        """The ``BlockPlan`` for ``layout``, or None to run the model's own dense attention."""
        raise NotImplementedError


def register_method(method):
    """Register a ``Method`` instance under ``method.name`` (used by ``fastdit.patch``)."""
    if not method.name:
        raise ValueError("a method needs a name")
    _REGISTRY[method.name] = method
    return method


def get_method(name):
    if isinstance(name, Method):
        return name
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; available methods: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def method_names():
    return sorted(_REGISTRY)
