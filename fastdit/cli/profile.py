"""``fastdit profile``: NVIDIA ModelOpt's ``sparse_attention_config``, read and written (docs/profiles.md).

    fastdit profile show exported/transformer --model tiny-wan     # what fastdit runs for it
    fastdit profile export skip.json --model tiny-wan --out exported/transformer

``show`` reads a component's ``config.json`` (or its folder) and prints each group and, with
``--model``, the fastdit method and options that run it on that model (checked against it).
``export`` writes a ``skip_softmax`` calibration (``fastdit.calibrate``) into a component's
``config.json`` (merged into what is there) for ModelOpt, TensorRT-LLM and vllm-omni.
"""
from __future__ import annotations

import json


def add_profile_parser(sub):
    from fastdit.cli.common import positive_int

    parser = sub.add_parser("profile", help="NVIDIA ModelOpt sparse-attention profiles (sparse_attention_config): "
                                            "show what fastdit runs for one, export a calibration as one")
    actions = parser.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="print a profile's groups and what fastdit runs for them")
    show.add_argument("profile", help="a component's config.json, or its folder")
    show.add_argument("--model", default=None, help="check the profile against this model and print fastdit's options")
    show.add_argument("--target-sparsity", type=float, default=None, help="override the profile's target sparsity")
    show.set_defaults(func=cmd_profile)
    export = actions.add_parser("export",
                                help="write a skip_softmax calibration as a profile into a component's config.json")
    export.add_argument("calibration", help="a calibration file of method skip_softmax (fastdit.calibrate)")
    export.add_argument("--model", required=True, help="the model the calibration was made on")
    export.add_argument("--out", required=True, help="the component folder or its config.json (merged when present)")
    export.add_argument("--keys", type=positive_int, default=None,
                        help="key count a fixed skip_threshold was meant for (default: the calibration's grid)")
    export.add_argument("--steps", type=positive_int, default=None,
                        help="the run's steps, for a fractional dense_steps")
    export.set_defaults(func=cmd_profile)
    return parser


def _load(model):
    from fastdit.cli.common import CLIError
    from fastdit.pipelines.loading import ModelNotFoundError, load_pipeline

    try:
        return load_pipeline(model)
    except ModelNotFoundError as error:
        raise CLIError(f"argument --model: {error}") from None


def cmd_profile(args):
    from fastdit.calibration.calibration_file import CalibrationError
    from fastdit.cli.common import CLIError
    from fastdit.integrations.profiles import profile_options, read_profile, write_profile

    try:
        if args.action == "export":
            written = write_profile(args.calibration, args.out, _load(args.model), keys=args.keys, steps=args.steps)
            print(json.dumps(written, indent=1))
            return 0
        profile = read_profile(args.profile, target_sparsity=args.target_sparsity)
        producer = profile.producer or {}
        print(f"profile {profile.source} (producer {producer.get('name', '?')} {producer.get('version', '')})".rstrip())
        for group in profile.groups:
            print(f"  {group.name}: algorithm {group.algorithm} -> fastdit method {group.method} {group.options}; "
                  f"targets {list(group.targets)}, ignore {list(group.ignore)}")
        if args.model:
            method, options = profile_options(profile, _load(args.model))
            print(f"on {args.model}: fastdit.patch(pipe, {method!r}, **{options})")
        return 0
    except (CalibrationError, ValueError) as error:
        raise CLIError(str(error), exit_code=1) from None
