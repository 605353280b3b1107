"""The earlier name of :mod:`fastdit.calibration.calibration_file` (calibration files were called
"plan files"; "plan" now means ``BlockPlan``, the mask, only). Kept so that code importing the old
names keeps working: every name here is the one of ``calibration_file`` it stands for."""
from fastdit.calibration.calibration_file import (  # noqa: F401 (re-exported under the old names)
    CALIBRATION_FORMAT as PLAN_FORMAT,
    CALIBRATION_VERSION as PLAN_VERSION,
    CalibrationError as PlanError,
    calibration_options as plan_options,
    calibration_options_for as plan_options_for,
    check_calibration as check_plan,
    grid_reason,
    load_calibration as load_plan,
    model_facts,
    options_set_by,
    with_calibration as with_plan,
    write_calibration as write_plan,
)

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "PlanError", "check_plan", "grid_reason", "load_plan", "model_facts",
           "options_set_by", "plan_options", "plan_options_for", "with_plan", "write_plan"]
